"""GRPO math on hand-computed cases."""
import math

import pytest
import torch

from yatt.algos.grpo import clipped_policy_loss, group_advantages, kl_penalty, masked_sum
from yatt.controller.batch import response_mask


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / std)
    assert torch.allclose(group_advantages(torch.tensor([[3.0, 1.0]]), norm_by_std=False), torch.tensor([[1.0, -1.0]]))


@pytest.mark.parametrize("rewards", [[[0.1, 0.1, 0.1]], [[0.0, 0.0]], [[1.0]], [[0.7] * 8]])
def test_all_equal_group_gives_zero_never_nan(rewards):
    adv = group_advantages(torch.tensor(rewards))
    assert torch.equal(adv, torch.zeros_like(adv))


def test_groups_are_independent():
    adv = group_advantages(torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert torch.equal(adv[0], torch.zeros(2)) and adv[1, 0] > 0 > adv[1, 1]


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = ref - lp  # [-0.5, 1.0]
    assert torch.allclose(kl_penalty(lp, ref, "k1"), -d)
    assert torch.allclose(kl_penalty(lp, ref, "k2"), torch.tensor([0.125, 0.5]))
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert torch.equal(kl_penalty(lp, lp, "k3"), torch.zeros(2))
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(lp, ref, "k4")


def test_k3_is_unbiased_estimate_of_true_kl():
    torch.manual_seed(0)
    p, q = torch.softmax(torch.randn(5), 0), torch.softmax(torch.randn(5), 0)
    x = torch.multinomial(p, 200_000, replacement=True)
    est = kl_penalty(p.log()[x], q.log()[x], "k3").mean()
    true = (p * (p / q).log()).sum()
    assert abs(float(est - true)) < 0.02


def test_clipped_loss_on_policy_and_clipping():
    lp = torch.tensor([[-1.0, -1.0]])
    loss, ratio, clipped = clipped_policy_loss(lp, lp, torch.tensor([[2.0]]), 0.2, 0.28)
    assert torch.equal(ratio, torch.ones_like(ratio)) and not clipped.any()
    assert torch.allclose(loss, torch.tensor([[-2.0, -2.0]]))
    old = torch.tensor([[-1.0, -1.0]])
    new = torch.log(torch.tensor([[1.5, 0.5]])) + old  # ratios 1.5 and 0.5
    loss, _, clipped = clipped_policy_loss(new, old, torch.tensor([[1.0]]), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.5]]))  # high clip on ratio 1.5; 0.5 stays (pessimistic)
    assert clipped.tolist() == [[True, False]]
    loss, _, clipped = clipped_policy_loss(new, old, torch.tensor([[-1.0]]), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[1.5, 0.8]]))  # low clip binds for negative advantage
    assert clipped.tolist() == [[False, True]]


def test_response_mask_eos_truncation_and_pad_equal_eos():
    eos = pad = 2
    # row 0: prompt [5, 6], response [7, eos] (stopped), padded with pad == eos
    # row 1: prompt [5], response [8, 9, 10, 11] cut at max_tokens (no eos)
    ids = torch.tensor([[5, 6, 7, eos, pad], [5, 8, 9, 10, 11]])
    mask = response_mask([2, 1], [2, 4], ids.shape[1])
    assert mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert mask[0, 3] == 1 and ids[0, 3] == eos  # the EOS token is trained on
    assert mask[0, 4] == 0 and ids[0, 4] == pad  # padding with the same id is not
    assert float(masked_sum(torch.ones(2, 5), mask)) == 6.0
