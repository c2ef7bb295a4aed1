"""stage: rm (yatt/stages/rm.py): samples in the reward model's layout, and a whole job whose
exported reward model, served by the reward_model source's vLLM engine, scores the held-out pairs
as the trainer did."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from conftest import JobSpec, TinyModels, hosted_jobs, metric_records, write_jsonl
from yatt.assets.model import SMOLLM2, resolve_model
from yatt.config import ConfigError, DataConfig, load_config
from yatt.reward.reward_model import chat_ids
from yatt.stages.rm import rm_samples


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))


def test_samples_are_the_scored_layout_plus_the_read_position(tok):
    rows = [SimpleNamespace(question="What is 3 + 4?", answer="7", entry={"chosen": "7", "rejected": "8"}),
            SimpleNamespace(question="q", answer="7", entry={"chosen": "7"}),
            SimpleNamespace(question="q", answer="7", entry={"chosen": "7", "rejected": "x " * 300})]
    samples, skipped = rm_samples(rows, DataConfig(), tok, max_len=256)
    assert skipped == 2 and len(samples) == 2  # no rejected; too long
    for s, text in zip(samples, ("7", "8")):  # the value at the extra EOS reads the layout's last token
        assert s.prompt_ids == chat_ids(tok, "What is 3 + 4?", text, 256) and s.response_ids == [tok.eos_token_id]


def test_rm_config_checks():
    with pytest.raises(ConfigError, match="stage: rm trains the policy alone"):
        load_config("configs/rm_smollm2.yaml", ["critic.enabled=true"])


@hosted_jobs
def rm_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """Two Bradley-Terry steps on the tiny random policy's body, a row without a rejected response
    among the pairs (conftest's ``hosted`` fixture runs it, with the other modules' jobs)."""
    good = [{"prompt": f"Calculate {i} + 1.", "chosen": f"<answer>{i + 1}</answer>", "rejected": f"I think {i}",
             "answer": str(i + 1)} for i in range(8)]
    no_rejected = {"prompt": "x", "answer": "1"}
    return {"rm": JobSpec("configs/rm_smollm2.yaml", [
        f"model.path={models.policy}", f"data.train_files=[{write_jsonl(root / 'rm_train.jsonl', good + [no_rejected])}]",
        f"data.eval_files=[{write_jsonl(root / 'rm_eval.jsonl', good[:6])}]", "trainer.total_steps=2",
        "trainer.prompts_per_rank=3", "trainer.lr=1e-2", "trainer.min_lr=1e-2", "eval.max_tokens=4", "log.progress=false"])}


@pytest.mark.slow
def test_rm_job_exports_a_reward_model_that_scores_as_trained(hosted, tmp_path, capsys):
    """Two Bradley-Terry steps of a reward model on the tiny random policy's body (its head drawn
    at random, the stage's default; a high LR so the margin moves), exported with --role critic:
    the reward_model source's vLLM pooling engine gives the held-out pairs the margin and accuracy
    of the trainer's last eval."""
    from yatt.export import main as export
    from yatt.reward.genrm import JudgeItem
    from yatt.reward.reward_model import RewardModelScorer

    out = hosted("rm").out
    records = metric_records(out, drop=())
    train = [r for r in records if "rm_loss" in r]
    evals = [r for r in records if "eval_pair_accuracy" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["rm_loss"]) for r in train)
    assert evals[0]["eval_reward_margin"] != 0.0  # a random head (a zero one gives every response 0)
    assert evals[-1]["eval_reward_margin"] != evals[0]["eval_reward_margin"]  # and it trained
    assert sum(r["rm_rows_skipped"] for r in train) >= 1
    # the reward model is trained alone: no policy is built, saved or synced into an engine
    final = sorted((out / "checkpoints").glob("step_*"))[-1]
    assert sorted(p.name for p in (final / "model").iterdir()) == ["critic_tp0_pp0.pt"]
    assert all(r.get("time_sync_s", 0.0) == 0.0 for r in train)
    assert export([str(out / "checkpoints"), str(tmp_path / "policy")]) == 2
    assert "export it with --role critic" in capsys.readouterr().err
    assert export([str(out / "checkpoints"), str(tmp_path / "rm"), "--role", "critic"]) == 0
    rows = [json.loads(line) for line in (out.parent / "rm_eval.jsonl").read_text().splitlines()]
    rm = RewardModelScorer(str(tmp_path / "rm"), max_length=256)
    chosen = [r.score for r in rm.score([JudgeItem(x["prompt"], x["chosen"], "") for x in rows])]
    rejected = [r.score for r in rm.score([JudgeItem(x["prompt"], x["rejected"], "") for x in rows])]
    margin = sum(a - b for a, b in zip(chosen, rejected)) / len(rows)
    assert margin == pytest.approx(evals[-1]["eval_reward_margin"], rel=1e-3, abs=1e-5)
    assert sum(a > b for a, b in zip(chosen, rejected)) / len(rows) == pytest.approx(evals[-1]["eval_pair_accuracy"])
    rm.engine.shutdown()
