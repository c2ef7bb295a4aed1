"""Numerics that cannot blow up (yatt/algos): every registered policy loss, loss aggregation,
estimator and stage loss fed NaN and inf at masked positions and log-ratios of +-1e4 gives a
finite loss and a finite gradient, equal to those with the masked positions zeroed."""
import itertools

import pytest
import torch

from yatt.algos.estimators import ESTIMATORS, advantages
from yatt.algos.gae import gae, gae_advantages
from yatt.algos.grpo import LOG_RATIO_BOUND, kl_penalty, masked
from yatt.algos.loss import PolicyLoss, ValueLoss
from yatt.algos.policy_loss import LOSS_AGGS, POLICY_LOSSES, LossNorm
from yatt.algos.preference import sequence_logprobs, sft_loss
from yatt.algos.token_advantages import reinforce_pp_advantages
from yatt.config import AlgoConfig

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
NORM = LossNorm(tokens=7.0, seqs=2.0, max_tokens=5.0)
POISON = (float("nan"), float("inf"), -float("inf"))


def _poisoned(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``x`` with NaN / +inf / -inf at every masked-out position."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(POISON), x.shape, generator=g)
    junk = torch.tensor(POISON)[picks]
    return torch.where(MASK.bool(), x, junk)


def _inputs(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"logprobs": -torch.rand(MASK.shape, generator=g) * scale,
            "old_logprobs": -torch.rand(MASK.shape, generator=g) * scale,
            "ref_logprobs": -torch.rand(MASK.shape, generator=g) * scale,
            "rollout_logprobs": -torch.rand(MASK.shape, generator=g) * scale,
            "entropy": torch.rand(MASK.shape, generator=g),
            "advantages": torch.randn(MASK.shape, generator=g)}


def _policy_loss(inputs: dict, name: str, agg: str, adv_per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = AlgoConfig(policy_loss=name, loss_agg=agg, kl_coef=0.1, entropy_coef=0.01)
    lp = inputs["logprobs"].clone().requires_grad_(True)
    ent = inputs["entropy"].clone().requires_grad_(True)
    mb = {k: inputs[k] for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs")}
    mb["response_mask"] = MASK
    mb["advantages"] = inputs["advantages"] if adv_per_token else inputs["advantages"][:, 1:2]  # column 1: a response token of both rows
    loss, stats = PolicyLoss(cfg, NORM, on_policy=True)(lp, ent, mb)
    loss.backward()
    assert all(torch.isfinite(v).all() for v in stats.values()), stats
    return loss.detach(), torch.cat([lp.grad.flatten(), ent.grad.flatten()])


@pytest.mark.parametrize("name,agg", list(itertools.product(sorted(POLICY_LOSSES), sorted(LOSS_AGGS))))
@pytest.mark.parametrize("adv_per_token", [False, True])
def test_policy_losses_ignore_what_masked_positions_hold(name, agg, adv_per_token):
    clean = {k: masked(v, MASK) for k, v in _inputs().items()}
    dirty = {k: _poisoned(v, seed=i) for i, (k, v) in enumerate(clean.items())}
    loss_c, grad_c = _policy_loss(clean, name, agg, adv_per_token)
    loss_d, grad_d = _policy_loss(dirty, name, agg, adv_per_token)
    assert torch.isfinite(loss_d) and torch.isfinite(grad_d).all()
    torch.testing.assert_close(loss_d, loss_c)
    torch.testing.assert_close(grad_d, grad_c)


@pytest.mark.parametrize("name,agg", list(itertools.product(sorted(POLICY_LOSSES), sorted(LOSS_AGGS))))
@pytest.mark.parametrize("log_ratio", [1e4, -1e4, 88.8, 25.0])
def test_policy_losses_stay_finite_at_extreme_log_ratios(name, agg, log_ratio):
    inputs = {k: masked(v, MASK) for k, v in _inputs().items()}
    inputs["logprobs"] = inputs["old_logprobs"] + log_ratio * MASK
    loss, grad = _policy_loss(inputs, name, agg, adv_per_token=True)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    bound = torch.exp(torch.tensor(LOG_RATIO_BOUND)) * inputs["advantages"].abs().max() * 10
    assert loss.abs() <= bound  # the ratio is at most e^20 (10: slack for the KL and entropy terms)


def test_ppo_clip_ratio_is_bounded_at_the_documented_constant():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[1e4, -1e4, 0.5]])
    terms = POLICY_LOSSES["ppo_clip"](lp, old, torch.ones(1, 1), torch.ones(1, 3), AlgoConfig())
    expected = torch.exp(torch.tensor([LOG_RATIO_BOUND, -LOG_RATIO_BOUND, 0.5]))
    torch.testing.assert_close(terms.ratio[0], expected)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_is_zero_and_gradient_free_at_masked_positions(estimator):
    lp = _poisoned(-torch.rand(MASK.shape)).requires_grad_(True)
    ref = _poisoned(-torch.rand(MASK.shape), seed=3)
    kl = kl_penalty(lp, ref, estimator, MASK)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and (kl[~MASK.bool()] == 0).all()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~MASK.bool()] == 0).all()


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_loss_ignores_what_masked_positions_hold(clip):
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(MASK.shape, generator=g) for _ in range(3)]

    def run(values, old, returns):
        v = values.clone().requires_grad_(True)
        loss, stats = ValueLoss(clip, NORM)(v, {"response_mask": MASK, "values": old, "returns": returns})
        loss.backward()
        assert all(torch.isfinite(s).all() for s in stats.values())
        return loss.detach(), v.grad

    loss_c, grad_c = run(*[masked(p, MASK) for p in parts])
    loss_d, grad_d = run(*[_poisoned(p, seed=i) for i, p in enumerate(parts)])
    torch.testing.assert_close(loss_d, loss_c)
    torch.testing.assert_close(grad_d, grad_c)


