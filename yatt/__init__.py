"""YATT: pure-SPMD RL post-training for LLMs."""


def __getattr__(name: str):
    """``from yatt import Trainer`` without importing the heavy modules on ``import yatt``."""
    if name == "Trainer":
        from yatt.api import Trainer

        return Trainer
    raise AttributeError(f"module 'yatt' has no attribute {name!r}")
