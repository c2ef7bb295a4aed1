"""Rollout: per-rank vLLM engines (see ``vllm_engine``).

Importing this package sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine).
"""
from yatt.rollout.vllm_engine import Completion, SamplingSpec, VLLMEngine

__all__ = ["Completion", "SamplingSpec", "VLLMEngine"]
