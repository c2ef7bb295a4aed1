"""DpBalancer pieces that need no peers: the packed sample buffers (yatt.controller.wire) and the
one-rank path."""
from dataclasses import dataclass, field

import numpy as np
import pytest

from yatt.config import BalanceConfig
from yatt.controller import wire
from yatt.controller.batch import Sample
from yatt.controller.rebalance import DpBalancer, _fillable


@dataclass
class ValuedSample(Sample):
    """A sample with fields an algorithm might add (a critic's values, a group id): declared here
    only, with no change to the wire format's or the balancer's code."""

    values: list[float] = field(default_factory=list, metadata=wire.PER_TOKEN)
    group: float = field(default=-1.0, metadata=wire.SCALAR)


def _samples():
    return [Sample([5, 6, 7], [8, 9], [-0.5, -0.25], "stop", 1.0, 0.75),
            Sample([1], [49151, 2, 3, 4], [-1.0, -2.0, -3.0, -4.5], "length", 0.0, -1.25),
            Sample([3, 4], [], [], "stop", 0.5, 0.0)]


def test_pack_round_trip_is_exact():
    samples = _samples()
    lens = wire.lengths(samples)
    buf = wire.pack(samples, Sample)
    assert buf.dtype == np.uint8 and len(buf) == wire.packed_bytes(Sample, lens)
    assert wire.unpack(buf, lens, Sample) == samples
    assert wire.unpack(wire.pack([], Sample), lens[:0], Sample) == []
    with pytest.raises(ValueError, match="bytes for samples that need"):
        wire.unpack(buf[:-4], lens, Sample)


def test_bad_field_values_are_rejected_naming_the_field():
    with pytest.raises(ValueError, match="Sample.finish_reason is 'abort'"):
        wire.pack([Sample([1], [2], [-1.0], "abort")], Sample)
    with pytest.raises(ValueError, match="Sample.rollout_logprobs has 1 values for a response of 2 tokens"):
        wire.pack([Sample([1], [2, 3], [-1.0], "stop")], Sample)


def test_a_new_field_travels_through_the_balancer_unchanged():
    """The wire format comes from the fields: a subclass's per-token and scalar fields round-trip
    through pack/unpack and through DpBalancer.balance (the one-rank path packs and unpacks too)."""
    samples = [ValuedSample(s.prompt_ids, s.response_ids, s.rollout_logprobs, s.finish_reason, s.reward, s.advantage,
                            values=[0.5 * i - 1.0 for i in range(len(s.response_ids))], group=float(g))
               for g, s in enumerate(_samples())]
    lens = wire.lengths(samples)
    buf = wire.pack(samples, ValuedSample)
    assert len(buf) == wire.packed_bytes(ValuedSample, lens) == wire.packed_bytes(Sample, lens) + 8 * 3 + 4 * 6
    assert wire.unpack(buf, lens, ValuedSample) == samples
    bal = DpBalancer(BalanceConfig(), 64, sample_type=ValuedSample).balance(samples, 1)
    assert sorted(bal.samples, key=lambda s: s.group) == samples


def test_a_field_without_a_wire_kind_is_a_type_error():
    @dataclass
    class Undeclared(Sample):
        note: str = ""

    with pytest.raises(TypeError, match="Undeclared.note declares no wire kind"):
        wire.pack([], Undeclared)


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
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_layouts_of_all_ranks_agree_on_every_route(seed, skip, shared):
    """The plan seen from each of D simulated ranks: what p sends q is what q expects from p, in
    order; every kept sample lands on exactly one rank, in the mini-batch of its own chunk; micro-batches
    cover the balanced list. ``skip``: a random part of the samples is left out (zero signal);
    ``shared``: the by-group plan of shared-prompt packing (groups of 1-3 samples)."""
    from types import SimpleNamespace

    from yatt.controller.batch import mini_batch_bounds
    from yatt.controller.rebalance import _fillable

    rng = np.random.default_rng(seed)
    ranks = int(rng.integers(1, 7))
    every = [np.stack([rng.integers(5, 40, n), rng.pareto(1.0, n).astype(np.int64) + 1], axis=1)
             for n in rng.integers(0, 12, ranks)]
    keeps = [rng.random(len(x)) < (0.5 if skip else 2.0) for x in every]
    groups = [np.cumsum(rng.random(len(x)) < 0.5) for x in every]
    for x, g in zip(every, groups):  # a group's samples share the prompt length of its first
        x[:, 0] = x[np.searchsorted(g, g), 0]
    mini = _fillable(2, [len(x) for x in every], ranks)
    bounds = [mini_batch_bounds(len(x), mini) if mini else [0] for x in every]
    layouts = []
    for r in range(ranks):
        balancer = DpBalancer(BalanceConfig(), token_budget=64, shared_prompt=shared)
        balancer.exchange = SimpleNamespace(size=ranks, rank=r)
        layouts.append(balancer._layout(every, keeps, groups, bounds))
    placed = sorted((int(p), int(i)) for lay in layouts for p, i in zip(lay.src, lay.src_local))
    if mini:
        assert placed == sorted((p, i) for p, k in enumerate(keeps) for i in np.nonzero(k)[0])
    for p, sender in enumerate(layouts):
        for q, receiver in enumerate(layouts):
            assert sender.send[q].tolist() == receiver.src_local[receiver.src == p].tolist()
    for lay in layouts:
        flat = [int(i) for split in lay.splits for mb in split for i in mb]
        assert flat == list(range(len(lay.src)))
        assert len(lay.splits) == mini
        for m, split in enumerate(lay.splits):  # each sample trains in the mini-batch of its own chunk
            for i in (int(i) for mb in split for i in mb):
                assert bounds[lay.src[i]][m] <= lay.src_local[i] < bounds[lay.src[i]][m + 1]
        if not skip:
            assert all(len(split) >= 1 for split in lay.splits)  # every rank has work in every mini-batch
