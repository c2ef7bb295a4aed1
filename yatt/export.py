"""Export a trainer checkpoint as a self-contained Hugging Face folder.

    python -m yatt.export CHECKPOINT OUT_DIR [--overwrite] [--max-shard-size 5GB] [--model-path DIR]
                          [--role actor|critic] [--merge]

``CHECKPOINT`` is a committed step directory (``<root>/step_000012``, holding ``meta.json`` and
``model/tp{t}_pp{p}.pt``: the ``state_dict()`` of the GPTModel of TP rank t, pipeline stage p,
stage-local layer numbers) or a checkpoint root whose ``latest`` file names one. The shards are
merged with :mod:`yatt.trainer.hf_mapping` (the mapping the live weight sync uses) and written as
safetensors (sharded with an index above ``--max-shard-size``) next to the base model's
``config.json`` (``dtype`` / ``torch_dtype`` set to the checkpoint dtype), generation config,
tokenizer files and chat template, so ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and
``vllm.LLM(OUT_DIR)`` load it as is. ``--role critic`` exports PPO's value model instead
(``model/critic_tp{t}_pp{p}.pt``) as a one-label ``*ForSequenceClassification`` folder whose
``score.weight`` is the value head. The folder is built under a temporary name beside
``OUT_DIR`` and renamed into place when complete. A LoRA checkpoint (``trainer.lora``: adapters
only) is written as a PEFT adapter folder for the base model (``PeftModel.from_pretrained``), or
with ``--merge`` as the base model with the adapters merged in. Errors print ``yatt.export: <message>`` to
stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from yatt.checkpoint import files
from yatt.paths import writable_dir
from yatt.trainer.hf_mapping import (
    Layout,
    global_param_name,
    layout_from_hf,
    megatron_to_hf,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Files of the base model's folder that the exported folder needs besides the weights.
ASSET_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
               "tokenizer.model", "spiece.model", "vocab.txt")


def read_meta(step_dir: Path) -> dict:
    """``meta.json`` of a step directory, checked.

    Raises:
        FileNotFoundError: no ``meta.json``.
        ValueError: unknown format, or a bad ``tp`` / ``pp`` / ``dtype`` / ``model_path``.
    """
    path = step_dir / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"no meta.json in {step_dir}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if meta.get("format") != files.FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this exporter reads {files.FORMAT}")
    for key in ("tp", "pp"):
        if not isinstance(meta.get(key), int) or meta[key] < 1:
            raise ValueError(f"{path}: {key} must be a positive integer, got {meta.get(key)!r}")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}")
    if not isinstance(meta.get("model_path"), str):
        raise ValueError(f"{path}: model_path missing")  # noqa: TRY004 (a bad file, not a bad argument)
    return meta


def expected_hf_names(layout: Layout, role: str = "actor") -> set[str]:
    """HF tensor names of a complete model of ``layout`` (tied: no ``lm_head.weight``; the critic:
    ``score.weight`` in place of the LM head)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if role == "critic":
        names.add("score.weight")
    elif not layout.tied_embeddings:
        names.add("lm_head.weight")
    kinds = ("weight", "bias") if layout.qkv_bias else ("weight",)
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")}
        names |= {f"{p}self_attn.{q}_proj.{k}" for q in "qkv" for k in kinds}
    return names


def _load_shard(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"missing model shard {path}")
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict")  # noqa: TRY004
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


def _stage_shards(step_dir: Path, meta: dict, role: str, stage: int) -> list[dict[str, torch.Tensor]]:
    """The ``role``'s shard state dicts of pipeline stage ``stage``, TP rank 0..tp-1 (memory-mapped).

    Raises:
        FileNotFoundError: a shard file is missing.
        ValueError: the TP ranks hold different names, or a tensor's dtype is not the checkpoint dtype.
    """
    dtype = DTYPES[meta["dtype"]]
    paths = [step_dir / "model" / f"{files.role_key(role, f'tp{t}_pp{stage}')}.pt" for t in range(meta["tp"])]
    shards = [_load_shard(f) for f in paths]
    for f, s in zip(paths, shards, strict=True):
        if s.keys() != shards[0].keys():
            diff = sorted(s.keys() ^ shards[0].keys())
            raise ValueError(f"{f} and {paths[0]} hold different parameters: {diff[:5]}")
        for local, t in s.items():
            if t.dtype != dtype:
                raise ValueError(f"{f}: {local} is {t.dtype}, meta.json says {meta['dtype']}")
    return shards