def _token_estimate(kind: str, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    mb = {"response_mask": MASK, "advantages": torch.tensor([[1.0], [0.0]])}
    for i, key in enumerate(("old_logprobs", "ref_logprobs", "values")):
        x = masked(-torch.rand(MASK.shape, generator=g), MASK)
        mb[key] = _poisoned(x, seed=i) if poison else x
    (gae_advantages if kind == "gae" else reinforce_pp_advantages)(
        [mb], *((0.1, 1.0, 0.95) if kind == "gae" else (0.1, 1.0)))
    return mb["advantages"], mb["returns"]


@pytest.mark.parametrize("kind", ["gae", "reinforce_pp"])
def test_token_estimators_ignore_what_masked_positions_hold(kind):
    adv_c, ret_c = _token_estimate(kind, poison=False)
    adv_d, ret_d = _token_estimate(kind, poison=True)
    assert torch.isfinite(adv_d).all() and torch.isfinite(ret_d).all()
    torch.testing.assert_close(adv_d, adv_c)
    torch.testing.assert_close(ret_d, ret_c)


def test_gae_itself_ignores_masked_rewards_and_values():
    g = torch.Generator().manual_seed(5)
    rewards, values = (masked(torch.randn(MASK.shape, generator=g), MASK) for _ in range(2))
    clean = gae(rewards, values, MASK, 1.0, 0.95)
    dirty = gae(_poisoned(rewards), _poisoned(values, seed=1), MASK, 1.0, 0.95)
    for c, d in zip(clean, dirty):
        torch.testing.assert_close(d, c)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_outcome_estimators_give_finite_advantages_for_extreme_rewards(name, scale):
    rewards = torch.tensor([[1.0, -1.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0]]) * scale
    adv = advantages(ESTIMATORS[name], rewards)  # raises on a non-finite advantage
    assert torch.isfinite(adv).all()
    if name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert (adv[1] == 0).all()  # equal rewards: no signal


def test_stage_losses_ignore_what_masked_positions_hold():
    lp_clean = masked(-torch.rand(MASK.shape), MASK)
    for fn in (lambda lp: sft_loss(lp, MASK, 7.0), lambda lp: sequence_logprobs(lp, MASK).sum()):
        grads = []
        for lp in (lp_clean, _poisoned(lp_clean)):
            lp = lp.clone().requires_grad_(True)
            out = fn(lp)
            out.backward()
            assert torch.isfinite(out)
            grads.append((out.detach(), lp.grad))
        torch.testing.assert_close(grads[1], grads[0])
