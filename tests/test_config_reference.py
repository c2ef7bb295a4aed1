"""docs/config.md is generated from the typed config and must match it."""
import pytest

from yatt import config_reference
from yatt.config import Config


def test_reference_is_up_to_date():
    assert config_reference.main(["--check"]) == 0, "run: python -m yatt.config_reference"


def test_every_key_is_documented_with_type_default_and_range():
    text = config_reference.render()
    for key in ("seed", "trainer.total_steps", "trainer.guard.spike_factor", "reward.genrm.timeout_s",
                "checkpoint.keep_last", "fault.timeout_s"):
        assert f"| `{key}` |" in text
    assert '| `trainer.guard.action` | one of "skip", "rollback" | `"skip"` |  |' in text
    assert "| `rollout.top_p` | float | `1.0` | > 0, <= 1 |" in text
    assert "| `fault.stall_s` | float or null | `null` | > 0 |" in text


def test_a_field_without_description_is_refused(monkeypatch):
    field = Config.model_fields["seed"]
    monkeypatch.setattr(field, "description", None)
    with pytest.raises(ValueError, match="'seed' has no description"):
        config_reference.render()


def test_check_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    monkeypatch.setattr(config_reference, "DOC", stale)
    assert config_reference.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
