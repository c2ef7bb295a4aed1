"""Resume on another TP or PP: a checkpoint's model and optimizer shards in this job's layout.

A checkpoint holds one model and one optimizer file per role and (TP rank, PP stage), written by
DP rank 0 of each (:mod:`yatt.checkpoint.run_state`). A job with another TP or PP rebuilds, on
every rank, its own shard from them one parameter at a time, with the weight sync's mapping:
the saved TP shards of the parameter, from the stage that held its layer, -> full HF tensors
(:func:`~yatt.trainer.hf_mapping.megatron_to_hf`) -> this rank's shard
(:func:`~yatt.trainer.hf_mapping.megatron_param`). Adam's moments and a bf16 run's fp32 main
parameters have their parameter's shape and layout and are resharded the same way; they are
matched to parameters by name (the ``param_names`` saved beside each optimizer state). The files
are memory-mapped, so a rank reads the parts it needs.

Values are copied, never recomputed: a state resharded to another layout and back equals the
saved one bit for bit. Vocabulary padding rows (no token reaches them) start at zero when the
padded size changes with TP.

A LoRA checkpoint holds the adapters (and a critic's value head) and their optimizer states only;
the frozen base comes from the HF folder as at any start. Each layer's TP-split adapter matrix
(:func:`~yatt.trainer.lora.split_adapter`) has its weight's layout and is resharded through its
weight's mapping; the other one is replicated and copied.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from yatt.checkpoint.files import role_key
from yatt.checkpoint.saver import load_part
from yatt.trainer.hf_mapping import (Layout, global_param_name, megatron_name_of, megatron_param, megatron_to_hf,
                                     tp_shard_dim)
from yatt.trainer.lora import adapted_weight, is_adapter, split_adapter
from yatt.trainer.model import _stage_name


class SavedShards:
    """The TP x PP shards of one role in a checkpoint, read lazily.

    Args:
        folder: a complete checkpoint (a ``step_*`` folder).
        role: ``"actor"`` or ``"critic"``.
        layout: the model's shapes with the TP size the checkpoint was saved with.
        pp: the PP size it was saved with.
        head: ``"lm"`` (a causal LM) or ``"value"`` (a critic's or reward model's replicated
            ``[1, H]`` head as ``output_layer.weight``, no LM head).
    """

    def __init__(self, folder: str | Path, role: str, layout: Layout, pp: int, head: str = "lm") -> None:
        self.folder, self.role, self.layout, self.pp, self.head = Path(folder), role, layout, pp, head
        self._files: dict[tuple, dict] = {}
        self._optim: dict[tuple[int, int], dict[str, dict]] = {}

    def _file(self, kind: str, t: int, s: int) -> dict:
        if (kind, t, s) not in self._files:
            self._files[kind, t, s] = load_part(self.folder, kind, role_key(self.role, f"tp{t}_pp{s}"))
        return self._files[kind, t, s]

    def _where(self, name: str) -> tuple[int, str]:
        """(saved stage, stage-local name) of Megatron parameter ``name`` (global layer index); the
        last stage's copy of tied embeddings is the embedding (the same values and optimizer state)."""
        if name == "output_layer.weight" and self.head == "lm" and self.layout.tied_embeddings:
            name = "embedding.word_embeddings.weight"
        for s in range(self.pp):
            if local := _stage_name(name, self.layout, self.pp, s, self.head):
                return s, local[0]
        raise KeyError(f"checkpoint {self.folder} ({self.role}) has no parameter {name!r}")

    def _replicated(self, name: str) -> bool:
        if is_adapter(name):
            return not split_adapter(name)
        return tp_shard_dim(name) is None or (self.head == "value" and name == "output_layer.weight")

    def shards(self, name: str, kind: str = "param") -> list[torch.Tensor]:
        """The saved TP shards (one when replicated) of parameter ``name``: the parameter
        (``kind="param"``) or an entry of its optimizer state (``exp_avg``, ``exp_avg_sq``, and
        ``main``, a bf16 run's fp32 copy).

        Raises:
            KeyError: the checkpoint has no such parameter or state.
            ValueError: its optimizer files have no ``param_names``.
        """
        s, local = self._where(name)
        tps = 1 if self._replicated(name) else self.layout.tp
        if kind == "param":
            return [self._file("model", t, s)[local] for t in range(tps)]
        return [self._states(t, s)[local][kind] for t in range(tps)]

    def state_entry(self, name: str) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s optimizer state on saved TP rank 0 (``{}``: never stepped)."""
        s, local = self._where(name)
        return self._states(0, s).get(local, {})

    def scheduler(self) -> dict:
        """The LR scheduler's state (the same in every shard)."""
        return self._file("optim", 0, 0)["scheduler"]

    def hf(self, kind: str = "param") -> Mapping[str, torch.Tensor]:
        """HF name -> full tensor of ``kind``, each Megatron parameter merged on first read."""
        return _HFView(self, kind)

    def _states(self, t: int, s: int) -> dict[str, dict]:
        """Stage-local parameter name -> its optimizer state (``step``, ``exp_avg``, ``exp_avg_sq``;
        ``main`` in a bf16 run) in shard (``t``, ``s``)."""
        if (t, s) not in self._optim:
            part = self._file("optim", t, s)
            if "param_names" not in part:
                raise ValueError(f"config key 'resume': checkpoint {self.folder} was written before checkpoints named "
                                 "their optimizer states (param_names); it resumes only with the TP and PP it was "
                                 "saved with")
            states = {}
            for sd, names in zip(_optimizers(part["optimizer"]), part["param_names"]):
                inner = sd.get("optimizer", sd)  # a bf16 run's optimizer wraps torch's
                mains = sd.get("fp32_from_fp16_params")
                for g, (group, group_names) in enumerate(zip(inner["param_groups"], names)):
                    if mains is not None and len(mains[g]) != len(group_names):
                        raise NotImplementedError("a bf16 optimizer group holding fp32 parameters is not resharded")
                    for j, (index, name) in enumerate(zip(group["params"], group_names)):
                        states[name] = dict(inner["state"].get(index, {}))
                        if mains is not None:
                            states[name]["main"] = mains[g][j]
            self._optim[t, s] = states
        return self._optim[t, s]


