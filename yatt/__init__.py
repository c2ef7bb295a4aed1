"""YATT: pure-SPMD RL post-training for LLMs."""
