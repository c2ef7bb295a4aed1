"""Token-cost balancing: split sequences into parts (ranks, micro-batches) of near-equal cost.

Kernels are C++ (``csrc/partition.cpp``, module ``yatt._C``); this file only validates and
documents. Costs are integers (token counts, FLOPs): non-negative, int64, sum fits in int64.
Given as a list/tuple of ints or a 1-D integer numpy array / torch tensor.

Algorithms:
- ``"kk"``: Karmarkar-Karp largest differencing method (N. Karmarkar, R. M. Karp, "The
  differencing method of set partitioning", UC Berkeley tech. report, 1982), k-way form as in
  verl's ``seqlen_balancing.karmarkar_karp``: every item starts as a state of k subsets; the two
  states with the largest spread (max - min subset sum) are merged, largest subset of one with
  smallest of the other, until one state is left. Ties: larger spread, then larger top subset,
  then older state (initial states in ascending (cost, index) order). O(n log n + n k log k).
- ``"greedy"``: longest processing time first (Graham 1969): descending cost, each item into the
  currently lightest part (ties: fewer items, then lower part id). O(n log n + n log k).

Every result is deterministic; each index appears exactly once; indices ascend inside a part and
parts are ordered by their smallest index, empty parts last.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

try:
    from yatt import _C
except ImportError as exc:  # no silent Python fallback: the kernels must be built
    raise ImportError(
        "yatt._C (the compiled kernels in csrc/) is not built or does not import. Run the "
        "set-up (`make setup`; docs/getting-started.md), or from the repository root: "
        "`pip install --no-build-isolation -e .`"
    ) from exc

__all__ = ["METHODS", "DpPlan", "dp_balance", "dp_balance_groups", "partition", "split_micro_batches", "imbalance"]

METHODS = ("kk", "greedy")


def _as_ints(xs: Sequence[int]) -> list[int]:
    tolist = getattr(xs, "tolist", None)  # numpy arrays, torch tensors
    return tolist() if callable(tolist) else list(xs)


def _call(fn, *args):
    try:
        return fn(*args)
    except TypeError as exc:
        raise TypeError(
            f"{fn.__name__}: costs must be a 1-D sequence of ints in int64 range and k / "
            f"max_tokens an int ({exc})"
        ) from None


def partition(
    costs: Sequence[int], k: int, *, method: str = "kk", equal_size: bool = False
) -> list[list[int]]:
    """Split items 0..n-1 into ``k`` parts whose cost sums are as equal as the method manages.

    Args:
        costs: ``n`` non-negative int costs (shape ``(n,)``, int64 range, sum fits in int64).
        k: number of parts, ``>= 1``.
        method: ``"kk"`` (Karmarkar-Karp, default) or ``"greedy"`` (LPT).
        equal_size: every part gets exactly ``n // k`` items when ``n % k == 0`` (as verl's
            ``get_seqlen_balanced_partitions``). When ``n % k != 0`` part sizes differ by at most
            one and ``"kk"`` falls back to size-capped greedy (KK's equal-size grouping needs
            ``n % k == 0``).

    Returns:
        ``k`` lists of original indices (ints); every index in ``range(n)`` exactly once, ascending
        within a part; parts ordered by smallest index, empty parts (only when ``n < k``) last.

    Raises:
        ValueError: ``k < 1``, a negative cost, a cost sum overflowing int64, unknown ``method``.
        TypeError: costs that are not ints (floats, nested sequences) or ``k`` not an int.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    fn = _C.karmarkar_karp if method == "kk" else _C.greedy_partition
    return _call(fn, _as_ints(costs), k, bool(equal_size))


