"""Padding-free micro-batches: several sequences per trainer row, attention kept inside each.

A micro-batch reaches the trainer as right-padded ``[B, T]`` rows (what the losses read). With
packing, the model body instead runs on packed rows ``[R, W]``: each row holds several
*documents* back to back, each with its own position ids (restarting at 0) and a block-diagonal
causal attention mask, so a token sees exactly the tokens it would see in its padded row, and
every logprob equals the padded one (to fp32 rounding). Two layouts (``trainer.packing``):

- ``packed``: a document is one sample (prompt + response).
- ``shared_prompt``: a document is one prompt followed by the responses of the samples in the
  micro-batch that share it: each response token attends to the prompt and to its own response
  only, its position ids continue from the prompt. The prompt runs once instead of once per
  sample, or once per document when a group's responses are split over several.

Documents are placed by first-fit decreasing into rows as wide as the widest document, not into
one long row. The attention runs on the whole row (an explicit mask keeps each token inside its
document), so a row of width ``W`` costs about ``1 + W / ATTENTION_WIDTH`` times the rest of the
model's work per position. With ``shared_prompt`` the width is chosen by that cost: for each
candidate cap (the padded width, its multiples, each group's width), every group's responses are
split first-fit decreasing into documents of at most the cap, the documents packed into rows,
and the layout with the least ``R * W * (1 + W / ATTENTION_WIDTH)`` kept. Short groups end up one
document each; long ones take another copy of their prompt rather than one very wide row.

Source of the idea: padding-free / packed sequences as verl (``use_remove_padding``), OpenRLHF
(``packing_samples``) and NeMo-RL (sequence packing) run them; shared-prompt attention as in
"prefix sharing" for GRPO groups (e.g. Prefix Grouper, Liu et al. 2025).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MODES = ("padded", "packed", "shared_prompt")
# The row width at which a position's attention (against the whole row, masked) costs as much as
# the rest of its forward and backward pass. Measured for SmolLM2-135M (hidden 576, torch's fused
# attention, one thread, 2026-12-03, the dev machine): 30 layers of attention over 7 rows x 164
# took 0.88 s against ~9.5 s for the rest of the update, ~0.8 ms against ~8.3 ms per position,
# linear in the width. Wider models have more work per position than per score, so for them it
# is an underestimate, which errs towards narrower rows.
ATTENTION_WIDTH = 1700


def pack_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], width: int,
              mode: str = "packed") -> dict[str, torch.Tensor]:
    """Lay out a micro-batch's samples as packed rows.

    Args:
        prompts, responses: ``B`` token id lists each; sample ``b`` is ``prompts[b] + responses[b]``
            (its padded row, :func:`yatt.controller.batch.pack_micro_batches`, has it at 0..L_b-1).
        width: ``T``, the padded rows' width (``>= max L_b``).
        mode: ``"packed"`` or ``"shared_prompt"`` (samples with equal prompt ids share a copy of
            it per document; the documents and the row width ``W`` chosen by cost, above).
    Returns:
        ``packed_ids`` long ``[R, W]`` (0 in padding), ``packed_positions`` long ``[R, W]`` (position
        id of each token in its sample), ``packed_segments`` int32 ``[R, W]`` (document number in
        the row, -1 for padding), ``packed_branches`` int32 ``[R, W]`` (0: seen by every later
        token of its document, the prompt in ``shared_prompt`` and everything in ``packed``;
        k > 0: only by later tokens of branch k, the response of one sample), and
        ``packed_index`` long ``[B, T]``: the flat position ``r * W + c`` in the packed rows of
        padded token ``(b, t)`` (-1 for padding, and for every token of a sample with an empty
        response: it has nothing to score).
    Raises:
        ValueError: unknown mode, ``B`` mismatch, or a sample longer than ``width``.
    """
    if mode not in MODES[1:]:
        raise ValueError(f"packing mode {mode!r}: expected one of {MODES[1:]}")
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    docs: dict = {}  # document key -> the samples it holds (sample b's own key with "packed")
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > width:
            raise ValueError(f"sample {b} has {len(p) + len(r)} tokens, wider than its row ({width})")
        if r:  # an empty response has nothing to score: its sample is left out (index -1)
            docs.setdefault(tuple(p) if mode == "shared_prompt" else b, []).append(b)
    groups = [(list(prompts[same[0]]), sorted(same, key=lambda b: -len(responses[b]))) for same in docs.values()]
    resp = [len(r) for r in responses]
    whole = [len(p) + sum(resp[b] for b in same) for p, same in groups]
    caps = {width} if mode == "packed" else {width, *whole, *range(2 * width, max(whole, default=0), width)}
    doc_list, sizes, rows, W = min((_layout(groups, resp, cap) for cap in sorted(caps)),
                                   key=lambda lay: len(lay[2]) * lay[3] * (1 + lay[3] / ATTENTION_WIDTH))
    R = max(len(rows), 1)
    ids = torch.zeros(R, W, dtype=torch.long)
    positions = torch.zeros(R, W, dtype=torch.long)
    segments = torch.full((R, W), -1, dtype=torch.int32)
    branches = torch.zeros(R, W, dtype=torch.int32)
    index = torch.full((len(prompts), width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        c = 0
        for seg, d in enumerate(row):
            prompt, members = doc_list[d]
            p = len(prompt)
            ids[r, c:c + p] = torch.tensor(prompt, dtype=torch.long)
            positions[r, c:c + p] = torch.arange(p)
            segments[r, c:c + p] = seg
            for b in members:
                index[b, :p] = r * W + c + torch.arange(p)
            c += p
            for k, b in enumerate(members, start=1):
                n = len(responses[b])
                ids[r, c:c + n] = torch.tensor(list(responses[b]), dtype=torch.long)
                positions[r, c:c + n] = torch.arange(p, p + n)
                segments[r, c:c + n] = seg
                branches[r, c:c + n] = k if mode == "shared_prompt" else 0
                index[b, p:p + n] = r * W + c + torch.arange(n)
                c += n
    return {"packed_ids": ids, "packed_positions": positions, "packed_segments": segments,
            "packed_branches": branches, "packed_index": index}


def _layout(groups: list[tuple[list[int], list[int]]], resp: list[int], cap: int):
    """Documents of at most ``cap`` tokens and their rows: ``(documents [(prompt, samples)], their
    sizes, rows [document indices], row width)``. Each group's responses (``groups``: prompt,
    samples longest first) go first-fit into documents that each start with the prompt; the
    documents go first-fit decreasing into rows as wide as the widest."""
    doc_list, sizes = [], []
    for prompt, members in groups:
        first = len(doc_list)
        for b in members:
            d = next((d for d in range(first, len(doc_list)) if sizes[d] + resp[b] <= cap), None)
            if d is None:
                doc_list.append((prompt, []))
                sizes.append(len(prompt))
                d = len(doc_list) - 1
            doc_list[d][1].append(b)
            sizes[d] += resp[b]
    for _, members in doc_list:
        members.sort()  # a document's responses in sample order
    W = max(sizes, default=1)
    rows: list[list[int]] = []  # document indices per row
    free: list[int] = []
    for d in sorted(range(len(doc_list)), key=lambda d: -sizes[d]):  # first-fit decreasing
        r = next((r for r, f in enumerate(free) if f >= sizes[d]), None)
        if r is None:
            rows.append([])
            free.append(W)
            r = len(rows) - 1
        rows[r].append(d)
        free[r] -= sizes[d]
    return doc_list, sizes, rows, W


def attention_mask(segments: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's boolean attention mask for packed rows (True = masked out).

    Args:
        segments, branches: ``[R, W]`` as :func:`pack_rows` returns them.
    Returns:
        bool ``[R, 1, W, W]``: query ``i`` may attend to key ``j`` iff both are in the same
        document, ``j <= i``, and ``j``'s branch is 0 or ``i``'s. A padding query attends to itself
        only (its output is never read; a query that sees no key would make fused attention
        kernels return NaN or 0).
    """
    W = segments.shape[1]
    causal = torch.ones(W, W, dtype=torch.bool, device=segments.device).tril_()
    key_seg, key_branch = segments[:, None, :], branches[:, None, :]
    allowed = ((segments[:, :, None] == key_seg) & (key_seg >= 0) & causal
               & ((key_branch == 0) | (key_branch == branches[:, :, None])))
    allowed |= torch.eye(W, dtype=torch.bool, device=segments.device) & (segments < 0)[:, :, None]
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

