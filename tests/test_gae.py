"""GAE and the critic's value loss (yatt/algos/gae.py, yatt/algos/loss.py): hand-computed
advantages and returns (lambda 1, lambda 0, a discount), a prompt and padding around the
response, a truncated response and pad == EOS, whitening over every micro-batch, the clipped
value loss and its gradient, the GAE stage's metrics, and the config keys of PPO with a critic."""
import pytest
import torch

from yatt.algos.estimators import ESTIMATORS, group_informative
from yatt.algos.gae import clipped_value_loss, gae, gae_advantages
from yatt.algos.loss import ValueLoss
from yatt.algos.policy_loss import LossNorm
from yatt.algos.update import finish_advantages
from yatt.config import AlgoConfig, ConfigError, load_config

RECIPE = "configs/grpo_smollm2.yaml"
PPO = ["algo.estimator=gae", "critic.enabled=true"]
V = torch.tensor([[0.5, 0.6, 0.7]])
R = torch.tensor([[0.0, 0.0, 1.0]])
ONES = torch.ones(1, 3)


def test_gae_hand_computed():
    # lambda = gamma = 1: A_t = (sum of rewards from t) - V_t, the return is 1 everywhere
    adv, ret = gae(R, V, ONES, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, torch.ones(1, 3))
    # gamma 0.9, lambda 0.8: delta = (0.9*0.6 - 0.5, 0.9*0.7 - 0.6, 1 - 0.7) = (0.04, 0.03, 0.3)
    adv, ret = gae(R, V, ONES, gamma=0.9, lam=0.8)
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7]]))
    # lambda 0: one-step TD errors
    adv, _ = gae(R, V, ONES, gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.04, 0.03, 0.3]]))


def test_gae_ignores_the_prompt_and_the_padding_around_a_response():
    # prompt of 2, the same response of 3, then 2 pads whose "values" and rewards are junk
    rewards = torch.tensor([[5.0, 5.0, 0.0, 0.0, 1.0, 7.0, 7.0]])
    values = torch.tensor([[9.0, 9.0, 0.5, 0.6, 0.7, 9.0, 9.0]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = gae(R, V, ONES, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, 2:5], ref_adv)
    torch.testing.assert_close(ret[:, 2:5], ref_ret)
    assert adv[:, [0, 1, 5, 6]].eq(0).all() and ret[:, [0, 1, 5, 6]].eq(0).all()


def test_gae_advantages_whiten_over_every_micro_batch_and_keep_the_returns():
    # row 0: prompt 1, response of 3 ending in EOS, pad == EOS after it; row 1: a response cut at
    # max_tokens (2 tokens, no EOS): both are terminal at their last token
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.0, 0.2, 0.4, 0.6, 0.0], [0.0, 0.0, 0.1, 0.3, 0.0]])
    old = torch.full((2, 5), -1.0)
    mbs = [{"response_mask": mask[i:i + 1], "advantages": torch.tensor([[s]]), "values": values[i:i + 1],
            "old_logprobs": old[i:i + 1], "ref_logprobs": old[i:i + 1] - 0.2} for i, s in enumerate((1.0, 0.0))]
    gae_advantages(mbs, beta=0.5, gamma=1.0, lam=1.0)
    # token rewards -0.1 (KL 0.2 x 0.5) + the score at the end; lambda 1: A = return - V
    returns = torch.tensor([0.7, 0.8, 0.9, -0.2, -0.1])
    raw = returns - torch.tensor([0.2, 0.4, 0.6, 0.1, 0.3])
    torch.testing.assert_close(mbs[0]["returns"][0, 1:4], returns[:3])
    torch.testing.assert_close(mbs[1]["returns"][0, 2:4], returns[3:])
    whitened = (raw - raw.mean()) / raw.std()
    torch.testing.assert_close(mbs[0]["advantages"][0, 1:4], whitened[:3])
    torch.testing.assert_close(mbs[1]["advantages"][0, 2:4], whitened[3:])
    assert mbs[0]["advantages"][0, [0, 4]].eq(0).all() and mbs[1]["advantages"][0, [0, 1, 4]].eq(0).all()


def test_finish_advantages_with_gae_reports_the_critics_fit():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    mb = {"response_mask": mask, "advantages": torch.tensor([[1.0]]), "old_logprobs": torch.zeros(1, 4)}
    exact = dict(mb, values=torch.tensor([[0.0, 1.0, 1.0, 1.0]]))  # values = returns: all explained
    sums = finish_advantages([[exact]], AlgoConfig(estimator="gae", lam=1.0))
    assert exact["advantages"].shape == (1, 4) and exact["returns"].shape == (1, 4)
    assert sums["values_mean"] == pytest.approx((3.0, 3.0)) and sums["returns_mean"] == pytest.approx((3.0, 3.0))
    assert sums["explained_variance"][0] == pytest.approx(1.0)
    zero = dict(mb, values=torch.zeros(1, 4), advantages=torch.tensor([[1.0]]))  # V = 0 explains none of R
    zero["advantages"] = torch.tensor([[1.0]])
    sums = finish_advantages([[zero]], AlgoConfig(estimator="gae", gamma=0.5, lam=1.0))
    assert sums["explained_variance"][0] == pytest.approx(0.0, abs=1e-6)


