"""DpBalancer pieces that need no peers: the packed sample buffers and the one-rank path."""
import numpy as np
import pytest

from yatt.config import BalanceConfig
from yatt.controller.batch import Sample
from yatt.controller.rebalance import DpBalancer, _fillable, _pack, _packed_bytes, _unpack


def _samples():
    return [Sample([5, 6, 7], [8, 9], [-0.5, -0.25], "stop", 1.0, 0.75),
            Sample([1], [49151, 2, 3, 4], [-1.0, -2.0, -3.0, -4.5], "length", 0.0, -1.25),
            Sample([3, 4], [], [], "stop", 0.5, 0.0)]


def test_pack_round_trip_is_exact():
    samples = _samples()
    lens = np.array([[len(s.prompt_ids), len(s.response_ids)] for s in samples])
    buf = _pack(samples)
    assert buf.dtype == np.uint8 and len(buf) == _packed_bytes(lens)
    assert _unpack(buf, lens) == samples
    assert _unpack(_pack([]), lens[:0]) == []


def test_unknown_finish_reason_is_rejected():
    with pytest.raises(ValueError):
        _pack([Sample([1], [2], [-1.0], "abort")])


def test_one_rank_keeps_its_samples_and_splits_by_budget():
    samples = _samples() * 3  # 9 samples, lengths 5, 5, 2 repeated
    bal = DpBalancer(BalanceConfig(), token_budget=6).balance(samples, mini_batches=2)
    assert bal.imbalance_before == bal.imbalance_after == 1.0
    assert sorted((s.prompt_ids, s.response_ids) for s in bal.samples) == sorted((s.prompt_ids, s.response_ids) for s in samples)
    flat = np.concatenate([mb for split in bal.splits for mb in split])
    assert sorted(flat.tolist()) == list(range(len(samples)))
    for split in bal.splits:
        for mb in split:
            assert sum(bal.samples[i].length for i in mb) <= 6 or len(mb) == 1
    back = bal.to_owners([np.array(s.rollout_logprobs, np.float32) for s in bal.samples])
    assert [b.tolist() for b in back] == [s.rollout_logprobs for s in samples]
    with pytest.raises(ValueError, match="result of length"):
        bal.to_owners([np.zeros(1, np.float32) for _ in bal.samples])
    one = DpBalancer(BalanceConfig(), 6).balance(samples[:1], mini_batches=2)
    assert len(one.splits) == 1 and one.samples == samples[:1]
    none = DpBalancer(BalanceConfig(), 6).balance([], mini_batches=2)
    assert none.splits == [] and none.samples == [] and none.to_owners([]) == []


def test_fewer_mini_batches_when_a_small_step_cannot_give_every_rank_a_sample():
    assert _fillable(2, [4, 4, 4], 3) == 2
    assert _fillable(2, [1, 1, 4], 3) == 1  # chunk 0 would hold 0 + 0 + 2 samples for 3 ranks
    assert _fillable(3, [0, 0, 9], 3) == 3  # empty ranks are fine: the plan moves samples to them
    assert _fillable(2, [0, 2, 0], 3) == 0  # fewer samples than ranks: no update this step


@pytest.mark.parametrize("seed", range(4))
def test_layouts_of_all_ranks_agree_on_every_route(seed):
    """The plan seen from each of D simulated ranks: what p sends q is what q expects from p, in
    order; every sample lands on exactly one rank; micro-batches cover the balanced list."""
    from types import SimpleNamespace

    from yatt.controller.rebalance import _fillable

    rng = np.random.default_rng(seed)
    ranks = int(rng.integers(1, 7))
    every = [np.stack([rng.integers(5, 40, n), rng.pareto(1.0, n).astype(np.int64) + 1], axis=1)
             for n in rng.integers(0, 12, ranks)]
    mini = _fillable(2, [len(x) for x in every], ranks)
    layouts = []
    for r in range(ranks):
        balancer = DpBalancer(BalanceConfig(), token_budget=64)
        balancer.exchange = SimpleNamespace(size=ranks, rank=r)
        layouts.append(balancer._layout(every, mini))
    placed = sorted((int(p), int(i)) for lay in layouts for p, i in zip(lay.src, lay.src_local))
    if mini:
        assert placed == sorted((p, i) for p, x in enumerate(every) for i in range(len(x)))
    for p, sender in enumerate(layouts):
        for q, receiver in enumerate(layouts):
            assert sender.send[q].tolist() == receiver.src_local[receiver.src == p].tolist()
    for lay in layouts:
        flat = [int(i) for split in lay.splits for mb in split for i in mb]
        assert flat == list(range(len(lay.src)))
        assert all(len(split) >= 1 for split in lay.splits)  # every rank has work in every mini-batch
