"""yatt.balance (C++ kernels in csrc/partition.cpp) against pure-Python references."""
from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from yatt import _C
from yatt.balance import dp_balance, dp_balance_groups, imbalance, partition, split_micro_batches


# ---- references ------------------------------------------------------------------------------
def ref_kk_sums(costs: list[int], k: int, equal_size: bool = False) -> list[int]:
    """Dense k-way Karmarkar-Karp on sums only, same tie rules as the C++ kernel.

    A state is its k subset sums sorted descending; pop order is (larger spread, larger top,
    older state). Returns the final k part sums sorted.
    """
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i))
    group = k if equal_size else 1
    heap = []
    for seq, g in enumerate(range(0, len(order), group)):
        sums = sorted([costs[i] for i in order[g:g + group]] + [0] * (k - group), reverse=True)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], seq, sums))
    seq = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        sums = sorted((a[i] + b[k - 1 - i] for i in range(k)), reverse=True)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], seq, sums))
        seq += 1
    return sorted(heap[0][3]) if heap else [0] * k


def ref_greedy(costs: list[int], k: int) -> list[list[int]]:
    """LPT: descending (cost, ascending index), into the part with least (sum, count, id)."""
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        p = min(range(k), key=lambda p: (sums[p], len(parts[p]), p))
        parts[p].append(i)
        sums[p] += costs[i]
    return canonical(parts)


def canonical(parts: list[list[int]]) -> list[list[int]]:
    parts = [sorted(p) for p in parts]
    return sorted((p for p in parts if p), key=lambda p: p[0]) + [p for p in parts if not p]


def part_sums(costs, parts) -> list[int]:
    return sorted(sum(costs[i] for i in p) for p in parts)


def assert_valid(parts, n: int, k: int | None = None) -> None:
    if k is not None:
        assert len(parts) == k
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n)), "every index exactly once"
    assert all(isinstance(i, int) for i in flat)
    assert parts == canonical(parts), "documented order"


def long_tailed(rng: random.Random, n: int) -> list[int]:
    """Response-length-like: mostly short, a few near the cap."""
    return [min(int(rng.paretovariate(1.2) * 64), 16384) for _ in range(n)]


ADVERSARIAL = {
    "empty": [],
    "one": [7],
    "all_equal": [5] * 12,
    "all_zero": [0] * 9,
    "one_giant": [10**12] + [1] * 20,
    "two_giants": [10**9, 10**9] + list(range(30)),
    "n_lt_k": [3, 1, 2],
    "huge_values": [2**60, 2**60, 2**59, 3],
}


