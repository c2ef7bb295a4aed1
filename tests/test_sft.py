"""stage: sft's samples (yatt/stages/sft.py): targets from the template or a row field, EOS
appended, rows without a usable target skipped and counted."""
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from yatt.assets.model import SMOLLM2, resolve_model
from yatt.config import ConfigError, SftConfig, load_config
from yatt.stages.sft import sft_samples


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))


def _row(answer="7", **fields):
    return SimpleNamespace(prompt_ids=[1, 2, 3], question="q", answer=answer, entry={"answer": answer, **fields})


def test_targets_end_with_eos_and_bad_rows_are_counted(tok):
    samples, skipped = sft_samples([_row("7"), _row("12")], SftConfig(), tok, max_len=64)
    assert skipped == 0 and [s.prompt_ids for s in samples] == [[1, 2, 3]] * 2
    assert tok.decode(samples[1].response_ids) == "<answer>12</answer>" + tok.eos_token
    assert samples[0].rollout_logprobs == [0.0] * len(samples[0].response_ids) and samples[0].finish_reason == "stop"
    by_key = SftConfig(response_key="solution")
    rows = [_row(solution="It is 7."), _row(), _row(solution=""), _row(solution=7), _row(solution="x " * 100)]
    samples, skipped = sft_samples(rows, by_key, tok, max_len=64)  # missing, empty, not text, too long
    assert skipped == 4 and tok.decode(samples[0].response_ids) == "It is 7." + tok.eos_token


def test_sft_config_checks():
    recipe = "configs/sft_smollm2.yaml"
    assert load_config(recipe).stage == "sft"
    with pytest.raises(ConfigError, match="stage: sft trains the policy alone"):
        load_config(recipe, ["critic.enabled=true"])
    with pytest.raises(ConfigError, match="must contain"):
        load_config(recipe, ["sft.response_template=plain"])