def hf_state_dict(step_dir: Path, meta: dict, hf_config: dict, role: str = "actor") -> dict[str, torch.Tensor]:
    """Merge the model shards of a step directory into full HF tensors.

    ``role="critic"`` merges the critic's shards (``model/critic_tp{t}_pp{p}.pt``): its value head
    ``[1, H]`` (replicated over TP) becomes a sequence-classification model's ``score.weight``.

    Loads one pipeline stage (its ``tp`` shard files, memory-mapped) at a time; the result is one
    model copy of fresh contiguous CPU tensors.

    Args:
        step_dir: committed step directory.
        meta: its ``meta.json`` (see :func:`read_meta`).
        hf_config: the base model's ``config.json`` dict.
    Returns:
        HF name -> tensor, shapes as the HF model's (vocab padding stripped), in the checkpoint
        dtype; with tied embeddings no ``lm_head.weight``.
    Raises:
        FileNotFoundError: a ``model/tp{t}_pp{p}.pt`` file is missing.
        ValueError: TP ranks of a stage hold different names, a tensor's dtype is not the
            checkpoint dtype, a weight appears twice, or weights are missing or unexpected.
        KeyError: a name the mapping does not know.
        NotImplementedError: a model type or feature :func:`layout_from_hf` cannot map.
    """
    tp, pp = meta["tp"], meta["pp"]
    layout = layout_from_hf(hf_config, tp)
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = _stage_shards(step_dir, meta, role, stage)
        for local, t0 in shards[0].items():
            name = global_param_name(local, layout, pp, stage)
            if role == "critic" and name == "output_layer.weight":  # the value head, the same on every TP rank
                out["score.weight"] = t0.clone(memory_format=torch.contiguous_format)
                continue
            if pp > 1 and layout.tied_embeddings and name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            for hf_name, t in megatron_to_hf(name, [s[local] for s in shards], layout):
                if hf_name in out:
                    raise ValueError(f"{hf_name} appears twice (stage {stage}: {name})")
                out[hf_name] = t.clone(memory_format=torch.contiguous_format)  # own storage, off the mmap
        del shards
    expected = expected_hf_names(layout, role)
    if missing := expected - out.keys():
        raise ValueError(f"checkpoint {step_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[:5]}")
    if extra := out.keys() - expected:
        raise ValueError(f"checkpoint {step_dir} has weights that a {layout.num_layers}-layer model does not: "
                         f"{sorted(extra)[:5]}")
    return out


def lora_settings(meta: dict, role: str) -> dict | None:
    """The role's LoRA settings in ``meta.json`` (``trainer.lora`` / ``critic.lora`` as saved), or
    None for a model trained whole."""
    return (meta.get("lora") or {}).get(role)


def lora_state(step_dir: Path, meta: dict, hf_config: dict, role: str = "actor") -> tuple[dict, dict]:
    """(PEFT adapter tensors, other trained tensors) of a LoRA checkpoint: every TP rank's adapters
    of every stage merged by :func:`yatt.trainer.lora.peft_state`; the other tensors are a critic's
    value head as ``score.weight``.

    Raises:
        FileNotFoundError / ValueError: as :func:`hf_state_dict` (a missing shard, another dtype,
            ranks holding different names), or a tensor that is neither an adapter nor a value head.
    """
    from yatt.trainer.lora import is_adapter, peft_state

    tp, pp = meta["tp"], meta["pp"]
    layout = layout_from_hf(hf_config, tp)
    by_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    extra = {}
    for stage in range(pp):
        shards = _stage_shards(step_dir, meta, role, stage)
        for local, t0 in shards[0].items():
            name = global_param_name(local, layout, pp, stage)
            if role == "critic" and name == "output_layer.weight":  # the value head, the same on every TP rank
                extra["score.weight"] = t0.clone(memory_format=torch.contiguous_format)
            elif is_adapter(name):
                for t, s in enumerate(shards):
                    by_rank[t][name] = s[local]
            else:
                raise ValueError(f"checkpoint {step_dir} stage {stage}: {local} is neither an adapter nor a value head")
    return peft_state(by_rank, layout), extra