def split_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split one rank's sequences into the fewest token-balanced micro-batches within a budget.

    A sequence longer than ``max_tokens`` gets a micro-batch of its own. The others are split by
    Karmarkar-Karp into ``m`` parts, ``m`` the smallest count (from the lower bound
    ``max(ceil(sum / max_tokens), #lengths > max_tokens / 2)`` upward) for which every part holds
    at most ``max_tokens`` tokens; after a few linear steps the search doubles and bisects, which
    is exact when feasibility is monotone in ``m`` (as it is in practice).

    Args:
        lengths: ``n`` non-negative int token counts (shape ``(n,)``, int64 range).
        max_tokens: token budget per micro-batch, ``>= 1``.

    Returns:
        Micro-batches as lists of original indices (every index in ``range(n)`` exactly once,
        ascending within a batch), ordered by smallest index; ``[]`` when ``n == 0``. No batch is
        empty.

    Raises:
        ValueError: ``max_tokens < 1``, a negative length, a length sum overflowing int64.
        TypeError: non-int lengths or ``max_tokens``.
    """
    return _call(_C.split_micro_batches, _as_ints(lengths), max_tokens)


def imbalance(costs: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """Max part cost / mean part cost (1.0 = perfect; empty parts count in the mean).

    Args:
        costs: per-item costs (shape ``(n,)``), indexed by the entries of ``parts``.
        parts: index lists, as returned by :func:`partition`.

    Returns:
        ``max(sum(costs[i] for i in p) for p in parts) / mean(...)``; 1.0 when all costs are zero.

    Raises:
        ValueError: ``parts`` is empty.
    """
    if len(parts) == 0:
        raise ValueError("imbalance of zero parts is undefined")
    costs = _as_ints(costs)
    sums = [sum(costs[i] for i in p) for p in parts]
    total = sum(sums)
    return 1.0 if total == 0 else max(sums) * len(sums) / total


@dataclass(frozen=True)
class DpPlan:
    """A step's layout across DP ranks and micro-batches (from :func:`dp_balance`), int64 arrays.

    Attributes:
        order: [n] sample indices in packed order: by rank, then micro-batch, ascending inside.
        rank_offsets: [ranks + 1]; rank ``r`` holds ``order[rank_offsets[r]:rank_offsets[r + 1]]``.
        mb_offsets: [M + 1] over all M micro-batches; micro-batch ``b`` is
            ``order[mb_offsets[b]:mb_offsets[b + 1]]`` (never empty).
        mb_rank_offsets: [ranks + 1]; rank ``r``'s micro-batches are
            ``b in range(mb_rank_offsets[r], mb_rank_offsets[r + 1])``.
        rank_cost: [ranks] cost sum per rank under the cost model.
        costs: [n] cost of each sequence under the cost model.
        position: [n] inverse of ``order``: sample ``i`` sits at ``order[position[i]]`` (unpack
            results computed in packed order with ``packed[position]``).
    """

    order: np.ndarray
    rank_offsets: np.ndarray
    mb_offsets: np.ndarray
    mb_rank_offsets: np.ndarray
    rank_cost: np.ndarray
    costs: np.ndarray
    position: np.ndarray

    def rank_samples(self, r: int) -> np.ndarray:
        """Sample indices on rank ``r``, in packed order."""
        return self.order[self.rank_offsets[r]:self.rank_offsets[r + 1]]

    def rank_micro_batches(self, r: int) -> list[np.ndarray]:
        """Rank ``r``'s micro-batches as arrays of sample indices."""
        bounds = self.mb_offsets[self.mb_rank_offsets[r]:self.mb_rank_offsets[r + 1] + 1]
        return [self.order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    @property
    def imbalance(self) -> float:
        """Max rank cost / mean rank cost (1.0 when every cost is zero)."""
        total = int(self.rank_cost.sum())
        return 1.0 if total == 0 else float(self.rank_cost.max()) * len(self.rank_cost) / total


def dp_balance(lengths: Sequence[int], ranks: int, max_tokens: int, *, cost: tuple[float, float] = (1.0, 0.0),
               equal_count: bool = False) -> DpPlan:
    """Fused balancer (``csrc/dp_balance.cpp``): one call from all sequence lengths of a step to the
    partition across DP ranks, the micro-batches inside each rank and the pack/unpack arrays.

    Ranks: Karmarkar-Karp (see :func:`partition`) on per-sequence costs
    ``round(a * L + b * L**2)`` with ``cost = (a, b)`` (tokens by default; ``b > 0`` models the
    attention term of the FLOPs). Micro-batches: :func:`split_micro_batches` of each rank's
    sequences under ``max_tokens``. Deterministic, so every rank derives the same plan from the
    same lengths.

    Args:
        lengths: ``n`` non-negative token counts (shape ``(n,)``, int64 range): every DP rank's
            sequences, concatenated in a fixed order.
        ranks: DP size, ``>= 1``.
        max_tokens: token budget per micro-batch, ``>= 1``.
        cost: ``(a, b)``, both finite and ``>= 0``.
        equal_count: every rank gets ``n // ranks`` sequences when ``ranks`` divides ``n`` (fixed
            micro-batch shapes), else counts differ by at most one.
    Returns:
        :class:`DpPlan`.
    Raises:
        ValueError: a negative length or coefficient, ``ranks < 1``, ``max_tokens < 1``, a cost
            overflowing int64, or ``lengths`` not 1-D.
    """
    plan = _C.dp_balance(np.asarray(lengths, dtype=np.int64), int(ranks), int(max_tokens),
                         float(cost[0]), float(cost[1]), bool(equal_count))
    position = np.empty_like(plan["order"])
    position[plan["order"]] = np.arange(len(plan["order"]))
    return DpPlan(**plan, position=position)


def dp_balance_groups(prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[int],
                      ranks: int, max_tokens: int) -> DpPlan:
    """Balancer for shared-prompt packing: each group's prompt runs once per rank and micro-batch
    that holds some of its responses, so groups stay whole where balance allows.

    Cost of a set of samples: their response tokens plus each group's prompt tokens once
    (:mod:`yatt.trainer.packing`, ``shared_prompt``). Ranks are filled in turn, groups largest
    first and each group's samples in index order, up to an equal share of the remaining cost
    and of the prompt copies later cuts are expected to add (the sample that crosses that line
    joins the rank if that leaves it closer); the group being filled when a rank closes continues
    on the next rank with another copy of its prompt. Then the costliest rank gives a sample to,
    or swaps one with, another rank while that lowers the higher of the two costs (prompt copies
    counted), as long as one such exchange exists (:func:`_refine`).
    The plan of :func:`dp_balance` on ``P + R`` (samples one by one, most prompts copied onto
    every rank) is costed the same way and kept instead when its costliest rank is cheaper (a
    single group over many ranks). Micro-batches: each rank's samples in fill order, cut before a
    sample that would take the micro-batch over ``max_tokens`` (same cost).

    Args:
        prompt_lens, response_lens: ``n`` non-negative token counts each (shape ``(n,)``).
        groups: ``n`` group labels (any ints); a group's samples share one prompt (same length).
        ranks: DP size, ``>= 1``.
        max_tokens: token budget per micro-batch, ``>= 1``.
    Returns:
        :class:`DpPlan` whose ``rank_cost`` is each rank's cost as above and ``costs`` each
        sample's share in the input layout (its response tokens, plus its prompt's for the first
        sample of each group), so summing ``costs`` over whole groups gives their cost. Samples
        keep index order inside a micro-batch. Every rank gets a sample while ``n >= ranks``.
    Raises:
        ValueError: arrays of different lengths, a negative length, ``ranks < 1``, ``max_tokens < 1``,
            or samples of one group with different prompt lengths.
    """
    P, R, G = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (prompt_lens, response_lens, groups))
    n = len(P)
    if len(R) != n or len(G) != n:
        raise ValueError(f"{n} prompt lengths, {len(R)} response lengths and {len(G)} group labels")
    if ranks < 1 or max_tokens < 1:
        raise ValueError(f"need ranks >= 1 and max_tokens >= 1, got {ranks}, {max_tokens}")
    if n and (P.min() < 0 or R.min() < 0):
        raise ValueError("lengths must be >= 0")
    _, first, group = np.unique(G, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    if (P != P[first][group]).any():
        raise ValueError("samples of one group have different prompt lengths")
    costs = R.copy()
    costs[first] += P[first]

    def rank_costs(rank_of: np.ndarray) -> np.ndarray:
        pieces = np.unique(rank_of * len(first) + group)  # (rank, group) pairs: one prompt copy each
        return (np.bincount(rank_of, weights=R, minlength=ranks)
                + np.bincount(pieces // len(first), weights=P[first][pieces % len(first)], minlength=ranks)).astype(np.int64)

    group_cost = np.bincount(group, weights=costs, minlength=len(first))
    queue = np.concatenate([np.nonzero(group == g)[0] for g in sorted(range(len(first)), key=lambda g: (-group_cost[g], first[g]))]
                           or [np.zeros(0, np.int64)])  # groups largest first, samples in index order
    rank_of = _refine(_fill_ranks(queue, P, R, group, ranks, float(group_cost.sum())), P[first], R, group, ranks,
                      rank_costs)
    kk = dp_balance(P + R, ranks, max_tokens)
    kk_rank = np.empty(n, np.int64)
    kk_rank[kk.order] = np.repeat(np.arange(ranks), np.diff(kk.rank_offsets))
    if n and rank_costs(kk_rank).max() < rank_costs(rank_of).max():
        return dataclasses.replace(kk, rank_cost=rank_costs(kk_rank), costs=costs)

    order, rank_offsets, mb_offsets, mb_rank_offsets = [], [0], [0], [0]
    for r in range(ranks):
        mb, load, seen = [], 0, set()
        for i in queue[rank_of[queue] == r]:
            if mb and load + R[i] + (P[i] if group[i] not in seen else 0) > max_tokens:
                order += sorted(mb)
                mb_offsets.append(len(order))
                mb, load, seen = [], 0, set()
            load += R[i] + (P[i] if group[i] not in seen else 0)
            mb.append(i)
            seen.add(group[i])
        if mb:
            order += sorted(mb)
            mb_offsets.append(len(order))
        rank_offsets.append(len(order))
        mb_rank_offsets.append(len(mb_offsets) - 1)
    order = np.asarray(order, dtype=np.int64)
    position = np.empty_like(order)
    position[order] = np.arange(n)
    return DpPlan(order, np.asarray(rank_offsets, np.int64), np.asarray(mb_offsets, np.int64),
                  np.asarray(mb_rank_offsets, np.int64), rank_costs(rank_of), costs, position)


_SWAP_PAIRS = 1 << 20  # candidate swaps per exchange, above which only moves are tried


def _refine(rank_of: np.ndarray, prompt: np.ndarray, R: np.ndarray, group: np.ndarray, ranks: int,
            rank_costs: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Local search on a shared-prompt plan: ``rank_of`` improved in place and returned.

    A rank's cost (``rank_costs(rank_of)``) is its response tokens plus one prompt copy
    (``prompt[g]`` tokens) per group it holds. Each round, the costliest rank ``a`` tries the
    other ranks ``b`` from the cheapest up; with the first ``b`` where some exchange lowers
    ``max(cost_a, cost_b)`` it applies the best one: moving one of ``a``'s samples to ``b``, or
    swapping one of ``a``'s with one of ``b``'s (all pairs at once, ``O(n_a * n_b)``; moves only
    above :data:`_SWAP_PAIRS` pairs). Stops when no exchange helps or after ``8 * ranks`` rounds.
    Integer costs, so every rank derives the same plan.
    """
    held = np.zeros((ranks, len(prompt)), np.int64)  # samples of group g on rank r
    np.add.at(held, (rank_of, group), 1)
    for _ in range(8 * ranks):
        c = rank_costs(rank_of)
        a = int(np.argmax(c))
        for b in sorted((r for r in range(ranks) if r != a), key=lambda r: (c[r], r)):
            if c[b] >= c[a]:
                break
            best = _best_exchange(a, b, c, rank_of, prompt, R, group, held)
            if best is not None:
                for i, dst in best:
                    held[rank_of[i], group[i]] -= 1
                    held[dst, group[i]] += 1
                    rank_of[i] = dst
                break
        else:
            break
    return rank_of


def _best_exchange(a: int, b: int, c: np.ndarray, rank_of: np.ndarray, prompt: np.ndarray, R: np.ndarray,
                   group: np.ndarray, held: np.ndarray) -> list[tuple[int, int]] | None:
    """The move or swap between ranks ``a`` (costlier) and ``b`` that lowers ``max(c[a], c[b])``
    most, as ``[(sample, new rank), ...]``, or None (see :func:`_refine`)."""
    ia, ib = np.nonzero(rank_of == a)[0], np.nonzero(rank_of == b)[0]
    ga, gb = group[ia], group[ib]
    # leaving a (b) takes the sample's tokens, and its prompt copy if it is its group's last there;
    # joining a (b) adds them, and a prompt copy if its group is not there yet
    leave_a = R[ia] + prompt[ga] * (held[a, ga] == 1)
    join_b = R[ia] + prompt[ga] * (held[b, ga] == 0)
    leave_b = R[ib] + prompt[gb] * (held[b, gb] == 1)
    join_a = R[ib] + prompt[gb] * (held[a, gb] == 0)
    options = []
    if len(ia) > 1:  # a keeps a sample
        move = np.maximum(c[a] - leave_a, c[b] + join_b)  # a's sample i goes to b
        i = int(np.argmin(move))
        options.append((int(move[i]), 0, [(int(ia[i]), b)]))
    if 0 < len(ia) * len(ib) <= _SWAP_PAIRS:  # a's sample i and b's sample j change places
        swap = np.maximum(c[a] - leave_a[:, None] + join_a[None, :], c[b] + join_b[:, None] - leave_b[None, :])
        diff = R[ib][None, :] - R[ia][:, None]  # inside one group no prompt copy moves
        swap = np.where(ga[:, None] == gb[None, :], np.maximum(c[a] + diff, c[b] - diff), swap)
        i, j = divmod(int(np.argmin(swap)), len(ib))
        options.append((int(swap[i, j]), 1, [(int(ia[i]), b), (int(ib[j]), a)]))
    options = [o for o in options if o[0] < max(c[a], c[b])]
    return min(options)[2] if options else None


def _fill_ranks(queue: np.ndarray, P: np.ndarray, R: np.ndarray, group: np.ndarray, ranks: int,
                total: float) -> np.ndarray:
    """Rank of each sample: ranks filled in turn with ``queue``'s samples (see
    :func:`dp_balance_groups`); ``total`` is the cost with every group whole."""
    n = len(queue)
    rank_of = np.zeros(len(P), np.int64)
    copy = float(P[queue].mean()) if n else 0.0  # a split group's next prompt copy, expected
    remaining, k = total, 0
    for r in range(ranks):
        target, last, load, open_group = (remaining + copy * (ranks - r - 1)) / (ranks - r), r == ranks - 1, 0, -1
        while k < n:
            i = queue[k]
            c = R[i] + (P[i] if group[i] != open_group else 0)
            starve = not last and n - k <= ranks - r - 1  # leave a sample for each later rank
            fits = last or load == 0 or load + c <= target or abs(load + c - target) < abs(load - target)
            if starve or not fits:
                if group[i] == open_group:
                    remaining += P[i]  # the group goes on on the next rank: another prompt copy
                break
            rank_of[i], load, open_group, k = r, load + c, group[i], k + 1
        remaining -= load
    return rank_of
