"""DP balancing: one step's samples re-partitioned across data-parallel ranks by cost.

After rollout every DP rank holds the samples of its own prompts. Response lengths are
long-tailed, so without balancing every logprob and training pass waits for the rank with the
most tokens. For each mini-batch (one optimizer step), the ranks all-gather the (prompt,
response) lengths of its samples (small metadata, never the samples), every rank derives the
same plan with the fused C++ balancer (:func:`yatt.balance.dp_balance`: ranks by Karmarkar-Karp
on ``a*L + b*L**2``, micro-batches under the token budget; with shared-prompt packing
:func:`yatt.balance.dp_balance_groups`, which keeps a group's samples together so its prompt runs
once), and the samples move between ranks as
packed byte buffers in one all-to-all-v (``MPI_Alltoallv`` under an MPI launcher, else
torch.distributed), laid out by :mod:`yatt.controller.wire` from the sample class's fields (a
field added to the sample travels with it). Per-token results computed on the balanced layout go
back to the ranks that own the samples with :meth:`Balanced.to_owners`, in the owners' original
order.

Within a mini-batch, sample ``(d, i)`` (rank ``d``'s ``i``-th sample of the chunk) has the global
index ``sum(n_e for e < d) + i``; that fixed order makes the plan identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from yatt.balance import DpPlan, dp_balance, dp_balance_groups
from yatt.config import BalanceConfig
from yatt.controller import wire
from yatt.controller.batch import Sample, mini_batch_bounds, prompt_runs, skipped_counts
from yatt.dist import mpi_arrive, mpi_comm


@dataclass
class Balanced:
    """This rank's part of a balanced step.

    Attributes:
        samples: the samples this rank trains on, mini-batch by mini-batch, micro-batch by
            micro-batch (packed order).
        splits: per mini-batch, its micro-batches as int64 index arrays into ``samples`` (none on a
            rank that trains nothing of that mini-batch, when samples were left out).
        skipped: per mini-batch, the response tokens and sequences of this rank's own samples that
            ``keep`` left out (:func:`yatt.controller.batch.skipped_counts`; the loss normaliser's share).
        imbalance_before, imbalance_after: ``sum_m max_r C[m, r] / sum_m mean_r C[m, r]`` with
            ``C[m, r]`` rank r's cost in mini-batch m, for the rollout layout and the balanced one
            (1.0 = no rank waits; equals max/mean over ranks with one mini-batch).
    """

    samples: list[Sample]
    splits: list[list[np.ndarray]]
    skipped: list[tuple[float, float]]
    imbalance_before: float
    imbalance_after: float
    _route: _Route

    def to_owners(self, values: list[np.ndarray]) -> list[np.ndarray]:
        """Return per-response-token results to the ranks owning the samples. Collective over the group.

        Args:
            values: one float32-convertible array ``[R_j]`` per sample of :attr:`samples`
                (``R_j`` its response length), e.g. the trainer's response logprobs.
        Returns:
            one float32 array ``[R_i]`` per sample this rank passed to :meth:`DpBalancer.balance`,
            in that original order (None for a sample ``keep`` left out).
        Raises:
            ValueError: wrong number of arrays or an array of the wrong length.
        """
        r = self._route
        if len(values) != len(self.samples):
            raise ValueError(f"{len(values)} result arrays for {len(self.samples)} balanced samples")
        for v, s in zip(values, self.samples):
            if len(v) != len(s.response_ids):
                raise ValueError(f"a result of length {len(v)} for a response of {len(s.response_ids)} tokens")
        send = [_f32_bytes([values[j] for j in pos]) for pos in r.recv_pos]
        recv = r.exchange.alltoallv(send, [4 * int(r.owned_response[idx].sum()) for idx in r.send_idx])
        out: list[np.ndarray | None] = [None] * len(r.owned_response)
        for idx, buf in zip(r.send_idx, recv):
            flat = buf.view(np.float32)
            for i, part in zip(idx, np.split(flat, np.cumsum(r.owned_response[idx])[:-1]) if len(idx) else []):
                out[i] = part
        return out


@dataclass
class _Route:
    exchange: _Exchange
    send_idx: list[np.ndarray]  # per peer: my original samples it receives, in its arrival order
    recv_pos: list[np.ndarray]  # per peer: positions in Balanced.samples of what it sends me
    owned_response: np.ndarray  # response length of each of my original samples


@dataclass
class _Layout:
    splits: list[list[np.ndarray]]  # per mini-batch, micro-batches as positions in the balanced list
    before: list[np.ndarray]  # per mini-batch, cost per rank in the rollout layout
    after: list[np.ndarray]  # ... and in the balanced layout
    send: list  # per peer: my original samples it receives, in its arrival order
    src: np.ndarray  # per balanced position: the rank that owns the sample
    src_local: np.ndarray  # ... and its index there


class DpBalancer:
    """Balances every step over one data-parallel group (create once; collectives over ``group``).

    Args:
        cfg: ``trainer.balance`` (cost model, equal counts).
        token_budget: ``trainer.micro_batch_tokens``, the micro-batch budget in tokens.
        group: the DP process group (None: the default group).
        transport: ``"auto"`` (MPI under an MPI launcher, else torch.distributed) or ``"torch"``.
        sample_type: the sample dataclass (:class:`~yatt.controller.batch.Sample` or a subclass
            with more fields); every rank passes the same.
        shared_prompt: the trainer packs ``trainer.packing: shared_prompt`` micro-batches: cost a
            group's prompt once per rank and micro-batch (:func:`yatt.balance.dp_balance_groups`;
            ``cost_quadratic`` and ``equal_count`` then take :func:`yatt.balance.dp_balance`).
    """

    def __init__(self, cfg: BalanceConfig, token_budget: int, group=None, transport: str = "auto",
                 sample_type: type = Sample, shared_prompt: bool = False):
        self.cfg, self.token_budget, self.sample_type = cfg, token_budget, sample_type
        self.by_group = shared_prompt and not cfg.equal_count and cfg.cost_quadratic == 0
        self.exchange = _Exchange(group, transport)

    def balance(self, samples: list[Sample], mini_batches: int, keep: list[bool] | None = None) -> Balanced:
        """Re-partition each mini-batch across the group and move the samples. Collective.

        Args:
            samples: this rank's samples (mini-batch ``m`` is the ``m``-th contiguous chunk, as in
                :func:`yatt.controller.batch.mini_batch_bounds`).
            mini_batches: optimizer steps per epoch, the same on every rank.
            keep: per sample, whether it is trained (None: all; see
                :func:`yatt.algos.zero_signal.trained_mask`). The chunks are cut over every sample, as
                without skipping; only the kept ones are balanced and moved, so a rank may train
                nothing of a mini-batch (it still takes part in the optimizer step).
        Returns:
            :class:`Balanced`. Every mini-batch holds at least one sample on every rank (before
            ``keep`` leaves any out): when a small step (ranks may even hold no samples, e.g. after
            dynamic sampling) cannot fill ``mini_batches`` chunks with one sample per rank each,
            fewer mini-batches are formed (the same number on every rank), none when the group
            holds fewer samples than ranks.
        """
        ex = self.exchange
        lengths = wire.lengths(samples)
        kept = np.ones(len(samples), dtype=np.int64) if keep is None else np.asarray(keep, dtype=np.int64)
        group = prompt_runs(samples)  # numbered per rank
        meta = ex.allgather(np.column_stack([lengths, kept, group]))  # [n_d, 4] per rank: the only data every rank sees
        every, keeps, groups = [x[:, :2] for x in meta], [x[:, 2].astype(bool) for x in meta], [x[:, 3] for x in meta]
        chunks = _fillable(mini_batches, [len(x) for x in every], ex.size)
        bounds = [mini_batch_bounds(len(x), chunks) if chunks else [0] for x in every]
        lay = self._layout(every, keeps, groups, bounds)
        recv_pos = [np.nonzero(lay.src == p)[0] for p in range(ex.size)]
        recv_lens = [every[p][lay.src_local[pos]] for p, pos in enumerate(recv_pos)]
        cls = self.sample_type
        bufs = ex.alltoallv([wire.pack([samples[i] for i in idx], cls) for idx in lay.send],
                            [wire.packed_bytes(cls, pr) for pr in recv_lens])
        balanced: list[Sample | None] = [None] * len(lay.src)
        for pos, buf, pr in zip(recv_pos, bufs, recv_lens):
            for j, s in zip(pos, wire.unpack(buf, pr, cls)):
                balanced[j] = s
        route = _Route(ex, lay.send, recv_pos, lengths[:, 1].copy())
        skipped = skipped_counts(samples, keep, bounds[ex.rank])
        return Balanced(balanced, lay.splits, skipped, _imbalance(lay.before), _imbalance(lay.after), route)

    def _layout(self, every: list[np.ndarray], keeps: list[np.ndarray], groups: list[np.ndarray],
                bounds: list[list[int]]) -> _Layout:
        """The plan of every mini-batch (rank ``d``'s chunk ``m``: its samples ``bounds[d][m]`` to
        ``bounds[d][m + 1]`` that ``keeps[d]`` marks), seen from this rank (pure: the same inputs on
        every rank)."""
        d_size, me = self.exchange.size, self.exchange.rank
        lay = _Layout([], [], [], [[] for _ in range(d_size)], np.zeros(0, np.int64), np.zeros(0, np.int64))
        src, src_local = [lay.src], [lay.src_local]
        for m in range(len(bounds[0]) - 1):
            chunk = [np.arange(b[m], b[m + 1])[k[b[m]:b[m + 1]]] for b, k in zip(bounds, keeps)]
            owner = np.concatenate([np.full(len(c), d) for d, c in enumerate(chunk)]).astype(np.int64)
            local = np.concatenate(chunk).astype(np.int64)
            lens = np.concatenate([x[c] for x, c in zip(every, chunk)]).reshape(-1, 2)
            labels = np.concatenate([g[c] * d_size + d for d, (g, c) in enumerate(zip(groups, chunk))])
            plan = self._plan(lens, labels)
            lay.before.append(np.bincount(owner, weights=plan.costs, minlength=d_size).astype(np.float64))
            lay.after.append(plan.rank_cost.astype(np.float64))
            for q in range(d_size):  # what each peer receives from me, in its packed order
                g = plan.rank_samples(q)
                lay.send[q].append(local[g[owner[g] == me]])
            mine = plan.rank_samples(me)
            offset = sum(len(x) for x in src)
            cuts = plan.mb_offsets[plan.mb_rank_offsets[me]:plan.mb_rank_offsets[me + 1] + 1] - plan.rank_offsets[me]
            lay.splits.append([np.arange(a, b) + offset for a, b in zip(cuts[:-1], cuts[1:])])
            src.append(owner[mine])
            src_local.append(local[mine])
        lay.src, lay.src_local = np.concatenate(src), np.concatenate(src_local)
        lay.send = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in lay.send]
        return lay

    def _plan(self, lens: np.ndarray, groups: np.ndarray) -> DpPlan:
        """Plan of one mini-batch: ``lens`` ``[n, 2]`` (prompt, response) tokens, ``groups`` ``[n]``
        labels of the samples that share a prompt."""
        if self.by_group:
            return dp_balance_groups(lens[:, 0], lens[:, 1], groups, self.exchange.size, self.token_budget)
        cost = (self.cfg.cost_linear, self.cfg.cost_quadratic)
        lens = lens.sum(axis=1)
        plan = dp_balance(lens, self.exchange.size, self.token_budget, cost=cost, equal_count=self.cfg.equal_count)
        if (np.diff(plan.rank_offsets) == 0).any():  # only zero-cost ties can leave a rank empty
            plan = dp_balance(lens, self.exchange.size, self.token_budget, cost=cost, equal_count=True)
        return plan


def _fillable(mini_batches: int, counts: list[int], ranks: int) -> int:
    """The most chunks (at most ``mini_batches``) whose every chunk, cut per rank as in
    :func:`mini_batch_bounds`, holds at least ``ranks`` samples over the group; 0 if none."""
    for m in range(mini_batches, 0, -1):
        bounds = [mini_batch_bounds(n, m) for n in counts]
        if all(sum(b[i + 1] - b[i] for b in bounds) >= ranks for i in range(m)):
            return m
    return 0


def _imbalance(costs: list[np.ndarray]) -> float:
    worst = sum(float(c.max()) for c in costs)
    mean = sum(float(c.mean()) for c in costs)
    return 1.0 if mean == 0 else worst / mean


# ---- per-token results back to the owners ----------------------------------------------------
def _f32_bytes(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in arrays]).view(np.uint8)


# ---- transport ----------------------------------------------------------------------------------
class _Exchange:
    """Collectives over one process group: MPI (shared memory within a node) when the job was
    started by an MPI launcher, else torch.distributed; a single process needs neither."""

    def __init__(self, group=None, transport: str = "auto"):
        self.group = group
        live = dist.is_initialized()
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if live else [0]
        self.size, self.rank = len(self.ranks), self.ranks.index(dist.get_rank()) if live else 0
        self.comm = mpi_comm(self.ranks) if live and self.size > 1 and transport != "torch" else None

    def allgather(self, obj) -> list:
        if self.size == 1:
            return [obj]
        if self.comm is not None:
            mpi_arrive(self.comm)  # ranks reach a step's exchange at different times: wait asleep
            return self.comm.allgather(obj)
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def alltoallv(self, send: list[np.ndarray], recv_bytes: list[int]) -> list[np.ndarray]:
        """Send ``send[p]`` (uint8) to peer p; returns what each peer sent (``recv_bytes[p]`` bytes)."""
        if self.size == 1:
            return [send[0]]
        sizes = [len(b) for b in send]
        sbuf = np.concatenate(send) if sum(sizes) else np.zeros(1, dtype=np.uint8)
        rbuf = np.empty(max(1, sum(recv_bytes)), dtype=np.uint8)
        if self.comm is not None:
            from mpi4py import MPI

            mpi_arrive(self.comm)
            self.comm.Alltoallv([sbuf, (sizes, _offsets(sizes)), MPI.BYTE],
                                [rbuf, (list(recv_bytes), _offsets(recv_bytes)), MPI.BYTE])
        else:
            dist.all_to_all_single(torch.from_numpy(rbuf[:sum(recv_bytes)]), torch.from_numpy(sbuf[:sum(sizes)]),
                                   list(recv_bytes), sizes, group=self.group)
        return np.split(rbuf[:sum(recv_bytes)], np.cumsum(recv_bytes)[:-1])


def _offsets(sizes) -> list[int]:
    return [0, *np.cumsum(sizes)[:-1].tolist()]