def merged_lora_state(step_dir: Path, meta: dict, hf_config: dict, base: Path, role: str = "actor") -> dict:
    """The full HF state of a LoRA checkpoint: the base folder's weights in the checkpoint dtype
    plus ``alpha / r * B A`` of every adapter (and a critic's ``score.weight``).

    Raises:
        ValueError: the base folder's weights are not the model the adapters were trained on
            (missing or unexpected names).
    """
    from yatt.trainer.lora import merge_into_hf
    from yatt.trainer.model import SafetensorsState

    settings = lora_settings(meta, role)
    peft, extra = lora_state(step_dir, meta, hf_config, role)
    expected = expected_hf_names(layout_from_hf(hf_config, meta["tp"]), role)
    base_state = SafetensorsState(base)
    state = {n: base_state[n].to(DTYPES[meta["dtype"]]) for n in expected - extra.keys() if n in base_state}
    state.update(extra)
    if missing := expected - state.keys():
        raise ValueError(f"base model {base} lacks {len(missing)} weights, e.g. {sorted(missing)[:5]}")
    merge_into_hf(state, peft, settings["alpha"] / settings["rank"])
    return state


def full_state_dict(step_dir: Path, meta: dict, hf_config: dict, base: Path, role: str = "actor") -> dict:
    """A checkpoint's ``role`` as full HF tensors: its shards merged (:func:`hf_state_dict`), or
    for a LoRA checkpoint its adapters merged into the ``base`` folder's weights
    (:func:`merged_lora_state`)."""
    if lora_settings(meta, role) is None:
        return hf_state_dict(step_dir, meta, hf_config, role)
    return merged_lora_state(step_dir, meta, hf_config, base, role)


def _write_adapter(folder: Path, peft: dict, settings: dict, base: Path) -> None:
    """A PEFT adapter folder: ``adapter_config.json``, ``adapter_model.safetensors`` and the base
    model's tokenizer files (``PeftModel.from_pretrained(base model, folder)`` loads it)."""
    from safetensors.torch import save_file

    from yatt.trainer.lora import peft_config

    config = peft_config(settings["rank"], settings["alpha"], settings["dropout"], settings["targets"], str(base))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(peft, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    for name in ASSET_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, folder / name)


def _write_folder(folder: Path, state: dict[str, torch.Tensor], hf_config: dict, dtype: str, model_path: Path,
                  max_shard_size: int | str) -> None:
    from huggingface_hub import save_torch_state_dict

    # split_torch_state_dict_into_shards + safetensors save_file + model.safetensors.index.json
    save_torch_state_dict(state, folder, max_shard_size=max_shard_size)
    config = dict(hf_config, dtype=dtype, torch_dtype=dtype)  # transformers 5 reads "dtype", older "torch_dtype"
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ASSET_FILES:
        if (model_path / name).is_file():
            shutil.copyfile(model_path / name, folder / name)