class _HFView(Mapping):
    """:meth:`SavedShards.hf`: the last merged Megatron parameter is kept (q, k and v, or gate
    and up, are read one after another)."""

    def __init__(self, saved: SavedShards, kind: str) -> None:
        self.saved, self.kind, self._last = saved, kind, ("", {})

    def __getitem__(self, hf_name: str) -> torch.Tensor:
        name = megatron_name_of(hf_name)
        if self._last[0] != name:
            merged = megatron_to_hf(name, self.saved.shards(name, self.kind), self.saved.layout)
            self._last = (name, dict(merged))
        return self._last[1][hf_name]

    def __iter__(self) -> Iterator[str]:
        raise TypeError("a checkpoint's HF view is read by name only")

    def __len__(self) -> int:
        raise TypeError("a checkpoint's HF view is read by name only")


def _optimizers(state) -> list[dict]:
    """The per-optimizer state dicts of a Megatron optimizer's ``state_dict()`` (a chained one
    of several gives a list)."""
    return state if isinstance(state, list) else [state]


def reshard(saved: SavedShards, name: str, kind: str, layout: Layout, tp_rank: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard, in ``layout`` (this job's TP), of saved parameter ``name``
    (global layer index) or of its optimizer state ``kind`` (see :meth:`SavedShards.shards`)."""
    if saved.head == "value" and name == "output_layer.weight":
        return saved.shards(name, kind)[0]
    if is_adapter(name):  # the split one laid out as its layer's weight, the other replicated
        shards, weight = saved.shards(name, kind), adapted_weight(name)
        if not split_adapter(name):
            return shards[0]
        return megatron_param(weight, dict(megatron_to_hf(weight, shards, saved.layout)), layout, tp_rank)
    # a critic's model maps like a tied one (no LM head)
    mapped = dataclasses.replace(layout, tied_embeddings=True) if saved.head == "value" else layout
    return megatron_param(name, saved.hf(kind), mapped, tp_rank)


def relaid_states(saved: SavedShards, model, tp_rank: int) -> tuple[dict, dict]:
    """This rank's shard of a saved role, for ``model`` (a trained
    :class:`~yatt.trainer.actor.MegatronPolicy` or critic, in this job's TP and PP):
    ``(model state dict, {"optimizer", "scheduler"})``, ready for ``load_model_state_dict`` and
    the optimizer's and scheduler's ``load_state_dict``.

    With LoRA the model state is :meth:`~yatt.trainer.actor.MegatronPolicy.model_state_dict`'s:
    the adapters (and a critic's value head), the base being the model's own.

    Raises:
        ValueError: the checkpoint's optimizer files have no ``param_names``.
    """
    layout, pp, stage = model.layout, model.pp, model.stage

    def full_name(local: str) -> str:
        return global_param_name(local, layout, pp, stage)

    params = dict(model.module.named_parameters())
    if model.lora is None:
        state = model.module.state_dict()  # the template: its _extra_state entries are this model's own
        trained = list(params)
    else:
        state, trained = {}, list(model.model_state_dict())
    for local in trained:
        state[local] = reshard(saved, full_name(local), "param", layout, tp_rank).to(params[local].dtype)
    optimizer = model.optimizer.state_dict()
    for sd, names in zip(_optimizers(optimizer), model.optimizer_param_names()):
        inner = sd.get("optimizer", sd)
        if "fp32_from_fp16_params" in sd:
            sd["fp32_from_fp16_params"] = [[reshard(saved, full_name(n), "main", layout, tp_rank) for n in group]
                                           for group in names]
        inner["state"] = {}
        for group, group_names in zip(inner["param_groups"], names):
            for index, local in zip(group["params"], group_names):
                name = full_name(local)
                if entry := {k: v for k, v in saved.state_entry(name).items() if k != "main"}:
                    inner["state"][index] = {k: v.clone() if v.dim() == 0 else reshard(saved, name, k, layout, tp_rank)
                                             for k, v in entry.items()}
    return state, {"optimizer": optimizer, "scheduler": saved.scheduler()}
