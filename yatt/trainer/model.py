"""Build a Megatron-Core GPTModel from a Hugging Face folder (Llama / Qwen2) and load its weights.

Megatron's ``parallel_state`` must be initialised first: the model is built for this process's
TP rank and pipeline stage (stage ``s`` of ``pp`` holds layers ``stage_layers(layout, pp, s)``
under stage-local indices, the first stage the embedding, the last the final norm and output
layer; with tied embeddings the last stage's output layer starts as a copy of the embedding).
Layers use the local spec (``get_gpt_layer_local_spec``, no Transformer Engine) so the model also
runs on CPU (see :mod:`yatt.trainer.megatron_cpu`), with its core attention computed by torch's
fused kernel (:mod:`yatt.trainer.attention`). On CUDA the MLP's SwiGLU and the rotary embedding run
YATT's fused Triton kernels (:mod:`yatt.trainer.fused`) in place of Megatron's unfused torch code
(one pass over the activations instead of four to seven); the CPU keeps Megatron's.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from yatt.trainer.hf_mapping import (Layout, gpt_model_kwargs, hf_to_megatron, layout_from_hf, stage_layers,
                                     transformer_config)


def read_hf_config(hf_path: str | Path) -> dict:
    """The ``config.json`` of an HF folder as a dict."""
    return json.loads((Path(hf_path) / "config.json").read_text())


class SafetensorsState(Mapping):
    """Read-only, lazy ``name -> tensor`` view of an HF folder's safetensors files.

    Handles a single ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
    Each access reads the tensor from disk (CPU, stored dtype).

    Raises:
        FileNotFoundError: the folder has no safetensors weights.
    """

    def __init__(self, hf_path: str | Path):
        root = Path(hf_path)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: root / f for name, f in weight_map.items()}
        elif (root / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(root / "model.safetensors", framework="pt") as f:
                self._files = {name: root / "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors(.index.json) in {root}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _stage_name(name: str, layout: Layout, pp: int, stage: int, head: str = "lm") -> list[str]:
    """Names that Megatron parameter ``name`` (global layer index) has on ``stage`` (may be []);
    with ``head="value"`` the last stage holds no copy of tied embeddings (no LM head)."""
    if name.startswith("decoder.layers."):
        k, rest = name[len("decoder.layers."):].split(".", 1)
        layers = stage_layers(layout, pp, stage)
        return [f"decoder.layers.{int(k) - layers.start}.{rest}"] if int(k) in layers else []
    last = stage == pp - 1
    if name == "embedding.word_embeddings.weight":
        tied_copy = ["output_layer.weight"] if layout.tied_embeddings and pp > 1 and last and head == "lm" else []
        return (["embedding.word_embeddings.weight"] if stage == 0 else []) + tied_copy
    return [name] if last else []


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_state: Mapping[str, torch.Tensor], layout: Layout,
                    tp_rank: int, pp: int = 1, stage: int = 0, head: str = "lm",
                    head_init_std: float = 0.0, head_seed: int = 0) -> None:
    """Copy HF weights into a bare GPTModel (this TP rank's shards of this pipeline stage),
    casting to the param dtype. With ``head="value"`` the last stage's :class:`ValueHead` takes
    the HF folder's ``score.weight`` ``[1, H]`` (a sequence-classification model's head: a critic
    or reward model); without one it starts at zero (``head_init_std`` 0: a critic initialised
    from a policy, every value 0, so its first advantages are the rewards') or drawn from
    N(0, ``head_init_std``^2) by a generator seeded with ``head_seed`` (the same on every rank: a
    reward model to train, whose body gets no gradient through a zero head); the LM head is not read.

    Raises:
        ValueError: a shape differs, or the model and the mapping disagree on parameter names.
    """
    params = dict(model.named_parameters())
    loaded = set()
    if head == "value" and "output_layer.weight" in params:
        shape = params["output_layer.weight"].shape
        score = (hf_state["score.weight"] if "score.weight" in hf_state
                 else torch.randn(shape, generator=torch.Generator().manual_seed(head_seed)) * head_init_std)
        params["output_layer.weight"].copy_(score.reshape(params["output_layer.weight"].shape))
        loaded.add("output_layer.weight")
    # the value head's model maps like a tied one: no lm_head is read (a critic folder has none)
    mapped = dataclasses.replace(layout, tied_embeddings=True) if head == "value" else layout
    for global_name, tensor in hf_to_megatron(hf_state, mapped, tp_rank):
        for name in _stage_name(global_name, layout, pp, stage, head):
            if name not in params:
                raise ValueError(f"mapping produced {name!r}, which the model does not have")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: model shape {tuple(params[name].shape)} != mapped {tuple(tensor.shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
    if missing := set(params) - loaded:
        raise ValueError(f"parameters not loaded from HF: {sorted(missing)}")


def _skip_init(weight: torch.Tensor) -> None:
    """No-op init method: every weight is overwritten by the checkpoint."""


class ValueHead(torch.nn.Module):
    """A scalar head in place of GPTModel's output layer (a critic's or reward model's):
    hidden states ``[S, B, H]`` -> ``([S, B, 1], None)``, the output layer's call signature.
    Its weight ``[1, H]`` (no bias, as HF's ``*ForSequenceClassification.score``) is replicated
    on every TP rank: the hidden states are whole there, so each computes the same values and
    gradients (no TP communication; Megatron counts a replicated parameter once in the grad norm)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden, self.weight), None


def fuse_elementwise() -> bool:
    """Whether models are built with the fused kernels of :func:`_fuse_elementwise`: on CUDA,
    unless the environment says ``YATT_FUSED=0``."""
    return torch.cuda.is_available() and os.environ.get("YATT_FUSED") != "0"


def _fuse_elementwise(spec, config_overrides: dict) -> None:
    """Point a local layer spec at YATT's fused CUDA kernels: the MLP's activation becomes
    :class:`yatt.trainer.fused.swiglu.SwiGLU` (through Megatron's ``use_te_activation_func`` hook,
    a module applied to the fc1 output ``[.., 2F]``), and Megatron's attention applies rotary
    embeddings through :func:`_rope` (installed once per process)."""
    from megatron.core.transformer import attention

    from yatt.trainer.fused.swiglu import SwiGLU

    spec.submodules.mlp.submodules.activation_func = SwiGLU
    config_overrides.setdefault("use_te_activation_func", True)
    if attention.apply_rotary_pos_emb is not _rope:
        global _megatron_rope
        _megatron_rope, attention.apply_rotary_pos_emb = attention.apply_rotary_pos_emb, _rope


_megatron_rope = None  # Megatron-Core's apply_rotary_pos_emb, which _rope falls back to


def _rope(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """Megatron-Core's ``apply_rotary_pos_emb`` (same arguments), through the fused kernel
    (:func:`yatt.trainer.fused.rope.apply_rope`) for the case YATT's models use: ``sbhd`` rows, the
    rotary dim the head dim, no interleaving, scale 1, a CUDA tensor; Megatron's own code else."""
    from yatt.trainer.fused import rope

    if (cu_seqlens is None and mscale == 1.0 and not config.rotary_interleaved and not config.apply_rope_fusion
            and not config.multi_latent_attention and freqs.shape[-1] == t.shape[-1] and rope.supported(t)):
        return rope.apply_rope(t, freqs)
    return _megatron_rope(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)


def build_gpt_model(hf_path: str | Path, *, dtype: torch.dtype = torch.float32, head: str = "lm",
                    head_init_std: float = 0.0, head_seed: int = 0, **config_overrides):
    """GPTModel for this TP rank and pipeline stage with the HF folder's weights loaded.

    Args:
        hf_path: HF folder with ``config.json`` and safetensors weights.
        dtype: parameter dtype (``params_dtype``).
        head: ``"lm"`` (the causal LM's output layer, logits ``[B, T, Vp/tp]``) or ``"value"``
            (a :class:`ValueHead` on the last stage, ``[B, T, 1]``; embeddings never tied to it;
            :func:`load_hf_weights` says where its weight comes from).
        head_init_std, head_seed: the value head's start without a ``score.weight`` (see
            :func:`load_hf_weights`; std 0: zeros).
        config_overrides: extra ``TransformerConfig`` fields (e.g. ``calculate_per_token_loss``).
    Returns:
        (model, layout): the bare ``GPTModel`` (train mode, on CPU or the current CUDA device)
        and its :class:`~yatt.trainer.hf_mapping.Layout`.
    Raises:
        RuntimeError: Megatron parallel_state is not initialised.
        NotImplementedError / ValueError: see :func:`~yatt.trainer.hf_mapping.layout_from_hf`
            and :func:`~yatt.trainer.hf_mapping.stage_layers`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("initialise Megatron parallel_state (initialize_model_parallel) first")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    hf = read_hf_config(hf_path)
    layout = layout_from_hf(hf, tp)
    # Megatron 0.16.1 sets the TP attributes of parameters (tensor_model_parallel, partition_dim,
    # read by grad-norm and clipping) only inside its init path: with perform_initialization=False
    # TP>1 grad norms are wrong. So initialisation runs, with no-op init methods (fast).
    config_overrides = dict(init_method=_skip_init, output_layer_init_method=_skip_init,
                            embedding_init_method=_skip_init, **config_overrides)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if fuse_elementwise():
        _fuse_elementwise(spec, config_overrides)
    config = transformer_config(hf, tp=tp, pp=pp, dtype=dtype, perform_initialization=True, **config_overrides)
    if head not in ("lm", "value"):
        raise ValueError(f"head must be 'lm' or 'value', not {head!r}")
    kwargs = gpt_model_kwargs(hf, tp)
    if head == "value":
        kwargs["share_embeddings_and_output_weights"] = False
    from yatt.trainer.attention import SdpaAttention

    spec.submodules.self_attention.submodules.core_attention = SdpaAttention  # same function, fused
    model = GPTModel(config, spec, **kwargs,
                     pre_process=stage == 0, post_process=stage == pp - 1)
    if head == "value" and stage == pp - 1:
        model.output_layer = ValueHead(layout.hidden_size, dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    load_hf_weights(model, SafetensorsState(hf_path), layout, parallel_state.get_tensor_model_parallel_rank(),
                    pp, stage, head, head_init_std, head_seed)
    return model, layout
