"""Leaving zero-signal samples out gives the full batch's update, on 2 ranks with DP balancing,
through the step loop's own batching (``yatt.controller.experience.balanced_mini_batches``) and update (fp32).

    mpirun -np 2 python tests/mpi/zero_signal.py            # a tiny random Llama in SmolLM2's shape
    mpirun -np 2 python tests/mpi/zero_signal.py smollm2    # SmolLM2-135M-Instruct itself

The suite runs the tiny model (tied embeddings, SmolLM2's vocabulary; ~5 s): the property is the
batching's and the update's (which rows are trained, the normaliser, the optimizer steps), not the
model's, and SmolLM2's train steps cost ~50 s more here. With ``smollm2`` the same checks pass on
the real policy (docs/concepts.md, One step: the measured output).

Each rank holds 3 prompts x 2 responses (random tokens, 3-6 and 2-6 long). Each case runs twice
from the same weights and fresh AdamW moments, with ``algo.skip_zero_signal`` off and on:

- GRPO, step 1, two mini-batches: each rank's first group has signal, its other two have equal
  rewards; the first mini-batch trains the 4 samples with signal, the second trains nothing on any
  rank (its optimizer step still runs);
- GRPO, step 2: every group's rewards are equal, so every sample is left out and every rank runs
  both optimizer steps on nothing: Adam's moments from step 1 still move the weights, as in the
  full batch;
- GRPO with a KL term to the frozen initial policy (``kl_coef > 0``), one step (one mini-batch)
  from where GRPO's step 2 left the weights, on all-equal rewards again: every sample now
  contributes through the KL term, so none may be left out.

Checked: no sample left out under the KL term, all of step 2's under GRPO; the grad norm of every
step within GRAD_RTOL of the full batch's, and its weights after every step within WEIGHT_ATOL
but for a few (WEIGHT_FEW; see there); GRPO's step 2 moved most weights by more than WEIGHT_ATOL.
Prints ``zero_signal OK`` per rank.
"""
from __future__ import annotations

import copy
import os
import random
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
GRAD_RTOL = 1e-4  # the left-out rows change the micro-batches' shapes and the summation order only
LR = 1e-5
# Weights, after every step: at most WEIGHT_FEW of them differ from the full batch's by more than
# WEIGHT_ATOL, and none by more than 2 lr. Adam moves a weight by ~lr * g / (|g| + eps): where a gradient
# entry is near eps (1e-8) the update is sensitive to the order in which the micro-batches' partial
# sums were added (the left-out rows change that order), measured: 1-3 weights of some tensors off by
# 0.03-0.14 lr. A sample trained or left out wrongly, or an optimizer step not taken, moves most weights
# by ~lr. Adam's update is blind to the loss's scale: the grad norm (before clipping) checks the normaliser.
WEIGHT_ATOL, WEIGHT_FEW = LR / 10, 1e-5
TIED = [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
REWARDS = {  # per rank, per step: 3 groups of 2. Step 1: only each rank's first group has signal, so the
    0: ([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], TIED),  # first mini-batch (samples 0-2 of each rank) trains 4
    1: ([[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]], TIED),  # and leaves 2 out, the second (3-5) trains nothing
}


def _samples(rank: int, rewards, seed: int):
    """This rank's samples of one step: per group a prompt and 2 responses, random tokens (short: the
    property is the batching's and the update's, and SmolLM2's train steps cost by the token)."""
    from yatt.algos.estimators import grpo, outcome_advantages
    from yatt.controller.batch import Sample

    rng = random.Random(seed * 10 + rank)
    out = []
    for group in rewards:
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(3, 6))]
        for r, a in zip(group, outcome_advantages(grpo, [group])):
            n = rng.randint(2, 6)
            out.append(Sample(prompt, [rng.randrange(100, 40000) for _ in range(n)], [-1.0] * n, "stop",
                              reward=r, advantage=a))
    return out


def _snapshot(actor):
    """What a run starts from: the actor's weights and LR schedule (copies)."""
    return [p.detach().clone() for p in actor.module.parameters()], copy.deepcopy(actor.scheduler.state_dict())


def _restore(actor, snap) -> None:
    """Back to ``snap``'s weights, with fresh AdamW moments (each of the two runs compared starts
    with the same empty optimizer state: cheaper than copying the moments back)."""
    import torch

    weights, sched = snap
    with torch.no_grad():
        for p, w in zip(actor.module.parameters(), weights):
            p.copy_(w)
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        opt.optimizer.state.clear()  # torch's AdamW creates its moments again at its next step
    actor.scheduler.num_steps = 0  # as yatt.checkpoint.run_state restores it
    actor.scheduler.load_state_dict(sched)


def _weights(actor) -> list:
    """Copies of the actor's parameters (one tensor each: no flat copy of the whole model)."""
    return [p.detach().clone() for p in actor.module.parameters()]


