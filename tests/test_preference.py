"""The RLHF stages' objectives (yatt/algos/preference.py) on hand-computed cases."""
import math

import pytest
import torch

from yatt.algos.preference import (PREFERENCE_LOSSES, bradley_terry_loss, register_preference_loss, sequence_logprobs,
                                   sft_loss)
from yatt.controller.batch import response_mask


def _ls(x: float) -> float:  # -log sigmoid(x)
    return math.log1p(math.exp(-x))


def test_sft_loss_trains_the_eos_and_not_the_padding_when_they_share_an_id():
    eos = 2
    ids = torch.tensor([[5, 6, 7, eos, eos, eos]])  # prompt 5 6 | response 7 EOS | padding (pad id = EOS id)
    mask = response_mask([2], [2], ids.shape[1])
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0]]  # the response's EOS is in, the padding EOS is out
    logprobs = torch.tensor([[0.0, -9.0, -1.0, -2.0, -50.0, -50.0]], requires_grad=True)
    loss = sft_loss(logprobs, mask, tokens=4.0)  # a mini-batch of 4 response tokens, 2 of them here
    assert loss.item() == pytest.approx(0.75)
    loss.backward()
    assert logprobs.grad.tolist() == [[0, 0, -0.25, -0.25, 0, 0]]
    assert sequence_logprobs(logprobs.detach(), mask).tolist() == [-3.0]
    with pytest.raises(ValueError, match="tokens must be > 0"):
        sft_loss(logprobs, mask, tokens=0)


def test_bradley_terry_loss():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0], requires_grad=True), torch.tensor([1.0, 0.0, 1.0])
    terms = bradley_terry_loss(chosen, rejected)
    assert terms.loss.tolist() == pytest.approx([_ls(1.0), math.log(2), _ls(-2.0)])
    stats = terms.stats()
    assert stats["pair_accuracy"].item() == 1.5 and stats["reward_margin"].item() == pytest.approx(-1.0)
    terms.loss.sum().backward()  # d/dc -log sigmoid(c - r) = -sigmoid(r - c)
    assert chosen.grad.tolist() == pytest.approx([-1 / (1 + math.e), -0.5, -1 / (1 + math.exp(-2))])
    assert bradley_terry_loss(chosen, rejected, margin=1.0).loss[0].item() == pytest.approx(math.log(2))


def test_dpo_and_ipo():
    logp_c, logp_r = torch.tensor([-1.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-2.0]), torch.tensor([-2.0])  # h = (1) - (-1) = 2
    dpo = PREFERENCE_LOSSES["sigmoid"](logp_c, logp_r, ref_c, ref_r, beta=0.5)
    assert dpo.loss.item() == pytest.approx(_ls(1.0))
    assert (dpo.chosen.item(), dpo.rejected.item()) == (0.5, -0.5)  # implicit rewards beta (logp - ref)
    dpo.loss.sum().backward()  # d/dlogp_c = -beta sigmoid(-beta h)
    assert logp_c.grad.item() == pytest.approx(-0.5 / (1 + math.e)) and logp_r.grad.item() == pytest.approx(0.5 / (1 + math.e))
    smoothed = PREFERENCE_LOSSES["sigmoid"](logp_c, logp_r, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
    assert smoothed.loss.item() == pytest.approx(0.9 * _ls(1.0) + 0.1 * _ls(-1.0))
    ipo = PREFERENCE_LOSSES["ipo"](logp_c, logp_r, ref_c, ref_r, beta=0.5)  # (h - 1/(2 beta))^2 = (2 - 1)^2
    assert ipo.loss.item() == pytest.approx(1.0)
    assert PREFERENCE_LOSSES["ipo"](logp_c, logp_r, ref_c, ref_r, beta=0.25).loss.item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no label smoothing"):
        PREFERENCE_LOSSES["ipo"](logp_c, logp_r, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
    with pytest.raises(ValueError, match="already registered"):
        register_preference_loss("ipo")(lambda *a: None)
