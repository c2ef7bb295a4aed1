"""How samples travel between DP ranks: a byte layout derived from the sample class's fields.

Every field of a sample dataclass (:class:`yatt.controller.batch.Sample` or a subclass) declares
its kind in ``dataclasses.field(metadata=...)``:

- :data:`TOKENS`: token ids, int32; exactly ``prompt_ids`` and ``response_ids``, in that order.
  Their lengths are not sent: the DP balancer all-gathers them to plan, so every rank has them.
- :data:`PER_TOKEN`: one float32 per response token (the rollout logprobs; a critic's values or
  token-level rewards when an algorithm adds them); the length must be the response's.
- :data:`SCALAR`: one float64 per sample (reward, advantage); it comes back as a float.
- :func:`choice`: one of a fixed set of strings (the finish reason), sent as its index.

A buffer of ``k`` samples is ``[k x S float64: scalars and choices, field order | token ids,
int32, sample by sample (prompt then response) | each PER_TOKEN field, float32, field by field]``
as uint8. A field added to the sample class with one of these kinds travels with no change here
or in the exchange (:mod:`yatt.controller.rebalance`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import numpy as np

TOKENS = {"wire": "tokens"}
PER_TOKEN = {"wire": "per_token"}
SCALAR = {"wire": "scalar"}


def choice(*values: str) -> dict:
    """The metadata of a field holding one of ``values`` (sent as its index)."""
    return {"wire": "choice", "choices": tuple(values)}


@dataclass(frozen=True)
class _Fields:
    per_token: tuple[str, ...]
    scalars: tuple[tuple[str, tuple[str, ...] | None], ...]  # (name, choices or None)


@functools.cache
def _fields(cls: type) -> _Fields:
    """``cls``'s fields by wire kind.

    Raises:
        TypeError: a field declares no kind or an unknown one, or the token fields are not
            exactly ``prompt_ids`` then ``response_ids``.
    """
    tokens, per_token, scalars = [], [], []
    for f in fields(cls):
        kind = f.metadata.get("wire")
        if kind == "tokens":
            tokens.append(f.name)
        elif kind == "per_token":
            per_token.append(f.name)
        elif kind in ("scalar", "choice"):
            scalars.append((f.name, f.metadata.get("choices")))
        else:
            raise TypeError(f"{cls.__name__}.{f.name} declares no wire kind: give it field(metadata=...) with "
                            "yatt.controller.wire.TOKENS, PER_TOKEN, SCALAR or choice(...), so it can travel "
                            "between DP ranks")
    if tokens != ["prompt_ids", "response_ids"]:
        raise TypeError(f"{cls.__name__}: the TOKENS fields must be prompt_ids then response_ids, not {tokens}")
    return _Fields(tuple(per_token), tuple(scalars))


def lengths(samples: list) -> np.ndarray:
    """``[k, 2]`` int64: each sample's (prompt, response) length in tokens."""
    return np.array([[len(s.prompt_ids), len(s.response_ids)] for s in samples], dtype=np.int64).reshape(-1, 2)


def packed_bytes(cls: type, lens: np.ndarray) -> int:
    """Bytes of :func:`pack` for ``cls`` samples with (prompt, response) lengths ``lens`` ``[k, 2]``."""
    f = _fields(cls)
    return int(8 * len(f.scalars) * len(lens) + 4 * lens.sum() + 4 * len(f.per_token) * lens[:, 1].sum())


def pack(samples: list, cls: type) -> np.ndarray:
    """``samples`` (instances of ``cls``) as one uint8 buffer (the layout in the module docstring).

    Raises:
        ValueError: a choice field holds a value outside its choices, or a PER_TOKEN field's
            length is not the response's (both name the field).
    """
    f = _fields(cls)
    rows = [[_code(s, name, options) for name, options in f.scalars] for s in samples]
    header = np.array(rows, dtype=np.float64).reshape(-1, len(f.scalars))
    tokens = np.fromiter((t for s in samples for t in (*s.prompt_ids, *s.response_ids)), dtype=np.int32)
    parts = [header.view(np.uint8).ravel(), tokens.view(np.uint8)]
    for name in f.per_token:
        for s in samples:
            if len(getattr(s, name)) != len(s.response_ids):
                raise ValueError(f"{cls.__name__}.{name} has {len(getattr(s, name))} values for a response of "
                                 f"{len(s.response_ids)} tokens: a PER_TOKEN field has one per response token")
        parts.append(np.fromiter((x for s in samples for x in getattr(s, name)), dtype=np.float32).view(np.uint8))
    return np.concatenate(parts)


def unpack(buf: np.ndarray, lens: np.ndarray, cls: type) -> list:
    """Inverse of :func:`pack`, given the samples' (prompt, response) lengths ``lens`` ``[k, 2]``.

    Raises:
        ValueError: the buffer's size does not match ``lens``.
    """
    f = _fields(cls)
    if len(buf) != packed_bytes(cls, lens):
        raise ValueError(f"a packed buffer of {len(buf)} bytes for samples that need {packed_bytes(cls, lens)}")
    k, n_tok, n_resp = len(lens), int(lens.sum()), int(lens[:, 1].sum())
    cut = 8 * len(f.scalars) * k
    header = buf[:cut].view(np.float64).reshape(k, len(f.scalars)).tolist()
    tokens = buf[cut:cut + 4 * n_tok].view(np.int32).tolist()
    flat = buf[cut + 4 * n_tok:].view(np.float32)
    per_token = {name: flat[i * n_resp:(i + 1) * n_resp] for i, name in enumerate(f.per_token)}
    out, t, r = [], 0, 0
    for (p, n), row in zip(lens.tolist(), header):
        values = {name: (options[int(v)] if options else v) for (name, options), v in zip(f.scalars, row)}
        values.update({name: arr[r:r + n].tolist() for name, arr in per_token.items()})
        out.append(cls(prompt_ids=tokens[t:t + p], response_ids=tokens[t + p:t + p + n], **values))
        t, r = t + p + n, r + n
    return out


def _code(sample, name: str, options: tuple[str, ...] | None) -> float:
    value = getattr(sample, name)
    if options is None:
        return float(value)
    if value not in options:
        raise ValueError(f"{type(sample).__name__}.{name} is {value!r}, not one of {options}")
    return float(options.index(value))
