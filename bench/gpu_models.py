"""Model shapes of the GPU benchmarks: real models' configurations with random weights (no hub).

``SHAPES`` holds the HF ``config.json`` fields of SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B;
``TINY`` the sizes that replace a shape's in the CPU dry runs (2 layers, hidden 64). :func:`hf_model`
builds one in transformers, :func:`save_random_hf` writes one as an HF folder (safetensors) that
:class:`yatt.trainer.actor.MegatronPolicy` loads.
"""
from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=4096)


def hf_config(cfg: dict):
    """The transformers config of a shape (rope in transformers 5's ``rope_parameters``)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "rope_theta")}
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    return AutoConfig.for_model(cfg["model_type"], rope_parameters=rope, use_cache=False, **fields)


def hf_model(cfg: dict, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
    """A transformers causal LM of ``cfg`` (sdpa attention) with random weights, on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa", dtype=dtype).eval()


def save_random_hf(cfg: dict, folder: Path, dtype: torch.dtype) -> Path:
    """Write a fresh random model of ``cfg`` (built on the GPU when there is one) to ``folder`` as an
    HF folder; returns ``folder``."""
    model = hf_model(cfg, dtype, "cuda" if torch.cuda.is_available() else "cpu")
    model.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder
