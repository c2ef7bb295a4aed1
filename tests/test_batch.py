"""Samples -> micro-batches, and group scoring."""
from types import SimpleNamespace

import pytest
import torch

from yatt.algos.estimators import grpo, outcome_advantages
from yatt.balance import split_micro_batches
from yatt.controller.batch import Sample, make_mini_batches, make_samples, pack_micro_batches

EOS = PAD = 2


def _samples():
    return [
        Sample([5, 6], [7, EOS], [-0.1, -0.2], "stop", advantage=0.5),
        Sample([5], [8, 9, 10, 11], [-1.0] * 4, "length", advantage=-0.5),
        Sample([1, 2, 3], [4, EOS], [-0.3, -0.4], "stop"),
        Sample([1], [EOS], [-0.05], "stop"),
    ]


def test_micro_batches_cover_every_sample_once_within_budget():
    samples = _samples()
    mbs = make_mini_batches(samples, 1, token_budget=7, pad_id=PAD)[0]
    seen = sorted(i for mb in mbs for i in mb["index"].tolist())
    assert seen == [0, 1, 2, 3]
    for mb in mbs:
        lens = [samples[i].length for i in mb["index"].tolist()]
        assert sum(lens) <= 7 or len(lens) == 1


def test_micro_batch_rows_masks_and_logprob_alignment():
    samples = _samples()
    (mb,) = pack_micro_batches(samples, [[0, 1, 2, 3]], pad_id=PAD)
    for row, i in enumerate(mb["index"].tolist()):
        s = samples[i]
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert mb["input_ids"][row, : p + r].tolist() == s.prompt_ids + s.response_ids
        assert (mb["input_ids"][row, p + r :] == PAD).all()
        assert mb["response_mask"][row].tolist() == [0.0] * p + [1.0] * r + [0.0] * (mb["input_ids"].shape[1] - p - r)
        assert torch.allclose(mb["rollout_logprobs"][row, p : p + r], torch.tensor(s.rollout_logprobs))
        assert mb["advantages"][row, 0] == s.advantage


def test_mini_batches_keep_global_indices():
    minis = make_mini_batches(_samples(), mini_batches=2, token_budget=1000, pad_id=PAD)
    assert [sorted(i for mb in mbs for i in mb["index"].tolist()) for mbs in minis] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="mini_batches=5"):
        make_mini_batches(_samples(), 5, 1000, PAD)


def test_shared_prompt_micro_batches_keep_each_group_whole():
    """Without a DP balancer (``balance.enabled: false``) shared-prompt micro-batches hold whole
    groups, so each prompt runs once: 4 groups of 8 (prompt 30, responses 40) under a budget of
    2 groups. Cutting by sample length alone put every group's samples in both micro-batches
    (each prompt twice, 240 more tokens)."""
    rows = [SimpleNamespace(prompt_ids=[10 + g] * 30) for g in range(4)]
    comp = SimpleNamespace(token_ids=[5] * 40, logprobs=[0.0] * 40, finish_reason="length")
    samples = make_samples(rows, [[comp] * 8 for _ in rows], [0.0] * 32, [1.0] * 32)
    budget = 2 * (30 + 8 * 40)
    (mbs,) = make_mini_batches(samples, 1, budget, PAD, packing="shared_prompt")
    groups = [sorted({i // 8 for i in mb["index"].tolist()}) for mb in mbs]
    assert groups == [[0, 1], [2, 3]]
    assert sorted(i for mb in mbs for i in mb["index"].tolist()) == list(range(32))
    assert sum(int(mb["body_tokens"][0]) for mb in mbs) == 4 * 30 + 32 * 40  # each prompt once
    blind = pack_micro_batches(samples, split_micro_batches([s.length for s in samples], budget), PAD, "shared_prompt")
    assert sum(int(mb["body_tokens"][0]) for mb in blind) > 4 * 30 + 32 * 40  # the old cut: prompts copied


def test_make_samples_rewards_and_advantages():
    rows = [SimpleNamespace(prompt_ids=[1]), SimpleNamespace(prompt_ids=[3])]
    comp = lambda ids: SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
    completions = [[comp([7, EOS]), comp([8, EOS])], [comp([9]), comp([9, EOS])]]
    rewards = [1.0, 0.0, 1.0, 1.0]
    samples = make_samples(rows, completions, rewards, outcome_advantages(grpo, [rewards[:2], rewards[2:]]))
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 1.0]
    assert samples[0].advantage > 0 > samples[1].advantage
    assert samples[2].advantage == samples[3].advantage == 0.0  # all-equal group
    assert samples[1].response_ids == [8, EOS] and samples[2].prompt_ids == [3]
    with pytest.raises(ValueError, match="3 rewards and 4 advantages for 4 samples"):
        make_samples(rows, completions, [1.0, 0.0, 1.0], [0.0] * 4)
    assert outcome_advantages(grpo, []) == []


def test_phase_timer_records_time_and_peak_memory(monkeypatch):
    """The background sampler sees memory a phase holds only in its middle. The phase holds its
    block until the sampler has read the RSS twice (the second read begins after the block exists),
    however slowly a loaded machine schedules the sampler's thread, instead of for a fixed time."""
    import threading
    import time

    import psutil

    from yatt.controller import metrics
    from yatt.controller.metrics import PhaseTimer

    reads = threading.Semaphore(0)

    class Counted(psutil.Process):
        def memory_info(self):
            info = super().memory_info()
            reads.release()
            return info

    monkeypatch.setattr(metrics.psutil, "Process", Counted)
    timer = PhaseTimer(interval_s=0.01)
    with timer("alloc"):
        block = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, touched
        held = psutil.Process().memory_info().rss / 2**30
        while reads.acquire(blocking=False):  # the reads so far may predate the block
            pass
        assert reads.acquire(timeout=60) and reads.acquire(timeout=60), "the sampler never ran"
        time.sleep(0.05)
        del block
    with timer("idle"):
        pass
    assert timer.times["time_alloc_s"] >= 0.05 and timer.times["time_idle_s"] < timer.times["time_alloc_s"]
    # the sampler saw at least what the phase held at its heaviest moment
    assert timer.peaks["mem_peak_alloc_gib"] >= held * 0.999 and timer.peaks["mem_peak_idle_gib"] > 0


def test_metrics_writer_starts_a_fresh_file(tmp_path):
    import json

    from yatt.controller.metrics import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text('{"step": 9}\n')
    writer = MetricsWriter(tmp_path, rank=0)
    writer.write({"step": 1, "x": float("nan")})
    MetricsWriter(tmp_path, rank=1).write({"step": 2})  # only rank 0 writes
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"step": 1, "x": None}]


