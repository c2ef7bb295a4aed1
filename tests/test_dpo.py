"""stage: dpo's pairs (yatt/stages/dpo.py, yatt/stages/pairs.py) and a whole DPO job."""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from conftest import JobSpec, TinyModels, hosted_jobs, metric_records, write_jsonl
from yatt.assets.model import SMOLLM2, resolve_model
from yatt.config import ConfigError, DataConfig, load_config
from yatt.stages.dpo import pair_micro_batches, pair_samples
from yatt.stages.pairs import make_pairs


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model(SMOLLM2))


def _row(**fields):
    return SimpleNamespace(prompt_ids=[1, 2, 3], question="q", answer="7", entry={"answer": "7", **fields})


def test_pairs_are_chosen_then_rejected_and_bad_rows_counted(tok):
    rows = [_row(chosen="<answer>7</answer>", rejected="<answer>8</answer>"), _row(chosen="7"),
            _row(chosen="7", rejected=""), _row(chosen="7", rejected=8), _row(chosen="7", rejected="x " * 100)]
    samples, skipped = pair_samples(rows, DataConfig(), tok, max_len=64)
    assert skipped == 4 and len(samples) == 2
    assert [tok.decode(s.response_ids) for s in samples] == [f"<answer>{a}</answer>{tok.eos_token}" for a in (7, 8)]
    more, _ = pair_samples(rows[:1] * 5, DataConfig(), tok, max_len=64)
    micro = pair_micro_batches(more, token_budget=2 * (more[0].length + more[1].length), pad_id=0, packing="padded")
    assert [mb["index"].tolist() for mb in micro] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # whole pairs, in order


def test_make_pairs_pairs_the_ith_right_with_the_ith_wrong_response():
    rows = [SimpleNamespace(question=f"q{i}", answer=str(i)) for i in range(3)]
    groups = [["a", "b", "c"], ["d", "e"], ["f", "g"]]
    scores = [[0.0, 1.0, 1.0], [1.0, 1.0], [0.0, 0.01]]  # only the first has both
    assert make_pairs(rows, groups, scores) == [{"prompt": "q0", "chosen": "b", "rejected": "a", "answer": "0"}]
    groups, scores = [list("abcdef")], [[0.0, 1.0, 1.0, 0.5, 1.0, 1.0]]  # 4 right, 2 wrong: 2 disjoint pairs
    assert [(p["chosen"], p["rejected"]) for p in make_pairs(rows, groups, scores, per_prompt=3)] == [("b", "a"), ("c", "d")]
    assert len(make_pairs(rows, groups, scores, per_prompt=1)) == 1


def test_dpo_config_checks():
    with pytest.raises(ConfigError, match="stage: dpo trains the policy alone"):
        load_config("configs/dpo_smollm2.yaml", ["placement.mode=disaggregated"])
    with pytest.raises(ConfigError, match="ipo has none"):
        load_config("configs/dpo_smollm2.yaml", ["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"])


@hosted_jobs
def dpo_jobs(root: Path, models: TinyModels) -> dict[str, JobSpec]:
    """Two DPO steps of the tiny random policy on a pairs file with three bad rows (conftest's
    ``hosted`` fixture runs it, with the other modules' jobs)."""
    good = [{"prompt": f"Calculate {i} + 1.", "chosen": f"<answer>{i + 1}</answer>", "rejected": f"<answer>{i}</answer>",
             "answer": str(i + 1)} for i in range(8)]
    bad = ["not json", {"chosen": "x"}, {"prompt": "Calculate 9 + 1.", "chosen": "10", "answer": "10"}]
    return {"dpo": JobSpec("configs/dpo_smollm2.yaml", [
        f"model.path={models.policy}", f"data.train_files=[{write_jsonl(root / 'dpo_train.jsonl', good + bad)}]",
        f"data.eval_files=[{write_jsonl(root / 'dpo_eval.jsonl', good[:4])}]", "trainer.total_steps=2",
        "trainer.prompts_per_rank=3", "trainer.lr=1e-4", "eval.max_tokens=8", "log.progress=false"])}


@pytest.mark.slow
def test_dpo_job_trains_on_pairs_and_counts_bad_rows(hosted):
    """Two DPO steps of the tiny random policy on a pairs file with bad rows: the loss starts at
    log 2 (policy = reference), the held-out pairs are scored before and after, the bad rows are
    counted (two by the data loader, one without a rejected response by the stage)."""
    records = metric_records(hosted("dpo").out, drop=())
    train = [r for r in records if "dpo_loss" in r]
    evals = [r for r in records if "eval_pair_accuracy" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert train[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5) and train[0]["grad_norm"] > 0
    assert evals[0]["eval_pair_accuracy"] == 0.5 and evals[0]["eval_reward_margin"] == 0.0  # ties at the start
    assert evals[1]["eval_reward_margin"] != 0.0
    assert train[-1]["data_rows_skipped"] >= 2 and sum(r["dpo_rows_skipped"] for r in train) >= 1  # both, once drawn