def test_clipped_value_loss_hand_computed_and_its_gradient():
    values = torch.tensor([[1.0, 0.6, 0.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 0.5, 0.5]]), torch.tensor([[2.0, 2.0, 0.0]])
    terms = clipped_value_loss(values, old, returns, clip=0.2)
    # token 0: unclipped (1 - 2)^2 = 1, clipped (0.7 - 2)^2 = 1.69 (active); token 1: inside the clip
    # range, 1.96 both; token 2: unclipped 0, clipped (0.3 - 0)^2 = 0.09 (active)
    torch.testing.assert_close(terms.loss, torch.tensor([[0.845, 0.98, 0.045]]))
    assert terms.clipped.tolist() == [[True, False, True]]
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = ValueLoss(0.2, LossNorm(tokens=4.0, seqs=1.0, max_tokens=1.0))(values, {
        "response_mask": mask, "values": old, "returns": returns})
    loss.backward()
    # the clipped branch has no gradient in V; the unclipped one 2 * 0.5 * (V - R) / 4 tokens
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, (0.6 - 2.0) / 4, 0.0]]))
    assert stats["value_clip_frac"].item() == 1.0 and stats["tokens"].item() == 2.0
    assert stats["value_loss"].item() == pytest.approx(0.845 + 0.98)
    unclipped = clipped_value_loss(values.detach(), old, returns, clip=None)
    torch.testing.assert_close(unclipped.loss, torch.tensor([[0.5, 0.98, 0.0]]))
    assert ValueLoss(0.0, LossNorm(1.0, 1.0, 1.0)).clip is None  # value_clip 0: unclipped


def test_dynamic_sampling_asks_the_estimator_which_groups_carry_signal():
    tie, split = [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert not group_informative(name, ESTIMATORS[name], tie) and group_informative(name, ESTIMATORS[name], split)
    for name in ("reinforce_pp", "gae"):  # whitening / the critic's baseline: equal scores still train
        assert group_informative(name, ESTIMATORS[name], tie) and group_informative(name, ESTIMATORS[name], [0.0, 0.0])
    assert not group_informative("grpo", ESTIMATORS["grpo"], [])


def test_ppo_config_keys_are_validated_together():
    cfg = load_config(RECIPE, PPO + ["algo.lam=0.9", "algo.kl_in_reward=0.05", "critic.lr=2e-5", "critic.value_clip=0.2",
                                     "critic.freeze_actor_steps=2", "rollout.n=1"])
    assert cfg.critic.enabled and cfg.algo.lam == 0.9 and cfg.critic.freeze_actor_steps == 2
    for overrides, message in [
        (["algo.estimator=gae"], "algo.estimator: gae needs the critic's values; set critic.enabled=true"),
        (["critic.enabled=true"], "critic.enabled: only algo.estimator=gae reads a critic's values, not estimator=grpo"),
        (["algo.estimator=rloo", "critic.enabled=true"], "critic.enabled: only algo.estimator=gae"),
        (["critic.lr=1e-4"], r"critic.lr: the critic is off \(critic.enabled=false\)"),
        (["algo.lam=0.9"], "algo.lam: read by algo.estimator=gae only"),
        (["algo.estimator=reinforce_pp", "algo.lam=0.9"], "algo.lam: read by algo.estimator=gae only"),
        (PPO + ["critic.freeze_actor_steps=20"], "critic.freeze_actor_steps: 20 critic-only steps leave none"),
        (PPO + ["critic.lr=1e-6", "critic.min_lr=1e-5"], "critic.min_lr: must not exceed critic.lr"),
        (PPO + ["critic.valu_clip=0.1"], r"unknown config key 'critic.valu_clip' \(did you mean 'critic.value_clip'\?\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(RECIPE, overrides)


@pytest.mark.slow
def test_every_registered_estimator_gives_the_same_advantages_on_1_and_2_ranks(shared_job):
    """tests/mpi/estimator_contract.py in the shared 2-rank job: shapes, finite, nothing outside
    the response, and one rank without balancing equals two balanced ranks, for every estimator."""
    out = shared_job("ranks_2")
    for name in ESTIMATORS:
        assert out.count(f"] estimator {name} OK: 2 ranks vs 1") == 2, (name, out[-3000:])
    assert out.count("] contract OK") == 2, out[-3000:]
