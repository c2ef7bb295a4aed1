"""Padding-free micro-batches: several sequences per trainer row, attention kept inside each.

A micro-batch reaches the trainer as right-padded ``[B, T]`` rows (what the losses read). With
packing, the model body instead runs on packed rows ``[R, W]``: each row holds several
*documents* back to back, each with its own position ids (restarting at 0) and a block-diagonal
causal attention mask, so a token sees exactly the tokens it would see in its padded row, and
every logprob equals the padded one (to fp32 rounding). Two layouts (``trainer.packing``):

- ``packed``: a document is one sample (prompt + response).
- ``shared_prompt``: a document is one prompt followed by the responses of the samples in the
  micro-batch that share it (up to :data:`SHARED_WIDTH` times the padded width): each response
  token attends to the prompt and to its own response only, its position ids continue from the
  prompt. The prompt runs once instead of once per sample.

Documents are placed by first-fit decreasing into rows as wide as the longest document, not into
one long row: on the local (mask-based) attention a row of width ``W`` costs ``W**2`` scores, so
one row of all ``P`` tokens would cost ``P**2`` against the padded rows' ``B * T**2``.

Source of the idea: padding-free / packed sequences as verl (``use_remove_padding``), OpenRLHF
(``packing_samples``) and NeMo-RL (sequence packing) run them; shared-prompt attention as in
"prefix sharing" for GRPO groups (e.g. Prefix Grouper, Liu et al. 2025).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MODES = ("padded", "packed", "shared_prompt")
# A shared-prompt document holds at most this many times the padded width: a prompt's responses
# beyond it start another copy of the prompt. On the local attention a document of width D costs
# D**2 scores (memory and time), so one document of a whole long group would cost far more than
# its padded rows; at 2x the scores of a token's row are at most twice the padded row's.
SHARED_WIDTH = 2


def pack_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], width: int,
              mode: str = "packed") -> dict[str, torch.Tensor]:
    """Lay out a micro-batch's samples as packed rows.

    Args:
        prompts, responses: ``B`` token id lists each; sample ``b`` is ``prompts[b] + responses[b]``
            (its padded row, :func:`yatt.controller.batch.pack_micro_batches`, has it at 0..L_b-1).
        width: ``T``, the padded rows' width (``>= max L_b``).
        mode: ``"packed"`` or ``"shared_prompt"`` (samples with equal prompt ids share one copy).
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
    cap = SHARED_WIDTH * width
    docs: dict = {}  # document key -> its documents [prompt, sample indices, tokens], the last one open
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) + len(r) > width:
            raise ValueError(f"sample {b} has {len(p) + len(r)} tokens, wider than its row ({width})")
        if not r:  # an empty response has nothing to score: its sample is left out (index -1)
            continue
        same = docs.setdefault(tuple(p) if mode == "shared_prompt" else b, [])
        if not same or same[-1][2] + len(r) > cap:
            same.append([list(p), [], len(p)])
        same[-1][1].append(b)
        same[-1][2] += len(r)
    doc_list = [(p, members) for same in docs.values() for p, members, _ in same]
    sizes = [size for same in docs.values() for _, _, size in same]
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


def attention_mask(segments: torch.Tensor, branches: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's boolean attention mask for packed rows (True = masked out).

    Args:
        segments, branches: ``[R, W]`` as :func:`pack_rows` returns them.
    Returns:
        bool ``[R, 1, W, W]``: query ``i`` may attend to key ``j`` iff both are in the same
        document, ``j <= i``, and ``j``'s branch is 0 or ``i``'s. A padding query attends to nothing
        (its output is never read).
    """
    W = segments.shape[1]
    causal = torch.ones(W, W, dtype=torch.bool, device=segments.device).tril_()
    key_seg, key_branch = segments[:, None, :], branches[:, None, :]
    allowed = ((segments[:, :, None] == key_seg) & (key_seg >= 0) & causal
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