# ---- partition ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("equal_size", [False, True])
def test_kk_matches_reference_sums(seed, equal_size):
    rng = random.Random(seed)
    k = rng.randint(1, 12)
    n = k * rng.randint(0, 20) if equal_size else rng.randint(0, 150)
    costs = long_tailed(rng, n) if seed % 2 else [rng.randint(0, 1000) for _ in range(n)]
    parts = partition(costs, k, equal_size=equal_size)
    assert_valid(parts, n, k)
    assert part_sums(costs, parts) == ref_kk_sums(costs, k, equal_size)
    if equal_size:
        assert all(len(p) == n // k for p in parts)


def test_kk_matches_reference_with_many_ties():
    rng = random.Random(7)
    for _ in range(50):
        k = rng.randint(2, 6)
        costs = [rng.choice([0, 1, 2, 4]) for _ in range(rng.randint(0, 40))]
        assert part_sums(costs, partition(costs, k)) == ref_kk_sums(costs, k)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize("k", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("method", ["kk", "greedy"])
def test_valid_on_adversarial_inputs(name, k, method):
    costs = ADVERSARIAL[name]
    parts = partition(costs, k, method=method)
    assert_valid(parts, len(costs), k)
    if len(costs) >= k:
        assert all(parts), "no empty part when n >= k"
    if method == "kk":
        assert part_sums(costs, parts) == ref_kk_sums(costs, k)
    for eq in (False, True):
        parts = partition(costs, k, method=method, equal_size=eq)
        assert_valid(parts, len(costs), k)


def test_edge_cases():
    assert partition([], 3) == [[], [], []]
    assert partition([4, 9], 4) == [[0], [1], [], []]
    assert partition([1, 2, 3], 1) == [[0, 1, 2]]
    parts = partition([5] * 6, 3, equal_size=True)
    assert_valid(parts, 6, 3)
    assert [len(p) for p in parts] == [2, 2, 2]
    giant = partition([100, 1, 1, 1, 1], 2)
    assert giant == [[0], [1, 2, 3, 4]]


def test_deterministic_and_input_types():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    costs = long_tailed(random.Random(3), 500)
    ref = partition(costs, 8)
    assert partition(costs, 8) == ref
    assert partition(tuple(costs), 8) == ref
    assert partition(np.asarray(costs, dtype=np.int64), 8) == ref
    assert partition(torch.tensor(costs), 8) == ref


def test_equal_size_counts():
    rng = random.Random(11)
    for _ in range(30):
        k = rng.randint(1, 9)
        n = rng.randint(0, 100)
        costs = long_tailed(rng, n)
        for method in ("kk", "greedy"):
            parts = partition(costs, k, method=method, equal_size=True)
            assert_valid(parts, n, k)
            assert sorted(len(p) for p in parts) == sorted(
                [n // k + 1] * (n % k) + [n // k] * (k - n % k))


def test_greedy_matches_reference():
    rng = random.Random(5)
    for _ in range(40):
        k = rng.randint(1, 10)
        costs = [rng.randint(0, 50) for _ in range(rng.randint(0, 60))]
        assert partition(costs, k, method="greedy") == ref_greedy(costs, k)


def test_kk_equal_size_falls_back_to_greedy():
    costs = [9, 7, 5, 3, 1, 1, 2]  # n % k != 0 -> KK's equal-size grouping is impossible
    assert partition(costs, 3, equal_size=True) == partition(
        costs, 3, method="greedy", equal_size=True)


def test_kk_beats_greedy_on_long_tails():
    wins = ties = losses = 0
    for seed in range(50):
        rng = random.Random(1000 + seed)
        k = rng.choice([2, 4, 8, 16])
        costs = long_tailed(rng, rng.randint(4 * k, 64 * k))
        kk = imbalance(costs, partition(costs, k))
        gr = imbalance(costs, partition(costs, k, method="greedy"))
        wins += kk < gr
        ties += kk == gr
        losses += kk > gr
    assert wins + ties >= 45, (wins, ties, losses)
    assert wins > 3 * losses, (wins, ties, losses)


def test_large_input_is_fast_enough():
    costs = long_tailed(random.Random(0), 100_000)
    parts = partition(costs, 64)
    assert_valid(parts, len(costs), 64)
    assert imbalance(costs, parts) < 1.01


# ---- split_micro_batches ---------------------------------------------------------------------
def first_fit_decreasing(lengths: list[int], cap: int) -> int:
    bins: list[int] = []
    for x in sorted(lengths, reverse=True):
        i = next((i for i, b in enumerate(bins) if b + x <= cap), len(bins))
        bins[i:i + 1] = [bins[i] + x] if i < len(bins) else [x]
    return len(bins)


def check_split(lengths: list[int], max_tokens: int) -> list[list[int]]:
    batches = split_micro_batches(lengths, max_tokens)
    assert_valid(batches, len(lengths))
    assert all(batches), "no empty micro-batch"
    over = [i for i, x in enumerate(lengths) if x > max_tokens]
    assert sorted(b[0] for b in batches if len(b) == 1 and lengths[b[0]] > max_tokens) == over
    rest = [b for b in batches if not (len(b) == 1 and lengths[b[0]] > max_tokens)]
    assert all(sum(lengths[i] for i in b) <= max_tokens for b in rest), "budget respected"
    # minimal: the lower bound, or KK with one micro-batch fewer breaks the budget
    fit = [x for x in lengths if x <= max_tokens]
    lower = max(-(-sum(fit) // max_tokens), sum(2 * x > max_tokens for x in fit), 1 if fit else 0)
    assert len(rest) >= lower
    if len(rest) > lower:
        fewer = _C.karmarkar_karp(fit, len(rest) - 1, False)
        assert max(sum(fit[i] for i in p) for p in fewer) > max_tokens
    return batches


@pytest.mark.parametrize("seed", range(30))
def test_split_micro_batches_random(seed):
    rng = random.Random(seed)
    lengths = long_tailed(rng, rng.randint(0, 300))
    max_tokens = rng.choice([512, 2048, 4096, 16384])
    batches = check_split(lengths, max_tokens)
    fit = [x for x in lengths if x <= max_tokens]
    m = len(batches) - (len(lengths) - len(fit))
    # balanced parts need a little more room than bin packing: stay near first-fit-decreasing
    assert m <= 1.1 * first_fit_decreasing(fit, max_tokens) + 1


def test_split_micro_batches_edges():
    assert split_micro_batches([], 10) == []
    assert split_micro_batches([0, 0, 0], 1) == [[0, 1, 2]]
    assert split_micro_batches([3, 4, 5], 100) == [[0, 1, 2]]
    assert split_micro_batches([50, 3, 60, 4], 10) == [[0], [1, 3], [2]]
    assert split_micro_batches([10] * 5, 10) == [[0], [1], [2], [3], [4]]
    check_split([6] * 7 + [1] * 3, 10)


def test_split_micro_batches_needs_gallop():
    # 300 items of 40 with budget 100: the sum bound says 120 batches, only pairs fit -> 150.
    batches = check_split([40] * 300, 100)
    assert len(batches) == 150 and all(len(b) == 2 for b in batches)


# ---- imbalance and errors --------------------------------------------------------------------
def test_imbalance():
    assert imbalance([1, 1, 2], [[0, 1], [2]]) == 1.0
    assert imbalance([3, 1], [[0], [1]]) == 1.5
    assert imbalance([1, 2], [[0, 1], []]) == 2.0
    assert imbalance([0, 0], [[0], [1]]) == 1.0
    with pytest.raises(ValueError):
        imbalance([1], [])


@pytest.mark.parametrize("method", ["kk", "greedy"])
def test_bad_arguments(method):
    for k in (0, -3):
        with pytest.raises(ValueError, match="k must be >= 1"):
            partition([1, 2], k, method=method)
    with pytest.raises(ValueError, match="non-negative"):
        partition([1, -2, 3], 2, method=method)
    with pytest.raises(ValueError, match="overflows"):
        partition([2**62, 2**62, 2**62], 2, method=method)
    with pytest.raises(TypeError):
        partition([1.5, 2.0], 2, method=method)
    with pytest.raises(TypeError):
        partition([1, 2], 2.0, method=method)
    with pytest.raises(ValueError, match="method"):
        partition([1, 2], 2, method="lpt")
    with pytest.raises(ValueError, match="max_tokens"):
        split_micro_batches([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        split_micro_batches([1, -1], 10)


# ---------------------------------------------------------------- fused DP balancer
def _check_plan(plan, lengths, ranks, max_tokens):
    """Every sequence exactly once; rank and micro-batch offsets consistent; budget kept."""
    n = len(lengths)
    assert sorted(plan.order.tolist()) == list(range(n))
    assert plan.rank_offsets[0] == 0 and plan.rank_offsets[-1] == n and len(plan.rank_offsets) == ranks + 1
    assert (np.diff(plan.rank_offsets) >= 0).all() and (np.diff(plan.mb_offsets) > 0).all()
    assert plan.mb_offsets[-1] == n and plan.mb_rank_offsets[-1] == len(plan.mb_offsets) - 1
    assert (plan.order[plan.position] == np.arange(n)).all()
    for r in range(ranks):
        samples = plan.rank_samples(r)
        mbs = plan.rank_micro_batches(r)
        assert sorted(np.concatenate(mbs).tolist() if mbs else []) == sorted(samples.tolist())
        for mb in mbs:
            tokens = sum(lengths[i] for i in mb)
            assert tokens <= max_tokens or len(mb) == 1, (r, mb.tolist(), tokens)
        assert plan.rank_cost[r] == sum(lengths[i] for i in samples)  # default cost: tokens
    assert plan.costs.tolist() == [int(x) for x in lengths]


@pytest.mark.parametrize("seed", range(5))
def test_dp_balance_random_long_tailed(seed):
    rng = random.Random(seed)
    lengths = [min(int(rng.lognormvariate(5, 1)) + 1, 4000) for _ in range(rng.randint(1, 400))]
    ranks = rng.choice([1, 2, 3, 4, 8])
    plan = dp_balance(lengths, ranks, 2048)
    _check_plan(plan, lengths, ranks, 2048)
    assert plan.imbalance <= imbalance(lengths, partition(lengths, ranks, method="greedy")) + 1e-12


@pytest.mark.parametrize("name,lengths,ranks", [
    ("all equal", [100] * 64, 8),
    ("one giant", [10] * 50 + [100_000], 4),
    ("empty rank", [7, 9], 4),
    ("no sequences", [], 3),
    ("zeros", [0] * 10, 3),
])
def test_dp_balance_adversarial(name, lengths, ranks):
    plan = dp_balance(lengths, ranks, 256)
    _check_plan(plan, lengths, ranks, 256)
    if name == "all equal":
        assert plan.imbalance == 1.0
    if name == "empty rank":
        assert sorted(len(plan.rank_samples(r)) for r in range(ranks)) == [0, 0, 1, 1]


def test_dp_balance_cost_model_and_equal_count():
    lengths = [1000, 10, 10, 10, 10, 10, 10, 1000]
    quad = dp_balance(lengths, 2, 4096, cost=(1.0, 0.01))  # long: 1000 + 0.01 * 1000^2, short: 11
    assert quad.rank_cost.tolist() == [11033, 11033]
    assert quad.costs.tolist() == [11000, 11, 11, 11, 11, 11, 11, 11000]
    assert dp_balance([3], 1, 64, cost=(1.0, 0.5)).costs.tolist() == [8]  # 7.5 rounds half away from zero
    assert [sorted(lengths[i] for i in quad.rank_samples(r)) for r in range(2)] == [[10, 10, 10, 1000]] * 2
    lengths = [2000, 500, 500, 500, 500]
    assert sorted(len(dp_balance(lengths, 2, 4096).rank_samples(r)) for r in range(2)) == [1, 4]
    equal = dp_balance(lengths, 2, 4096, equal_count=True)
    assert sorted(len(equal.rank_samples(r)) for r in range(2)) == [2, 3]
    with pytest.raises(ValueError, match="cost coefficients"):
        dp_balance(lengths, 2, 4096, cost=(-1.0, 0.0))
    with pytest.raises(ValueError, match="ranks"):
        dp_balance(lengths, 0, 4096)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        dp_balance([3, -1], 2, 4096)


def test_dp_balance_equals_partition_then_split():
    """The fused call (threads over ranks) gives exactly partition() then split_micro_batches()."""
    rng = random.Random(11)
    lengths = long_tailed(rng, 3000)
    plan = dp_balance(lengths, 8, 4096)
    order, mb_offsets = [], [0]
    for part in partition(lengths, 8):
        for mb in split_micro_batches([lengths[i] for i in part], 4096):
            order += [part[j] for j in mb]
            mb_offsets.append(len(order))
    assert plan.order.tolist() == order and plan.mb_offsets.tolist() == mb_offsets


@pytest.mark.parametrize("seed", range(3))
def test_dp_balance_leaves_no_rank_empty_when_every_rank_can_have_a_sequence(seed):
    """The DP rebalancer relies on it: with positive lengths and n >= ranks, KK fills every rank."""
    rng = random.Random(seed)
    for _ in range(300):
        ranks = rng.randint(2, 9)
        n = rng.randint(ranks, 3 * ranks)
        lengths = rng.choice([[rng.randint(1, 3) for _ in range(n)], [10**6] + [1] * (n - 1),
                              [int(rng.paretovariate(1.0) * 10) for _ in range(n)]])
        plan = dp_balance(lengths, ranks, 10**9)
        assert all(len(plan.rank_samples(r)) for r in range(ranks)), (lengths, ranks)


def _groups_case(rng, groups: int, n: int, max_response: int = 48):
    """``groups`` groups of ``n`` samples: (prompt lengths, response lengths, labels)."""
    P, R, G = [], [], []
    for g in range(groups):
        p = rng.randint(20, 60)
        for _ in range(n):
            P.append(p), R.append(rng.randint(1, max_response)), G.append(10 * g + 3)  # labels: any ints
    return P, R, G


def _shared_cost(P, R, G, idx) -> int:
    """Tokens a shared-prompt micro-batch of samples ``idx`` runs: responses, each prompt once."""
    return sum(R[i] for i in idx) + sum(P[i] for i in {G[i]: i for i in idx}.values())


@pytest.mark.parametrize("seed", range(4))
def test_dp_balance_groups_plan_is_valid_and_never_costlier_than_per_sample(seed):
    """Every sample once; rank costs and micro-batch budgets under the shared-prompt cost; the
    costliest rank no costlier than dp_balance's plan on P + R, and on average clearly cheaper."""
    rng, ratios = random.Random(seed), []
    for _ in range(60):
        P, R, G = _groups_case(rng, rng.randint(1, 8), rng.choice([1, 4, 8, 16]))
        ranks, budget = rng.choice([1, 2, 3, 4]), rng.choice([100, 2048])
        plan = dp_balance_groups(P, R, G, ranks, budget)
        n = len(P)
        assert sorted(plan.order.tolist()) == list(range(n)) and (plan.order[plan.position] == np.arange(n)).all()
        assert plan.rank_offsets[-1] == n and plan.mb_offsets[-1] == n and (np.diff(plan.mb_offsets) > 0).all()
        for r in range(ranks):
            assert plan.rank_cost[r] == _shared_cost(P, R, G, plan.rank_samples(r).tolist())
            for mb in plan.rank_micro_batches(r):
                assert _shared_cost(P, R, G, mb.tolist()) <= budget or len(mb) == 1
        if n >= ranks:
            assert all(len(plan.rank_samples(r)) for r in range(ranks))
        per_sample = dp_balance(np.add(P, R), ranks, budget)
        worst = max(_shared_cost(P, R, G, per_sample.rank_samples(r).tolist()) for r in range(ranks))
        assert plan.rank_cost.max() <= worst
        ratios.append(plan.rank_cost.max() / worst)
    assert np.mean(ratios) < 0.95


def test_dp_balance_groups_splits_at_most_ranks_minus_one_group():
    """The demo's shape: 4 groups of 8 on 2 ranks: 5 prompt copies at most (KK on P + R copies
    nearly every prompt onto both ranks), and rank costs within a response and a prompt."""
    rng = random.Random(1)
    P, R, G = _groups_case(rng, 4, 8)
    plan = dp_balance_groups(P, R, G, 2, 2048)
    copies = sum(len({G[i] for i in plan.rank_samples(r)}) for r in range(2))
    per_sample = dp_balance(np.add(P, R), 2, 2048)
    assert copies <= 5 < sum(len({G[i] for i in per_sample.rank_samples(r)}) for r in range(2))
    assert abs(int(plan.rank_cost[0]) - int(plan.rank_cost[1])) <= max(R) + max(P)
    assert plan.costs.sum() == sum(R) + sum(P[G.index(g)] for g in set(G))


def test_dp_balance_groups_exchanges_samples_while_that_lowers_the_costliest_rank(monkeypatch):
    """The local search after the fill (moves and swaps, prompt copies counted) never leaves a
    costlier top rank than the fill alone, and on the demo's shape (4 groups of 8 on 2 ranks, 200
    random draws) it brings the ranks within 1% on average, where the fill alone is 2-3% apart."""
    import yatt.balance as balance

    rng = random.Random(2)
    cases = [_groups_case(rng, 4, 8) for _ in range(200)]
    refined = [dp_balance_groups(P, R, G, 2, 2048) for P, R, G in cases]
    monkeypatch.setattr(balance, "_refine", lambda rank_of, *args: rank_of)
    filled = [dp_balance_groups(P, R, G, 2, 2048) for P, R, G in cases]
    assert all(a.rank_cost.max() <= b.rank_cost.max() for a, b in zip(refined, filled))
    assert np.mean([p.imbalance for p in refined]) < 1.01 < 1.02 < np.mean([p.imbalance for p in filled])


def test_dp_balance_groups_bad_arguments():
    with pytest.raises(ValueError, match="group labels"):
        dp_balance_groups([1, 2], [1, 2], [0], 2, 64)
    with pytest.raises(ValueError, match="different prompt lengths"):
        dp_balance_groups([5, 6], [1, 2], [0, 0], 2, 64)
    with pytest.raises(ValueError, match=">= 0"):
        dp_balance_groups([5, 5], [1, -2], [0, 0], 2, 64)
    with pytest.raises(ValueError, match="ranks >= 1"):
        dp_balance_groups([5], [1], [0], 0, 64)
    empty = dp_balance_groups([], [], [], 3, 64)
    assert len(empty.order) == 0 and empty.rank_cost.tolist() == [0, 0, 0]
