"""Rollout correction (yatt/algos/rollout_correction.py, algo.rollout_correction): hand-computed
TIS and MIS weights, their effect on the policy loss and its gradient, finite weights for any
input, the step-level stage and its metrics, and the config's checks."""
import math

import pytest
import torch

from yatt.algos.loss import PolicyLoss
from yatt.algos.policy_loss import LossNorm
from yatt.algos.rollout_correction import ROLLOUT_CORRECTIONS, correction_for
from yatt.algos.update import rollout_correction
from yatt.config import AlgoConfig, ConfigError, load_config

# token ratios pi_old / pi_rollout: 3, 1.5, 0.25, 1 (a padded position: anything)
OLD = torch.log(torch.tensor([[3.0, 1.5, 0.25, 7.0]]))
ROLLOUT = torch.zeros(1, 4)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def _weights(name: str, cap: float = 2.0) -> list[float]:
    return correction_for(name)(OLD, ROLLOUT, MASK, cap).weights[0].tolist()


def test_hand_computed_weights():
    assert _weights("none") == pytest.approx([1, 1, 1, 0])
    assert _weights("tis") == pytest.approx([2, 1.5, 0.25, 0])  # min(r, 2)
    assert _weights("mis_token") == pytest.approx([0, 1.5, 0, 0])  # r outside [0.5, 2] dropped
    # the sequence's ratio 3 * 1.5 * 0.25 = 1.125 is inside [0.5, 2]: every token weighs 1.125
    assert _weights("mis_seq") == pytest.approx([1.125, 1.125, 1.125, 0])
    assert _weights("mis_seq", cap=1.1) == pytest.approx([0, 0, 0, 0])  # outside [1/1.1, 1.1]: dropped
    c = correction_for("tis")(OLD, ROLLOUT, MASK, 2.0)
    assert c.corrected[0].tolist() == [True, False, False, False] and c.ratio[0, 3] == 1.0
    assert correction_for("mis_token")(OLD, ROLLOUT, MASK, 2.0).corrected[0].tolist() == [True, False, True, False]


def test_weights_multiply_each_tokens_policy_loss_and_gradient():
    """Advantage 1, ppo_clip with a wide clip range, token_mean: the loss is -sum(w * r_train) / 3
    and its gradient w.r.t. each token's logprob is -w * r_train / 3."""
    cfg = AlgoConfig(rollout_correction="tis", clip_ratio_low=0.99, clip_ratio_high=100.0)
    lp = OLD.clone().requires_grad_(True)  # the current policy = the old one: r_train = 1
    mb = {"response_mask": MASK, "old_logprobs": OLD, "rollout_logprobs": ROLLOUT, "advantages": torch.ones(1, 1),
          "is_weights": correction_for("tis")(OLD, ROLLOUT, MASK, 2.0).weights}
    loss, stats = PolicyLoss(cfg, LossNorm(tokens=3.0, seqs=1.0, max_tokens=4.0))(lp, torch.zeros(1, 4), mb)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(2 + 1.5 + 0.25) / 3)
    assert lp.grad[0].tolist() == pytest.approx([-2 / 3, -0.5, -0.25 / 3, 0.0])
    assert float(stats["pg_loss"]) == pytest.approx(-(2 + 1.5 + 0.25))


@pytest.mark.parametrize("name", sorted(ROLLOUT_CORRECTIONS))
def test_any_input_gives_finite_weights(name):
    old = torch.tensor([[1e4, -1e4, float("nan"), 0.0]])
    rollout = torch.tensor([[-1e4, 1e4, 0.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # NaN and inf at the masked positions
    c = correction_for(name)(old, rollout, mask, 2.0)
    assert torch.isfinite(c.weights).all() and torch.isfinite(c.ratio).all()
    assert (c.weights[0, 2:] == 0).all() and (c.weights <= math.exp(20)).all()


def test_the_step_stage_writes_weights_and_metrics():
    mbs = [[{"response_mask": MASK, "old_logprobs": OLD, "rollout_logprobs": ROLLOUT}],
           [{"response_mask": torch.ones(1, 2), "old_logprobs": torch.zeros(1, 2),
             "rollout_logprobs": torch.zeros(1, 2)}]]
    sums = rollout_correction(mbs, AlgoConfig(rollout_correction="tis"))
    assert sums["is_weight_mean"] == pytest.approx((2 + 1.5 + 0.25 + 2, 5.0))
    assert sums["is_weight_max"] == pytest.approx((2.0, 1.0))  # the ratio 3 truncated at C
    assert sums["is_ratio_max"] == pytest.approx((3.0, 1.0)) and sums["is_corrected_frac"] == (1.0, 5.0)
    k3 = sum(r - 1 - math.log(r) for r in (3.0, 1.5, 0.25))  # KL(rollout || old) from the rollout's samples
    assert sums["rollout_kl"] == pytest.approx((k3, 5.0))
    assert mbs[1][0]["is_weights"].tolist() == [[1.0, 1.0]]  # on-policy: weight 1
    plain = [[{"response_mask": MASK, "old_logprobs": OLD, "rollout_logprobs": ROLLOUT}]]
    assert set(rollout_correction(plain, AlgoConfig())) == {"rollout_kl"} and "is_weights" not in plain[0][0]
    assert rollout_correction(plain, AlgoConfig(recompute_old_logprobs=False)) == {}
    assert rollout_correction([], AlgoConfig(rollout_correction="tis")) == {}  # every group skipped: no 0 metrics


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match="algo.rollout_correction: tis .* set algo.recompute_old_logprobs=true"):
        load_config(None, ["algo.rollout_correction=tis", "algo.recompute_old_logprobs=false"])
    with pytest.raises(ConfigError, match="algo.rollout_correction_cap: read by"):
        load_config(None, ["algo.rollout_correction_cap=3"])
    with pytest.raises(ConfigError, match="rollout_correction_cap"):
        load_config(None, ["algo.rollout_correction=tis", "algo.rollout_correction_cap=1"])
    cfg = load_config(None, ["algo.rollout_correction=mis_seq", "algo.rollout_correction_cap=3"])
    assert cfg.algo.rollout_correction_cap == 3
