"""Padding-free micro-batches: all of a micro-batch's tokens in one row, attention kept inside each document.

A micro-batch reaches the trainer as right-padded ``[B, T]`` rows (what the losses read). With
packing, the model body instead runs one packed row ``[1, S]`` holding exactly the micro-batch's
distinct tokens (no padding): several *documents* back to back, each with its own position ids
(restarting at 0). Two layouts (``trainer.packing``):

- ``packed``: a document is one sample (prompt + response).
- ``shared_prompt``: a document is one prompt followed by the responses of the samples in the
  micro-batch that share it: each response token attends to the prompt and to its own response
  only, its position ids continue from the prompt. The prompt runs once instead of once per sample.

The linear layers run on the ``S`` real tokens. The attention does not run on the whole row: the
core attention (:class:`yatt.trainer.attention.SdpaAttention`, given a
:class:`~yatt.trainer.attention.DocumentAttention`) gathers each document's *trunk* (the sample
in ``packed``, the prompt in ``shared_prompt``) into a batch of causal rows, and each response (a
*branch*) with its prompt's keys into a second batch, so a response's attention costs
``n * (p + n)`` scores as in its own padded row, and a group's prompt ``p * p`` once. The price
is memory: each response's batch row holds its own copy of its prompt's keys and values
(``N * (p + n)`` positions of the key/value width per layer, saved for the backward pass, against
``p + sum(n)`` for the group in one row). Every logprob equals the padded one (to fp32
rounding). This is what the THD layout of Transformer Engine's attention does on GPU
(variable-length documents in one row, ``cu_seqlens``), with a shared prompt as one more case.

Source of the idea: padding-free / packed sequences as verl (``use_remove_padding``), OpenRLHF
(``packing_samples``) and NeMo-RL (sequence packing) run them; shared-prompt attention as in
"prefix sharing" for GRPO groups (e.g. Prefix Grouper, Liu et al. 2025).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MODES = ("padded", "packed", "shared_prompt")


def pack_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], width: int,
              mode: str = "packed") -> dict[str, torch.Tensor]:
    """Lay out a micro-batch's samples as one packed row and its documents' attention.

    Args:
        prompts, responses: ``B`` token id lists each; sample ``b`` is ``prompts[b] + responses[b]``
            (its padded row, :func:`yatt.controller.batch.pack_micro_batches`, has it at 0..L_b-1).
        width: ``T``, the padded rows' width (``>= max L_b``).
        mode: ``"packed"`` or ``"shared_prompt"`` (samples with equal prompt ids share one copy
            of it); documents in order of their first sample, a document's responses in sample order.
    Returns:
        ``packed_ids`` long ``[1, S]`` (``S`` the distinct tokens), ``packed_positions`` long
        ``[1, S]`` (position id of each token in its sample), ``packed_segments`` int32 ``[1, S]``
        (document number), ``packed_branches`` int32 ``[1, S]`` (0: the trunk, seen by every later
        token of its document; k > 0: only by later tokens of branch k, the response of one
        sample in ``shared_prompt``), ``packed_index`` long ``[B, T]`` (the position in the row of
        padded token ``(b, t)``; -1 for padding, and for every token of a sample with an empty
        response: it has nothing to score; when no sample has a response the row is one
        placeholder token, id 0), and the attention plans :meth:`yatt.trainer.attention.DocumentAttention.of`
        reads. For the CPU's batched kernel: ``packed_trunk`` long ``[D, P]`` (each document's trunk
        positions, 0 past its end), ``packed_branch_q`` long ``[N, Q]`` (each branch's positions),
        ``packed_branch_k`` long ``[N, P + Q]`` (its trunk's positions, then its own),
        ``packed_branch_lens`` long ``[N, 2]`` (trunk and branch length) and ``packed_gather`` long
        ``[S]`` (each token's row in the attention output, trunk rows first, flattened). For
        variable-length attention (:mod:`yatt.trainer.flash_varlen`): the row cut into ``M``
        query sequences in row order (each trunk, then each of its branches), ``packed_cu_q``
        int32 ``[M + 1]`` (their offsets in the row), ``packed_cu_k`` int32 ``[M + 1]`` (offsets of
        their keys: a trunk's own tokens, a branch's trunk then itself), ``packed_kv_index`` long
        ``[K]`` (the row position of each key; absent in ``packed`` mode, where the keys are the
        row itself) and ``packed_max_lens`` long ``[2]`` (longest query and key sequence).
    Raises:
        ValueError: unknown mode, ``B`` mismatch, or a sample longer than ``width``.
    """
    if mode not in MODES[1:]:
        raise ValueError(f"packing mode {mode!r}: expected one of {MODES[1:]}")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    docs: dict = {}  # document key -> its samples (sample b's own key with "packed")
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > width:
            raise ValueError(f"sample {b} has {len(p) + len(r)} tokens, wider than its row ({width})")
        if r:  # an empty response has nothing to score: its sample is left out (index -1)
            docs.setdefault(tuple(p) if mode == "shared_prompt" else b, []).append(b)
    shared = mode == "shared_prompt"
    ids, positions, segments, branches = [], [], [], []
    trunks, branch = [], []  # trunk positions per document; (trunk number, positions) per branch
    index = torch.full((len(prompts), width), -1, dtype=torch.long)
    for seg, members in enumerate(docs.values()):
        trunk = list(prompts[members[0]]) + ([] if shared else list(responses[members[0]]))
        start = len(ids)
        trunks.append(range(start, start + len(trunk)))
        ids += trunk
        positions += range(len(trunk))
        segments += [seg] * len(trunk)
        branches += [0] * len(trunk)
        p = len(prompts[members[0]])
        for b in members:
            index[b, :p] = torch.arange(start, start + p)
        if not shared:
            index[members[0], p:len(trunk)] = torch.arange(start + p, start + len(trunk))
            continue
        for k, b in enumerate(members, start=1):
            n, at = len(responses[b]), len(ids)
            branch.append((len(trunks) - 1, range(at, at + n)))
            ids += responses[b]
            positions += range(p, p + n)
            segments += [seg] * n
            branches += [k] * n
            index[b, p:p + n] = torch.arange(at, at + n)
    if not ids:  # no sample has a response: one placeholder token, so the model still runs a row
        ids, positions, segments, branches, trunks = [0], [0], [0], [0], [range(1)]
    row = {"packed_ids": ids, "packed_positions": positions}
    out = {k: torch.tensor([v], dtype=torch.long) for k, v in row.items()}
    out.update(packed_segments=torch.tensor([segments], dtype=torch.int32),
               packed_branches=torch.tensor([branches], dtype=torch.int32), packed_index=index)
    out.update(_attention_plan(trunks, branch, len(ids)))
    out.update(_varlen_plan(trunks, branch, shared))
    return out


def _attention_plan(trunks: list[range], branch: list[tuple[int, range]], size: int) -> dict[str, torch.Tensor]:
    """The gather indices of :func:`pack_rows`' attention plan (see there)."""
    P = max((len(t) for t in trunks), default=0)
    Q = max((len(r) for _, r in branch), default=0)
    trunk = torch.zeros(len(trunks), P, dtype=torch.long)
    gather = torch.zeros(size, dtype=torch.long)
    for d, t in enumerate(trunks):
        trunk[d, :len(t)] = torch.tensor(t, dtype=torch.long)
        gather[t.start:t.stop] = torch.arange(d * P, d * P + len(t))
    branch_q = torch.zeros(len(branch), Q, dtype=torch.long)
    branch_k = torch.zeros(len(branch), P + Q, dtype=torch.long)
    lens = torch.zeros(len(branch), 2, dtype=torch.long)
    base = len(trunks) * P
    for j, (d, r) in enumerate(branch):
        positions = torch.tensor(r, dtype=torch.long)
        branch_q[j, :len(r)] = positions
        branch_k[j, :P] = trunk[d]
        branch_k[j, P:P + len(r)] = positions
        lens[j] = torch.tensor([len(trunks[d]), len(r)])
        gather[r.start:r.stop] = torch.arange(base + j * Q, base + j * Q + len(r))
    return {"packed_trunk": trunk, "packed_branch_q": branch_q, "packed_branch_k": branch_k,
            "packed_branch_lens": lens, "packed_gather": gather}


def _varlen_plan(trunks: list[range], branch: list[tuple[int, range]], shared: bool) -> dict[str, torch.Tensor]:
    """:func:`pack_rows`' variable-length attention plan (see there): the row's query sequences in
    row order, each with its keys; a branch's queries are the last of its keys, so causal attention
    aligned at the sequences' ends (FlashAttention's convention) lets each see its whole trunk."""
    seqs = sorted([(t, list(t)) for t in trunks] + [(r, [*trunks[d], *r]) for d, r in branch],
                  key=lambda s: s[0].start)  # (query positions, key positions) in row order
    seqs = [(q, k) for q, k in seqs if len(q)]
    q_lens = [len(q) for q, _ in seqs]
    k_lens = [len(k) for _, k in seqs]
    out = {"packed_cu_q": torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
           "packed_cu_k": torch.tensor([0, *k_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
           "packed_max_lens": torch.tensor([max(q_lens), max(k_lens)], dtype=torch.long)}
    if shared:
        out["packed_kv_index"] = torch.tensor([p for _, k in seqs for p in k], dtype=torch.long)
    return out


def attention_mask(segments: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's dense boolean attention mask of a packed row (True = masked out): what
    :class:`yatt.trainer.attention.DocumentAttention` computes without it, and what Megatron's own
    attention path gets when the fused kernel does not apply.

    Args:
        segments, branches: ``[R, W]`` as :func:`pack_rows` returns them.
    Returns:
        bool ``[R, 1, W, W]``: query ``i`` may attend to key ``j`` iff both are in the same
        document, ``j <= i``, and ``j``'s branch is 0 or ``i``'s.
    """
    W = segments.shape[1]
    causal = torch.ones(W, W, dtype=torch.bool, device=segments.device).tril_()
    key_seg, key_branch = segments[:, None, :], branches[:, None, :]
    allowed = ((segments[:, :, None] == key_seg) & causal
               & ((key_branch == 0) | (key_branch == branches[:, :, None])))
    return (~allowed).unsqueeze(1)


def rope_at_positions(positions: torch.Tensor):
    """A forward hook for Megatron-Core's ``RotaryEmbedding`` that gives each token the rotary
    frequencies of its own position id instead of its column.

    Megatron-Core applies ``position_ids`` to rotary embeddings only in its THD (Transformer
    Engine) layout; the embedding it returns for padded rows is ``[S, 1, 1, D]`` by column. The
    hook returns ``emb[positions]`` as ``[W, R, 1, D]``, which ``apply_rotary_pos_emb`` (unfused)
    broadcasts over the heads of ``[W, R, heads, D]`` queries and keys.

    Args:
        positions: long ``[R, W]`` position ids (each ``< W``, the sequence length the model sees).
    """
    def hook(module, args, emb):
        return emb[:, 0, 0][positions.t()].unsqueeze(2)
    return hook

