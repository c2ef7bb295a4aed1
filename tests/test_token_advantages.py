"""REINFORCE++'s token stage (yatt/algos/token_advantages.py) and its estimators' config keys:
hand-computed token rewards, returns and whitening; a truncated response and pad == EOS; the step's
moments are sums, so splitting the step over ranks (an all-reduce of them) changes nothing."""
import pytest
import torch

from yatt.algos.estimators import ESTIMATORS
from yatt.algos.kl_control import KLController
from yatt.algos.token_advantages import (discounted_returns, reinforce_pp_advantages, token_rewards,
                                         whitening_moments)
from yatt.algos.update import finish_advantages
from yatt.config import TOKEN_ESTIMATORS, AlgoConfig, ConfigError, load_config

RECIPE = "configs/grpo_smollm2.yaml"
EOS = PAD = 2
# row 0: prompt of 1, response of 3 ending in EOS, then a pad that is also EOS; row 1: prompt of 2,
# a response of 2 cut at max_tokens (no EOS); mask from lengths, never from token ids
IDS = torch.tensor([[5, 7, 8, EOS, PAD], [5, 6, 9, 9, PAD]])
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]])


def test_token_rewards_put_the_score_on_the_last_response_token_and_kl_on_every_one():
    kl = torch.full((2, 5), 0.5)
    r = token_rewards(torch.tensor([[2.0], [-1.0]]), kl, MASK, beta=0.1)
    torch.testing.assert_close(r, torch.tensor([[0.0, -0.05, -0.05, 1.95, 0.0],
                                                [0.0, 0.0, -0.05, -1.05, 0.0]]))
    # no KL term; a row without response tokens gets nothing
    empty = torch.zeros(1, 5)
    torch.testing.assert_close(token_rewards(torch.tensor([3.0]), None, empty, beta=0.1), torch.zeros(1, 5))


def test_discounted_returns_hand_computed():
    r = torch.tensor([[0.0, 1.0, 2.0, 4.0, 9.0]])  # the 9 is outside the response
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(r, mask, gamma=0.5),
                               torch.tensor([[0.0, 1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0, 0.0]]))
    torch.testing.assert_close(discounted_returns(r, mask, gamma=1.0), torch.tensor([[0.0, 7.0, 6.0, 4.0, 0.0]]))


def test_whitening_moments_are_sums_so_any_split_of_the_step_gives_the_same():
    gen = torch.Generator().manual_seed(0)
    values, masks = torch.randn(6, 7, generator=gen), (torch.rand(6, 7, generator=gen) > 0.3).float()
    whole = whitening_moments([values], [masks])
    split = whitening_moments([values[:1], values[1:4], values[4:]], [masks[:1], masks[1:4], masks[4:]])
    picked = values[masks > 0]
    assert whole == pytest.approx(split) and whole == pytest.approx((picked.mean().item(), picked.std().item()))
    assert whitening_moments([torch.ones(1, 3)], [torch.tensor([[0.0, 1.0, 0.0]])]) == (0.0, 1.0)  # < 2 tokens


def test_reinforce_pp_advantages_whiten_the_returns_over_every_micro_batch():
    old = torch.full((2, 5), -1.0)
    mbs = [{"response_mask": MASK[:1], "advantages": torch.tensor([[1.0]]), "old_logprobs": old[:1],
            "ref_logprobs": old[:1] - 0.2},
           {"response_mask": MASK[1:], "advantages": torch.tensor([[0.0]]), "old_logprobs": old[1:],
            "ref_logprobs": old[1:] - 0.2}]
    reinforce_pp_advantages(mbs, beta=0.5, gamma=1.0)
    # token rewards -0.1 per token (KL 0.2), + the score at the end; returns from each token to the end
    returns = torch.tensor([0.7, 0.8, 0.9, -0.2, -0.1])
    mean, std = returns.mean(), returns.std()
    torch.testing.assert_close(mbs[0]["returns"][0, 1:4], returns[:3])
    torch.testing.assert_close(mbs[0]["advantages"], ((torch.tensor([[0.0, 0.7, 0.8, 0.9, 0.0]]) - mean) / std) * MASK[:1])
    torch.testing.assert_close(mbs[1]["advantages"][0, 2:4], (returns[3:] - mean) / std)
    assert mbs[1]["advantages"][0, 4] == 0 and mbs[1]["advantages"][0, :2].eq(0).all()  # pad == EOS: not scored


def test_finish_advantages_runs_the_token_stage_only_for_token_estimators():
    mb = {"response_mask": MASK, "advantages": torch.tensor([[1.0], [0.0]]), "old_logprobs": torch.zeros(2, 5)}
    kept = [dict(mb)]
    finish_advantages([kept], AlgoConfig(estimator="grpo"))
    assert kept[0]["advantages"].shape == (2, 1)  # an outcome advantage is final
    finish_advantages([kept], AlgoConfig(estimator="reinforce_pp"))  # beta 0: no reference logprobs needed
    assert kept[0]["advantages"].shape == (2, 5) and "returns" in kept[0]