def critic_config(hf_config: dict) -> dict:
    """The base model's ``config.json`` as a one-label sequence-classification model's (the
    critic's export: ``AutoModelForSequenceClassification`` loads it; YATT's critic and reward
    sources read its ``score.weight`` as the value head)."""
    arch = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification"}[hf_config["model_type"]]
    return dict(hf_config, architectures=[arch], num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, overwrite: bool = False, *,
                      max_shard_size: int | str = "5GB", model_path: str | Path | None = None,
                      role: str = "actor", merge: bool = False) -> Path:
    """Write the model of a checkpoint as an HF folder (safetensors, config, tokenizer), or, for a
    LoRA checkpoint, a PEFT adapter folder unless ``merge``.

    Args:
        checkpoint: step directory or checkpoint root (its ``latest`` is followed).
        out_dir: destination; must not exist or be empty unless ``overwrite``.
        overwrite: replace an existing non-empty ``out_dir`` (only once the export succeeded).
        max_shard_size: safetensors shard size (bytes or a string such as ``"5GB"``); above it
            the weights are split into ``model-0000i-of-0000n.safetensors`` + index.
        model_path: folder with the base model's config and tokenizer, instead of
            ``meta["model_path"]`` (``meta["critic_model_path"]`` for the critic; a checkpoint
            moved to another machine).
        role: ``"actor"`` (the policy, a causal LM) or ``"critic"`` (PPO's value model, written
            as a one-label sequence-classification model: :func:`critic_config`).
        merge: a LoRA checkpoint: write the base model with the adapters merged in
            (:func:`merged_lora_state`) instead of a PEFT adapter folder. A LoRA critic is
            written merged only.
    Returns:
        ``out_dir`` as a Path.
    Raises:
        FileNotFoundError / ValueError: see :func:`yatt.checkpoint.files.resolve`, :func:`read_meta`,
            :func:`hf_state_dict`; no ``config.json`` in the model path; a model file that does
            not verify (:func:`yatt.checkpoint.files.verify`: size or CRC-32 differs, missing).
        FileExistsError: ``out_dir`` is a non-empty directory (without ``overwrite``) or a file.
        PermissionError: ``out_dir`` lies under a file or cannot be written (checked before any weight is read).
    """
    if role not in ("actor", "critic"):
        raise ValueError(f"role must be 'actor' or 'critic', not {role!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if problem := writable_dir(out, "OUT_DIR", option=True):  # before any weight is read
        raise PermissionError(problem)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty (pass --overwrite to replace it)")
    step = files.resolve(checkpoint)
    damaged = files.verify(step, under="model/")
    if damaged:
        raise ValueError(f"checkpoint {step} does not verify: {'; '.join(damaged)}")
    meta = read_meta(step)
    path_key = {"actor": "model_path", "critic": "critic_model_path"}[role]  # the base folder of the role's model
    if role == "actor" and meta.get("config", {}).get("stage") == "rm":
        raise ValueError(f"checkpoint {step} is a reward model's (stage rm trains no policy): export it with --role critic")
    if path_key not in meta:
        raise ValueError(f"checkpoint {step} has no {role} (meta.json: no {path_key})")
    base = Path(model_path if model_path is not None else meta[path_key])
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in the base model folder {base} (use --model-path)")
    hf_config = json.loads((base / "config.json").read_text())
    settings = lora_settings(meta, role)
    if settings is None and merge:
        raise ValueError(f"--merge: checkpoint {step} holds no LoRA adapters (its {role} was trained whole)")
    if settings is not None and role == "critic" and not merge:
        raise ValueError(f"checkpoint {step} holds a LoRA critic: export it merged (--merge)")
    if settings is None or merge:
        state = full_state_dict(step, meta, hf_config, base, role)
    else:
        state = lora_state(step, meta, hf_config, role)[0]
    if role == "critic":
        hf_config = critic_config(hf_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        if settings is not None and not merge:
            _write_adapter(tmp, state, settings, base)
        else:
            _write_folder(tmp, state, hf_config, meta["dtype"], base, max_shard_size)
        del state
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # safetensors writes 0600, mkdtemp makes 0700: use the umask like any file
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        old = None
        if out.is_dir() and any(out.iterdir()):  # overwrite: move the old folder aside, swap, delete it
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        elif out.is_dir():
            out.rmdir()
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None:  # put the old folder back
                os.replace(old / out.name, out)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0, or 2 with a message on stderr)."""
    parser = argparse.ArgumentParser(prog="python -m yatt.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="step directory (step_000012) or checkpoint root with a latest file")
    parser.add_argument("out_dir", help="HF folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    parser.add_argument("--model-path", default=None, help="base model folder instead of meta.json's model_path")
    parser.add_argument("--role", default="actor", choices=("actor", "critic"),
                        help="actor: the policy (a causal LM); critic: PPO's value model (sequence classification)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA checkpoint: write the base model with the adapters merged in, not a PEFT adapter folder")
    args = parser.parse_args(argv)
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, args.overwrite, max_shard_size=size,
                                model_path=args.model_path, role=args.role, merge=args.merge)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        print(f"yatt.export: {e}", file=sys.stderr)
        return 2
    print(f"yatt.export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
