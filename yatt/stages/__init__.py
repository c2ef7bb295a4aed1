"""The RLHF stages besides RL (``stage`` in the config): each is the same SPMD run (launch, data
shards, DP balancing, checkpoints, evals, export) with another objective, called by
:mod:`yatt.loop`'s step."""
