"""``python -m yatt.eval`` and the eval metrics: pass@k / mean@k against brute-force enumeration,
``evaluate`` with a stand-in engine, the CLI's checks (exit 2 before any model loads), and whole
evaluations on the packaged model (one process) and of the demo run's final checkpoint (``demo_run``,
``mpirun -np 2`` as the run: its greedy accuracy is the run's last eval record's)."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from yatt.algos.pass_at_k import mean_at_k, pass_at_k, reported_ks
from yatt.config import ConfigError, load_config
from yatt.controller.evaluate import evaluate

from conftest import DEMO_ARGS, DEMO_EVAL_SET, DEMO_RECIPE, ROOT, job_env, run_mpi

RECIPE = str(ROOT / "configs" / "grpo_smollm2.yaml")


# ------------------------------------------------------------------ pass@k, mean@k
def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of the k-subsets of n answers (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 1, 10) == 1.0
    assert 0.0 < pass_at_k(1000, 1, 500) < 1.0  # exact integers: no overflow, no cancellation
    for n, c, k in ((0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_mean_at_k_and_reported_ks():
    assert mean_at_k([True, False, True, True]) == 0.75
    with pytest.raises(ValueError):
        mean_at_k([])
    assert reported_ks(1) == [1] and reported_ks(8) == [1, 2, 4, 8] and reported_ks(6) == [1, 2, 4, 6]


# ------------------------------------------------------------------ evaluate with a stand-in engine
@dataclass
class _Row:
    prompt_ids: list[int]
    question: str = ""
    entry: dict | None = None


@dataclass
class _Completion:
    token_ids: list[int]


class _Engine:
    """Answers prompt i greedily with ``[greedy[i]]`` and sampled with the tokens of ``sampled[i]``."""

    def __init__(self, greedy, sampled):
        self.greedy, self.sampled, self.specs = greedy, sampled, []

    def generate(self, prompts, spec):
        self.specs.append(spec)
        if spec.temperature == 0:
            return [[_Completion([self.greedy[p[0]]])] for p in prompts]
        return [[_Completion([t]) for t in self.sampled[p[0]][:spec.n]] for p in prompts]


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return str(ids[0])


def _correct(rows, texts):
    return [1.0 if t == "1" else 0.0 for t in texts]


def test_evaluate_greedy_only_keeps_the_run_metrics():
    engine = _Engine(greedy=[1, 0, 1, 1], sampled=None)
    out = evaluate(engine, [_Row([i]) for i in range(4)], _correct, _Tokenizer(), max_tokens=16)
    assert out == {"eval_accuracy": 0.75, "eval_reward_mean": 0.75, "eval_response_len_mean": 1.0}
    (spec,) = engine.specs
    assert (spec.n, spec.temperature, spec.max_tokens) == (1, 0.0, 16)


def test_evaluate_k_samples_give_mean_and_pass_at_k():
    sampled = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]]  # 1, 0, 4, 2 correct of 4
    engine = _Engine(greedy=[0, 0, 1, 1], sampled=sampled)
    out = evaluate(engine, [_Row([i]) for i in range(4)], _correct, _Tokenizer(), max_tokens=8, k=4,
                   temperature=0.7, seed=5, prefix="")
    assert out["accuracy"] == 0.5
    assert out["mean_at_4"] == pytest.approx((1 + 0 + 4 + 2) / 16)
    for j in (1, 2, 4):
        assert out[f"pass_at_{j}"] == pytest.approx(sum(_brute_pass_at_k(4, c, j) for c in (1, 0, 4, 2)) / 4)
    assert (engine.specs[1].n, engine.specs[1].temperature, engine.specs[1].seed) == (4, 0.7, 5)


# ------------------------------------------------------------------ config and CLI checks
def test_eval_sets_config_is_checked():
    cfg = load_config(RECIPE, values={"eval.sets": [{"name": "chain", "type": "task", "task": "chain_sum", "size": 8},
                                                    {"name": "mine", "type": "files", "files": ["x.jsonl"]}]})
    assert [s.type for s in cfg.eval.sets] == ["task", "files"] and cfg.eval.k == 1
    for sets, match in (([{"name": "eval", "type": "task", "task": "x"}], "eval.sets\\[\\].name"),
                        ([{"name": "a", "type": "task", "task": "x"}, {"name": "a", "type": "task", "task": "y"}],
                         "the name 'a' is used twice"),
                        ([{"name": "a", "type": "files", "files": []}], "eval.sets\\[0\\].files")):
        with pytest.raises(ConfigError, match=match):
            load_config(RECIPE, values={"eval.sets": sets})


def test_sets_resolve_to_data_sections(tmp_path):
    from yatt.controller.eval_sets import resolve_sets as eval_sets

    data = tmp_path / "mine.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    cfg = load_config(RECIPE, values={"eval.sets": [{"name": "chain", "type": "task", "task": "chain_sum", "size": 8},
                                                    {"name": "mine", "type": "files", "files": [str(data)]}]})
    chain, mine = eval_sets(cfg, None)
    assert (chain.name, chain.data.source, chain.data.task, chain.data.eval_size, chain.task) == \
        ("chain", "reasoning_gym", "chain_sum", 8, "chain_sum")
    assert (mine.data.source, mine.data.eval_files, mine.task) == ("file", [str(data)], "basic_arithmetic")
    ev, task, adhoc = eval_sets(cfg, f"eval,leg_counting,{data}")
    assert ev.data is cfg.data and (task.name, task.data.eval_size) == ("leg_counting", 200)
    assert (adhoc.name, adhoc.data.eval_files) == ("mine", [str(data)])
    assert [s.name for s in eval_sets(load_config(RECIPE), None)] == ["eval"]


@pytest.mark.parametrize(("args", "message"), [
    (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint: no complete checkpoint in /nonexistent/ckpt"),
    (["--model", "/nonexistent/model"], "--model: /nonexistent/model is neither a folder nor a packaged model"),
    (["--sets", "eval,/nonexistent/set.jsonl"], "--sets: /nonexistent/set.jsonl does not exist"),
    (["--sets", "no_such_set"], "--sets: 'no_such_set' is not a set of eval.sets"),
    (["data.source=file", "data.train_files=[/a.jsonl]", "data.eval_files=[/nonexistent/e.jsonl]"],
     "config key 'data.eval_files[0]': /nonexistent/e.jsonl does not exist"),
    (["--limit", "0"], "--limit: must be >= 1"),
    (["--k", "0"], "config key 'eval.k'"),
])
def test_bad_options_exit_2_naming_the_option(args, message, capsys, monkeypatch):
    import yatt.eval as cli

    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("a model would load"))
    assert cli.main(["--config", RECIPE, *args]) == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_that_does_not_verify_is_refused(tmp_path, capsys, monkeypatch):
    import yatt.eval as cli

    step = tmp_path / "step_000001"
    (step / "model").mkdir(parents=True)
    (step / "model" / "tp0_pp0.pt").write_bytes(b"x")
    from yatt.checkpoint import files

    meta = {"format": files.FORMAT, "tp": 1, "pp": 1, "dtype": "float32", "model_path": "/m",
            "files": {"model/tp0_pp0.pt": {"bytes": 2, "crc32": 0}}}  # the shard has 1 byte
    (step / "meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("a model would load"))
    assert cli.main(["--config", RECIPE, "--checkpoint", str(step)]) == 2
    assert f"--checkpoint: {step} does not verify" in capsys.readouterr().err


def test_format_table():
    from yatt.eval import format_table

    text = format_table({"eval": {"rows": 4, "accuracy": 0.5, "pass_at_2": 0.75, "mean_at_2": 0.25, "pass_at_1": 0.25},
                         "empty": {"rows": 0}})
    head, first, second = text.splitlines()
    assert head.split() == ["set", "rows", "accuracy", "mean_at_2", "pass_at_1", "pass_at_2"]
    assert first.split() == ["eval", "4", "0.5000", "0.2500", "0.2500", "0.7500"]
    assert second.split() == ["empty", "0", "-", "-", "-", "-"]


# ------------------------------------------------------------------ whole evaluations
@pytest.mark.e2e
@pytest.mark.slow
def test_eval_of_the_packaged_model_one_process(tmp_path):
    out = tmp_path / "sub" / "eval.json"
    cmd = [sys.executable, "-m", "yatt.eval", "--config", RECIPE, "--limit", "4", "--k", "2", "--json", str(out),
           "eval.max_tokens=8", "log.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert (report["world_size"], report["k"], report["limit"], report["checkpoint"]) == (1, 2, 4, None)
    m = report["sets"]["eval"]
    assert m["rows"] == 4 and set(m) == {"rows", "accuracy", "reward_mean", "response_len_mean", "mean_at_2",
                                         "pass_at_1", "pass_at_2"}
    assert 0 <= m["response_len_mean"] <= 8 and m["pass_at_1"] == pytest.approx(m["mean_at_2"])
    assert 0 <= m["pass_at_1"] <= m["pass_at_2"] <= 1
    assert proc.stdout.splitlines()[-2].split()[:3] == ["set", "rows", "accuracy"]


@pytest.mark.e2e
@pytest.mark.slow
def test_eval_of_the_demo_checkpoint_matches_the_run(demo_run, tmp_path):
    """The demo run's final checkpoint, evaluated over the run's 2 ranks, gives the accuracy of
    the run's final eval record: the same rows, engine, sampling and weights."""
    records = [json.loads(line) for line in (demo_run.out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "eval_accuracy" in r][-1]
    out = tmp_path / "eval.json"
    run_mpi(["-m", "yatt.eval", "--config", DEMO_RECIPE, "--checkpoint", demo_run.out / "checkpoints",
             "--sets", "eval,chain", "--json", out, *DEMO_ARGS, DEMO_EVAL_SET, "log.progress=false"], ranks=2,
            timeout=300)
    report = json.loads(out.read_text())
    assert report["checkpoint"].endswith(f"step_{last['step']:06d}") and report["world_size"] == 2
    for name, prefix in (("eval", "eval_"), ("chain", "eval_chain_")):  # the data's eval split, and eval.sets
        m = report["sets"][name]
        assert (m["accuracy"], m["reward_mean"], m["response_len_mean"]) == \
            (last[f"{prefix}accuracy"], last[f"{prefix}reward_mean"], last[f"{prefix}response_len_mean"]), name
