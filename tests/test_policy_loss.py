"""Policy losses and loss aggregations by name (yatt/algos/policy_loss.py), the actor's loss
(yatt/algos/loss.py) and their config keys: hand-computed values, gradients, and the same loss on
one rank as on two."""
import math
import typing

import pytest
import torch

from yatt.algos.loss import PolicyLoss
from yatt.algos.policy_loss import LOSS_AGGS, POLICY_LOSSES, LossNorm
from yatt.config import AlgoConfig, ConfigError, load_config

RECIPE = "configs/grpo_smollm2.yaml"


def _terms(name, ratios, advantages, mask=None, **cfg):
    old = torch.zeros(1, len(ratios))
    lp = torch.log(torch.tensor([ratios]))
    mask = torch.ones_like(old) if mask is None else torch.tensor([mask])
    return POLICY_LOSSES[name](lp, old, torch.tensor([advantages]), mask, AlgoConfig(policy_loss=name, **cfg))


def test_ppo_clip_and_dual_clip_hand_computed():
    t = _terms("ppo_clip", [1.5, 0.5, 1.1], [1.0, -1.0, 1.0])
    # r=1.5, A=1: clipped at 1.28; r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); r=1.1 inside the range
    torch.testing.assert_close(t.loss, torch.tensor([[-1.28, 0.8, -1.1]]))
    assert t.clipped.tolist() == [[True, True, False]]
    d = _terms("dual_clip", [5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], clip_ratio_c=3.0)
    # A<0, r=5: PPO's 5 is bounded by c*|A| = 3; r=2: 2 < 3 stays; A>0: PPO's clip (-1.28)
    torch.testing.assert_close(d.loss, torch.tensor([[3.0, 2.0, -1.28]]))
    assert d.clipped.tolist() == [[True, False, True]]  # r=2, A<0: PPO's unclipped branch, under the bound


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    # token log-ratios 0.1 and 0.3, a padded third position: s = exp(0.2), clipped at 1 + 4e-4 for A > 0
    t = _terms("gspo", [math.exp(0.1), math.exp(0.3), 50.0], [1.0, 1.0, 1.0], mask=[1.0, 1.0, 0.0])
    torch.testing.assert_close(t.ratio[0, :2], torch.full((2,), math.exp(0.2)))
    torch.testing.assert_close(t.loss[0, :2], torch.full((2,), -(1 + 4e-4)))
    assert t.clipped[0, :2].all()
    # inside the clip range the gradient of each token's logprob is -A * s / |y| (seq_mean_token_mean)
    old = torch.zeros(1, 2)
    lp = torch.tensor([[1e-4, -1e-4]], requires_grad=True)
    mask, adv = torch.ones(1, 2), torch.tensor([[2.0]])
    cfg = AlgoConfig(policy_loss="gspo", loss_agg="seq_mean_token_mean")
    terms = POLICY_LOSSES["gspo"](lp, old, adv, mask, cfg)
    LOSS_AGGS["seq_mean_token_mean"](terms.loss, mask, LossNorm(2, 1, 4)).backward()
    assert not terms.clipped.any()
    torch.testing.assert_close(lp.grad, torch.full((1, 2), -2.0 * 1.0 / 2))  # s = exp(0) = 1


def test_aggregations_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    norm = LossNorm(tokens=4, seqs=2, max_tokens=5)
    assert LOSS_AGGS["token_mean"](values, mask, norm).item() == pytest.approx(10 / 4)
    assert LOSS_AGGS["seq_mean_token_mean"](values, mask, norm).item() == pytest.approx((2 + 4) / 2)
    assert LOSS_AGGS["seq_mean_token_sum_norm"](values, mask, norm).item() == pytest.approx(10 / (5 * 2))


