"""The critic on Megatron-Core: PPO's value model, the policy's architecture with a scalar value
head (:class:`yatt.trainer.model.ValueHead`) in place of the LM head.

It shares everything else with :class:`~yatt.trainer.actor.MegatronPolicy`: the same TP x PP x
DP layout on the same ranks, the gradient sum over DP ranks and micro-batches (the loss alone
normalises), its own Megatron optimizer and LR schedule, the stability guard's hook, and the
output layer running on response positions only.
"""
from __future__ import annotations

import torch

from yatt.trainer.actor import MegatronPolicy, _at_tokens


class MegatronCritic(MegatronPolicy):
    """A value model ``V(s_t)`` for every response token's state, loaded from an HF folder: a
    causal LM (the policy: the value head starts at zero, or drawn from N(0, ``head_init_std``^2)
    with ``head_seed``) or a sequence-classification model (its ``score.weight`` is the head).
    Other arguments and errors as :class:`MegatronPolicy`'s; :meth:`train_step`'s ``loss_fn`` is
    ``(values [B, T] fp32 with grad, mb) -> (loss 0-dim, stats {name: 0-dim tensor})``."""

    head = "value"

    def __init__(self, hf_path, *, head_init_std: float = 0.0, head_seed: int = 0, **kwargs):
        self.head_init = (head_init_std, head_seed)
        super().__init__(hf_path, **kwargs)

    def _loss(self, loss_fn, mb: dict, select, out: torch.Tensor):
        # out: [1, N, 1] at the selected predicting positions
        values = _at_tokens(out[0, :, 0], mb["input_ids"], select)
        loss, stats = loss_fn(values, mb)
        return loss, torch.zeros((), dtype=torch.int), stats

    def compute_values(self, micro_batches: list[dict]) -> list[torch.Tensor]:
        """The critic's values, without grad.

        Args:
            micro_batches: dicts with ``input_ids`` [B, T] int64 (right-padded) and optionally
                ``response_mask`` [B, T] (then only response tokens are valued; 0 elsewhere).
        Returns:
            One ``values`` [B, T] fp32 per micro-batch, identical on all TP ranks and pipeline
            stages: ``values[:, t]`` is ``V(ids[:, :t])``, the value of the state in which
            token ``t`` is generated (aligned like :meth:`MegatronPolicy.compute_logprobs`).
        """
        def keep(values, mb):
            return values.new_zeros(()), {"values": values}

        return [o["values"] for o in self._forward_only(micro_batches, keep, ("values",))]