def _weight_diff(a: list, b: list) -> tuple[float, float]:
    """(max |a - b|, the fraction of weights with |a - b| > WEIGHT_ATOL), tensor by tensor."""
    worst, off, total = 0.0, 0, 0
    for x, y in zip(a, b):
        d = (x - y).abs_()
        worst, off, total = max(worst, float(d.max())), off + int((d > WEIGHT_ATOL).sum()), total + d.numel()
    return worst, off / total


def _run(actor, ref, tok, cfg, rank: int, steps, full: list | None = None) -> list:
    """``steps`` (indices into this rank's :data:`REWARDS`) through the loop's batching and the
    update. Returns per step (grad norm, weights, samples left out on this rank), the weights only
    when ``full`` is None; else each step is checked against ``full``'s (the weights compared as
    they are made, so that one copy of them is kept)."""
    from yatt.algos.update import compute_logprobs, policy_update
    from yatt.algos.zero_signal import trained_mask
    from yatt.controller.rebalance import DpBalancer
    from yatt.controller.experience import balanced_mini_batches

    balancer = DpBalancer(cfg.trainer.balance, cfg.trainer.micro_batch_tokens)
    out = []
    for k, step in enumerate(steps):
        samples = _samples(rank, REWARDS[rank][step], step)
        keep = trained_mask(cfg.algo, [s.advantage for s in samples])
        minis, skipped = balanced_mini_batches(samples, keep, balancer, cfg, tok.pad_token_id, {})
        compute_logprobs(actor, ref, minis, recompute_old=True)
        sums = policy_update(actor, minis, cfg.algo, None, None, cfg.rollout.max_tokens, skipped)
        norm, left = sums["grad_norm"][0] / sums["grad_norm"][1], 0 if keep is None else keep.count(False)
        if full is None:
            out.append((norm, _weights(actor), left))
            continue
        ref_norm, ref_w, _ = full[k]
        worst, off = _weight_diff([p.detach() for p in actor.module.parameters()], ref_w)
        what = f"kl_coef {cfg.algo.kl_coef} step {step + 1}"
        assert abs(norm - ref_norm) <= GRAD_RTOL * ref_norm, f"{what}: grad norm {ref_norm!r} vs {norm!r}"
        assert off <= WEIGHT_FEW and worst <= 2 * LR, f"{what}: {off:.1e} of the weights off by > lr/10, max {worst:.1e}"
        print(f"rank {rank} {what}: grad norm {ref_norm:.6f} vs {norm:.6f}, weights max diff {worst:.1e} "
              f"({off:.1e} of them > lr/10), left out {left} of 6", flush=True)
        out.append((norm, None, left))
    return out


def main(*args: str) -> None:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from yatt.assets.model import SMOLLM2, resolve_model
    from yatt.config import load_config
    from yatt.dist import init_distributed
    from yatt.trainer import MegatronPolicy, OptimConfig

    from trainer_tp import tiny_model_dir

    info = init_distributed(threads=1)
    path = str(resolve_model(SMOLLM2) if "smollm2" in args else tiny_model_dir(info.rank, "zero_signal", model_type="llama",
                                                                               tied=True))
    tok = AutoTokenizer.from_pretrained(path)
    actor = MegatronPolicy(path, optim=OptimConfig(lr=LR, min_lr=LR, total_steps=8))
    ref = MegatronPolicy(path)  # frozen: the KL term's reference

    def both(overrides, steps):
        """The full batch's run, then the skipping run checked against it, from the same state.
        Returns both runs' per-step (grad norm, weights or None, samples left out on this rank)."""
        snap, runs = _snapshot(actor), []
        for skip in (False, True):
            cfg = load_config("configs/grpo_smollm2.yaml", [*overrides, f"algo.skip_zero_signal={skip}",
                                                            "trainer.micro_batch_tokens=40"])
            _restore(actor, snap)
            runs.append(_run(actor, ref if cfg.algo.kl_coef else None, tok, cfg, info.rank, steps, *runs))
        return runs

    full, kept = both(["algo.mini_batches=2"], (0, 1))
    assert _dist_sum([left for _, _, left in kept]) == [4.0 * 2, 6.0 * 2]  # step 1: 2 tied groups per rank; 2: all
    assert kept[1][0] == full[1][0] == 0.0  # step 2: no gradient, yet Adam's moments moved the weights:
    assert _weight_diff(full[0][1], full[1][1])[1] > 0.5  # (and the skipping run's are within WEIGHT_ATOL of these)
    del full
    _, kept = both(["algo.kl_coef=0.05", "algo.mini_batches=1"], (1,))  # from GRPO's weights: a KL gradient on tied groups
    assert _dist_sum([kept[0][2]]) == [0.0] and kept[0][0] > 0, kept
    print(f"rank {info.rank}: zero_signal OK", flush=True)
    dist.barrier()


def _dist_sum(values):
    """``values`` summed elementwise over the ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


if __name__ == "__main__":
    import torch.distributed as dist

    main(*sys.argv[1:])
    dist.destroy_process_group()
