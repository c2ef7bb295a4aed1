"""Zero-signal samples left out of the update (yatt/algos/zero_signal.py): which configurations may
skip, the policy losses' claim that a zero advantage adds no loss and no gradient, the mini-batches
of the kept samples (cut as the full batch is cut) and the loss normaliser that still counts the
left-out ones. The update's equality with the full batch's under mpirun, with balancing:
tests/mpi/zero_signal.py (in the shared 2-rank job)."""
import re

import pytest
import torch

from yatt.algos.policy_loss import POLICY_LOSSES, ZERO_AT_ZERO_ADVANTAGE
from yatt.algos.update import mini_batch_norm, policy_update
from yatt.algos.zero_signal import skips_zero_signal, trained_mask
from yatt.config import AlgoConfig, load_config
from yatt.controller.batch import Sample, make_mini_batches, mini_batch_bounds, skipped_counts

PAD = 2


@pytest.mark.parametrize(("overrides", "skips"), [
    ({}, True),  # GRPO as the demo runs it
    ({"estimator": "dr_grpo", "loss_agg": "seq_mean_token_sum_norm"}, True),
    ({"estimator": "rloo", "policy_loss": "dual_clip"}, True),
    ({"policy_loss": "gspo", "loss_agg": "seq_mean_token_mean"}, True),
    ({"estimator": "mypkg.adv:fn"}, True),  # a user's outcome estimator: same contract
    ({"skip_zero_signal": False}, False),
    ({"kl_coef": 0.01}, False),  # the KL term reads every sample
    ({"entropy_coef": 0.01}, False),  # so does the entropy bonus
    ({"estimator": "reinforce_pp_baseline"}, False),  # token-level: whitening over the step
    ({"estimator": "reinforce_pp"}, False),
    ({"estimator": "gae"}, False),  # the critic's values
])
def test_which_algorithms_may_skip(overrides, skips):
    cfg = AlgoConfig(**overrides)
    assert skips_zero_signal(cfg) is skips
    assert trained_mask(cfg, [0.5, 0.0, -0.0, -1e-30]) == ([True, False, False, True] if skips else None)


def test_the_demo_recipe_skips():
    assert skips_zero_signal(load_config("configs/grpo_smollm2.yaml").algo)
    assert not skips_zero_signal(load_config("configs/ppo_smollm2.yaml").algo)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_a_zero_advantage_adds_no_loss_and_no_gradient(name):
    """The claim each registered loss makes (all of them do): where A == 0 the per-token loss is 0
    and so is its gradient, far from the clip range too (ratios up to e^2), for [B, 1] and [B, T]."""
    assert name in ZERO_AT_ZERO_ADVANTAGE
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    for adv in (torch.tensor([[0.0], [0.0], [1.5], [-0.7]]),
                torch.cat([torch.zeros(2, 6), torch.randn(2, 6, generator=g)])):
        lp = (old + torch.randn(4, 6, generator=g)).requires_grad_()
        terms = POLICY_LOSSES[name](lp, old, adv, mask, AlgoConfig(policy_loss=name))
        (terms.loss * mask).sum().backward()
        assert (terms.loss[:2] == 0).all() and (lp.grad[:2] == 0).all()
        assert (lp.grad[2:] != 0).any()  # the other rows do carry signal


def _samples(advantages):
    return [Sample([5] * (1 + i % 3), [7] * (1 + i % 4) if i != 3 else [], [-0.1] * ((1 + i % 4) if i != 3 else 0),
                   "stop", advantage=a) for i, a in enumerate(advantages)]


def test_kept_samples_stay_in_the_mini_batch_of_their_chunk():
    adv = [0.5, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0]
    samples, keep = _samples(adv), [a != 0 for a in adv]
    full = make_mini_batches(samples, 2, token_budget=1000, pad_id=PAD)
    kept = make_mini_batches(samples, 2, token_budget=1000, pad_id=PAD, keep=keep)
    for f, k in zip(full, kept):
        assert sorted(i for mb in k for i in mb["index"].tolist()) == [
            i for mb in f for i in sorted(mb["index"].tolist()) if keep[i]]
    assert [sorted(i for mb in k for i in mb["index"].tolist()) for k in kept] == [[0], [4]]
    all_zero = make_mini_batches(samples, 2, 1000, PAD, keep=[False] * 8)
    assert all_zero == [[], []]  # each optimizer step still runs, on nothing
    # left out per chunk: chunk 0 holds samples 1, 2, 3 (response lengths 2, 3, 0: two sequences)
    assert skipped_counts(samples, keep, mini_batch_bounds(8, 2)) == [(5.0, 2.0), (2.0 + 3.0 + 4.0, 3.0)]
    assert skipped_counts(samples, None, mini_batch_bounds(8, 2)) == [(0.0, 0.0), (0.0, 0.0)]


def test_the_normaliser_counts_what_was_left_out():
    adv = [0.5, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0]
    samples, keep = _samples(adv), [a != 0 for a in adv]
    full = make_mini_batches(samples, 2, 1000, PAD)
    kept = make_mini_batches(samples, 2, 1000, PAD, keep=keep)
    left = skipped_counts(samples, keep, mini_batch_bounds(8, 2))
    for f, k, s in zip(full, kept, left):
        assert mini_batch_norm(k, 48, None, s) == mini_batch_norm(f, 48, None)

    seen = []

    class Actor:  # records the normaliser and the micro-batches of every optimizer step
        def train_step(self, mbs, loss_fn, skip_update=None):
            seen.append((len(mbs), loss_fn.norm.tokens, loss_fn.norm.seqs))
            tokens = float(sum(mb["response_mask"].sum() for mb in mbs))
            return {"pg_loss": -tokens, "kl": 0.0, "ppo_kl": 0.0, "clip_frac": 0.0, "ratio": tokens, "entropy": 0.0,
                    "tokens": tokens, "grad_norm": 1.0, "lr": 0.1, "update_skipped": 0.0}

    out = policy_update(Actor(), [[], []], AlgoConfig(ppo_epochs=2, mini_batches=2), None, skipped=[(5.0, 2.0), (9.0, 3.0)])
    assert seen == [(0, 5.0, 2.0), (0, 9.0, 3.0)] * 2  # every optimizer step runs, normalised as the full batch
    assert out["grad_norm"] == (4.0, 4) and out["pg_loss"] == (0.0, 28.0)  # pg_loss counts the left-out tokens
    seen.clear()
    out = policy_update(Actor(), kept, AlgoConfig(mini_batches=2), None, skipped=left)
    assert seen == [(1, 1.0 + 5.0, 3.0), (1, 1.0 + 9.0, 4.0)]  # samples 0 and 4: one response token each
    assert out["pg_loss"] == (-2.0, 16.0) and out["ratio"] == (2.0, 2.0)  # ratio: the trained tokens only


@pytest.mark.mpi
@pytest.mark.slow
def test_skipping_gives_the_full_batch_update(shared_job):
    """tests/mpi/zero_signal.py in the shared 2-rank job (a tiny Llama in SmolLM2's shape; the script
    runs SmolLM2 itself with ``smollm2``): grad norms and weights equal the full batch's for GRPO
    (including a step that leaves every sample out) and with a KL term."""
    out = shared_job("ranks_2")
    assert out.count("zero_signal OK") == 2, out[-3000:]
    lines = re.findall(r"rank \d kl_coef (\S+) step (\d): .* left out (\d) of 6", out)
    assert sorted(lines) == sorted([("0.0", "1", "4"), ("0.0", "2", "6"), ("0.05", "2", "0")] * 2), lines