def test_outcome_stages_and_config_keys():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    torch.testing.assert_close(ESTIMATORS["reinforce_pp"](rewards), rewards)  # the score itself
    torch.testing.assert_close(ESTIMATORS["reinforce_pp_baseline"](rewards), rewards - rewards.mean(-1, keepdim=True))
    assert set(TOKEN_ESTIMATORS) <= set(ESTIMATORS)
    cfg = load_config(RECIPE, ["algo.estimator=reinforce_pp", "algo.kl_in_reward=0.01", "algo.gamma=0.99",
                               "rollout.n=1"])  # no group: one response per prompt is enough
    assert cfg.algo.kl_in_reward == 0.01 and cfg.algo.gamma == 0.99
    for overrides, message in [
        (["algo.kl_in_reward=0.01"], "algo.kl_in_reward: read by the reinforce_pp and gae estimators only"),
        (["algo.estimator=rloo", "algo.gamma=0.9"], "algo.gamma: read by the reinforce_pp and gae estimators only"),
        (["algo.estimator=reinforce_pp_baseline", "rollout.n=1"], "rollout.n: the reinforce_pp_baseline advantage"),
        (["algo.estimator=reinforce_pp", "algo.gamma=0"], "algo.gamma"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(RECIPE, overrides)


def test_kl_controller_hand_computed():
    """Ziegler et al. 2019's proportional controller: e = clip(KL / target - 1, +-0.2), beta *= 1 + e * min(n / horizon, 1)."""
    fixed = KLController(0.1)  # target 0: beta stays
    assert fixed.update(kl=5.0, n_samples=64) == 0.1
    ctrl = KLController(0.1, target=0.5, horizon=100)
    assert ctrl.update(kl=1.5, n_samples=10) == pytest.approx(0.1 * 1.02)  # e = +0.2 (clipped from 2)
    assert ctrl.update(kl=0.45, n_samples=10) == pytest.approx(0.1 * 1.02 * 0.99)  # e = -0.1
    state = ctrl.state_dict()
    assert ctrl.update(kl=0.0, n_samples=1000) == pytest.approx(0.1 * 1.02 * 0.99 * 0.8)  # K capped at 1
    again = KLController(0.1, target=0.5, horizon=100)
    again.load_state_dict(state)
    assert again.value == pytest.approx(0.1 * 1.02 * 0.99)
    with pytest.raises(ValueError):
        KLController(0.1, target=0.5, horizon=0)


def test_finish_advantages_uses_and_adapts_the_kl_coefficient():
    old = torch.full((2, 5), -1.0)
    mb = {"response_mask": MASK, "advantages": torch.tensor([[1.0], [0.0]]), "old_logprobs": old, "ref_logprobs": old - 0.2}
    direct = [dict(mb)]
    reinforce_pp_advantages(direct, beta=0.25, gamma=1.0)
    cfg = AlgoConfig(estimator="reinforce_pp", kl_in_reward=0.5, kl_target=0.1, kl_horizon=4)
    ctrl = KLController(0.25, cfg.kl_target, cfg.kl_horizon)  # e.g. resumed at 0.25, not the config's 0.5
    got = [dict(mb)]
    sums = finish_advantages([got], cfg, kl_ctrl=ctrl)
    torch.testing.assert_close(got[0]["advantages"], direct[0]["advantages"])  # the controller's beta was used
    assert sums["reward_kl"] == pytest.approx((0.2 * 5, 5.0)) and sums["kl_coef_current"] == (0.25, 1.0)
    assert ctrl.value == pytest.approx(0.25 * (1 + 0.2 * 2 / 4))  # KL 0.2 over target 0.1: e = +0.2; 2 samples
    assert finish_advantages([[dict(mb)]], AlgoConfig(estimator="reinforce_pp")) == {}  # no KL term: no metrics


def test_kl_target_config_keys():
    cfg = load_config(RECIPE, ["algo.estimator=reinforce_pp_baseline", "algo.kl_in_reward=0.05", "algo.kl_target=0.02",
                               "algo.kl_horizon=500"])
    assert (cfg.algo.kl_target, cfg.algo.kl_horizon) == (0.02, 500)
    for overrides, message in [
        (["algo.estimator=reinforce_pp", "algo.kl_target=0.02"], "algo.kl_target: adapts the coefficient"),
        (["algo.kl_target=0.02"], "algo.kl_target: read by the reinforce_pp and gae estimators only"),
        (["algo.estimator=reinforce_pp", "algo.kl_horizon=0"], "algo.kl_horizon"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(RECIPE, overrides)