def test_policy_update_reduces_stats_over_steps_and_first_epoch():
    from yatt.algos.update import policy_update
    from yatt.config import AlgoConfig

    class Actor:  # returns fixed per-step sums, the shape MegatronPolicy.train_step returns
        def train_step(self, mbs, loss_fn, skip_update=None):
            skipped = bool(skip_update and skip_update(2.0))
            out = {"pg_loss": 1.0, "kl": 0.0, "ppo_kl": 0.5, "clip_frac": 2.0, "ratio": 4.0, "entropy": 3.0,
                   "tokens": 4.0, "grad_norm": 2.0, "lr": 0.1, "update_skipped": float(skipped)}
            if loss_fn.on_policy:
                out.update(logprob_diff_rollout_vs_train=0.4, diff_tokens=4.0)
            return out

    minis = make_mini_batches(_samples(), mini_batches=2, token_budget=1000, pad_id=PAD)
    out = policy_update(Actor(), minis, AlgoConfig(ppo_epochs=3, mini_batches=2), None)
    assert out["pg_loss"] == (6.0, 24.0) and out["ratio"] == (24.0, 24.0)  # 6 steps x 4 tokens
    assert out["entropy"] == (6.0, 8.0)  # first epoch only
    assert out["logprob_diff_rollout_vs_train"] == (0.4, 4.0)  # the on-policy first mini-batch only
    assert out["grad_norm"] == (12.0, 6) and out["kl"] == out["ppo_kl"]  # kl_coef 0: KL to the rollout policy
    assert out["guard_skipped_updates"] == (0.0, 1.0)
    calls = iter(range(100))
    guarded = policy_update(Actor(), minis, AlgoConfig(ppo_epochs=3, mini_batches=2), None,
                            guard=lambda norm: next(calls) % 2 == 1)  # skip every second step
    assert guarded["guard_skipped_updates"] == (3.0, 1.0) and guarded["grad_norm"] == (6.0, 3)
    assert guarded["pg_loss"] == (3.0, 12.0)  # skipped steps add nothing


def test_phase_timer_warns_when_the_machine_runs_out_of_memory(monkeypatch, caplog):
    """Under 5% of the machine's memory available, a phase says so once, by name, before the kernel's
    OOM killer would end the rank silently; with memory to spare it says nothing. A later step's phase
    says it again only when clearly less is left."""
    import threading

    import psutil

    from yatt.controller import metrics
    from yatt.controller.metrics import PhaseTimer

    total, left = 24 << 30, [12 << 30]
    reads = threading.Semaphore(0)

    class Counted(psutil.Process):
        def memory_info(self):
            reads.release()
            return super().memory_info()

    monkeypatch.setattr(metrics.psutil, "Process", Counted)
    monkeypatch.setattr(metrics, "_low_memory_warned", {})  # this process's earlier warnings
    monkeypatch.setattr(metrics.psutil, "virtual_memory", lambda: SimpleNamespace(total=total, available=left[0]))
    timer = PhaseTimer(interval_s=0.001)
    with caplog.at_level("WARNING", logger="yatt"):
        for phase, available in (("rollout", 12 << 30), ("train", 1 << 30)):  # 1 GiB of 24: under 5%
            left[0] = available
            with timer(phase):
                for _ in range(4):  # several samples of each phase
                    assert reads.acquire(timeout=60)
    warnings = [r.getMessage() for r in caplog.records if "memory nearly exhausted" in r.getMessage()]
    assert len(warnings) == 1 and "during phase train" in warnings[0] and "1.0 of 24.0 GiB left" in warnings[0]
    assert timer.avail_min == 1 << 30  # the lowest point of both phases
    caplog.clear()
    with caplog.at_level("WARNING", logger="yatt"):  # the next steps: said again only when 0.5 GiB lower
        for available in (1 << 30, 900 << 20, 400 << 20):
            left[0] = available
            with PhaseTimer(interval_s=0.001)("train"):
                for _ in range(4):
                    assert reads.acquire(timeout=60)
    warnings = [r.getMessage() for r in caplog.records if "memory nearly exhausted" in r.getMessage()]
    assert len(warnings) == 1 and "0.4 of 24.0 GiB left" in warnings[0]

    # what would be left had the rank kept what it released: 2 GiB released during "judge" only
    released = [0]
    timer = PhaseTimer(interval_s=0.001, released_bytes=lambda: released[0])
    for phase, available, held in (("judge", 10 << 30, 2 << 30), ("train", 9 << 30, 0)):
        left[0], released[0] = available, held
        with timer(phase):
            for _ in range(4):
                assert reads.acquire(timeout=60)
    assert timer.avail_min == 8 << 30