def _micro_batch(seed: int, rows: int, width: int = 6) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for b in range(rows):
        start = int(torch.randint(1, 3, (1,), generator=gen))
        mask[b, start:start + int(torch.randint(1, width - start + 1, (1,), generator=gen))] = 1.0
    old = -torch.rand(rows, width, generator=gen)
    return {"response_mask": mask, "old_logprobs": old, "rollout_logprobs": old,
            "ref_logprobs": old - 0.1 * torch.rand(rows, width, generator=gen),
            "advantages": torch.randn(rows, 1, generator=gen),
            "logprobs": old + 0.05 * torch.randn(rows, width, generator=gen),
            "entropy": torch.rand(rows, width, generator=gen)}


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("loss_agg", sorted(LOSS_AGGS))
def test_the_loss_and_its_gradient_on_one_rank_equal_two_ranks_halves(policy_loss, loss_agg):
    """The mini-batch split over two micro-batches (or DP ranks) with the whole mini-batch's counts
    sums to the loss of one micro-batch holding it all, gradient included; KL and entropy terms on."""
    cfg = AlgoConfig(policy_loss=policy_loss, loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01)
    whole = _micro_batch(0, 5)
    halves = [{k: v[:2] for k, v in whole.items()}, {k: v[2:] for k, v in whole.items()}]
    norm = LossNorm(tokens=float(whole["response_mask"].sum()), seqs=5.0, max_tokens=6.0)

    def loss_and_grad(mbs):
        lp = whole["logprobs"].clone().requires_grad_(True)
        ent = whole["entropy"].clone().requires_grad_(True)
        total, rows = 0.0, 0
        for mb in mbs:
            n = mb["response_mask"].shape[0]
            total = total + PolicyLoss(cfg, norm)(lp[rows:rows + n], ent[rows:rows + n], mb)[0]
            rows += n
        total.backward()
        return total.detach(), lp.grad, ent.grad

    for a, b in zip(loss_and_grad([whole]), loss_and_grad(halves)):
        torch.testing.assert_close(a, b)


def test_policy_loss_adds_kl_and_subtracts_the_entropy_bonus():
    mb = _micro_batch(1, 3)
    mask, lp, ent = mb["response_mask"], mb["logprobs"], mb["entropy"]
    norm = LossNorm(tokens=float(mask.sum()), seqs=3.0, max_tokens=6.0)
    plain = PolicyLoss(AlgoConfig(), norm)
    both = PolicyLoss(AlgoConfig(kl_coef=0.5, entropy_coef=0.2), norm)
    assert not plain.entropy_grad and both.entropy_grad
    loss0, stats0 = plain(lp, ent, mb)
    loss1, stats1 = both(lp, ent, mb)
    d = mb["ref_logprobs"] - lp
    kl = ((torch.expm1(d) - d) * mask).sum() / mask.sum()  # k3
    entropy = (ent * mask).sum() / mask.sum()
    torch.testing.assert_close(loss1, loss0 + 0.5 * kl - 0.2 * entropy)
    assert stats0["kl"] == 0 and stats1["kl"] == pytest.approx(float(kl * mask.sum()), rel=1e-5)
    assert stats1["entropy"] == pytest.approx(float((ent * mask).sum()))


def test_config_names_the_registered_losses_and_rejects_keys_of_another_loss():
    assert set(typing.get_args(AlgoConfig.model_fields["policy_loss"].annotation)) == set(POLICY_LOSSES)
    assert set(typing.get_args(AlgoConfig.model_fields["loss_agg"].annotation)) == set(LOSS_AGGS)
    cfg = load_config(RECIPE, ["algo.policy_loss=gspo", "algo.loss_agg=seq_mean_token_mean"])
    assert cfg.algo.policy_loss == "gspo"  # the recipe's clip ratios are the defaults: accepted
    for overrides, message in [
        (["algo.policy_loss=clip"], "config key 'algo.policy_loss'"),
        (["algo.clip_ratio_c=2.0"], "algo.clip_ratio_c: read by algo.policy_loss=dual_clip only"),
        (["algo.seq_clip_ratio_low=0.001"], "algo.seq_clip_ratio_low: read by algo.policy_loss=gspo only"),
        (["algo.policy_loss=gspo", "algo.clip_ratio_high=0.4"], "algo.clip_ratio_high: read by algo.policy_loss "
                                                                "ppo_clip or dual_clip only, not policy_loss=gspo"),
        (["algo.policy_loss=dual_clip", "algo.clip_ratio_c=1.0"], "algo.clip_ratio_c"),
        (["algo.entropy_coef=-0.1"], "algo.entropy_coef"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(RECIPE, overrides)
    assert load_config(RECIPE, ["algo.policy_loss=dual_clip", "algo.clip_ratio_c=2.5"]).algo.clip_ratio_c == 2.5
