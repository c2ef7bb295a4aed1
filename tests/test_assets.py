"""Model materialisation: GGUF -> cached HF folder, atomic and idempotent."""
import pytest

from yatt.assets import model as assets


def test_packaged_model_converts_once_into_a_fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_CACHE", str(tmp_path))
    path = assets.resolve_model(assets.SMOLLM2)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert (path / "tokenizer.json").exists()
    calls = []
    monkeypatch.setattr(assets, "_convert_gguf", lambda *a: calls.append(a))
    assert assets.resolve_model(assets.SMOLLM2) == path and not calls  # cached: no second conversion


def test_interrupted_conversion_leaves_no_usable_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_CACHE", str(tmp_path))

    def crash(gguf, out):
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        assets.resolve_model(assets.SMOLLM2)
    models = tmp_path / "models"
    assert not (models / assets.SMOLLM2).exists()
    assert not list(models.iterdir())  # the temporary folder is removed too
    # a stale folder without the completion marker is rebuilt, never used
    stale = models / assets.SMOLLM2
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(assets, "_convert_gguf", lambda gguf, out: (out / "config.json").write_text('{"ok": 1}'))
    path = assets.resolve_model(assets.SMOLLM2)
    assert (path / "config.json").read_text() == '{"ok": 1}' and (path / ".yatt_complete").exists()


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert assets.resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="no config.json"):
        assets.resolve_model(str(tmp_path.parent))
    with pytest.raises(FileNotFoundError, match="not a folder and not a packaged model"):
        assets.resolve_model("no-such-model")
