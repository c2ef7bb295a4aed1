"""Trainer role: the policy on Megatron-Core (TP x DP), HF weight mapping, CPU compatibility.

Modules: ``actor`` (MegatronPolicy, OptimConfig), ``model`` (GPTModel from an HF folder),
``hf_mapping`` (config and weights, both ways), ``megatron_cpu`` (Megatron-Core 0.16.1 on CPU).
"""
from yatt.trainer.actor import MegatronPolicy, OptimConfig

__all__ = ["MegatronPolicy", "OptimConfig"]
