"""The critic on Megatron-Core: PPO's value model, the policy's architecture with a scalar value
head (:class:`yatt.trainer.model.ValueHead`) in place of the LM head.

It shares everything else with :class:`~yatt.trainer.actor.MegatronPolicy`: the same TP x PP x
DP layout on the same ranks, the gradient sum over DP ranks and micro-batches (the loss alone
normalises), its own Megatron optimizer and LR schedule, the stability guard's hook, and the
output layer running on response positions only.
"""
from __future__ import annotations

import torch

from yatt.trainer.actor import MegatronPolicy, _shift_right


class MegatronCritic(MegatronPolicy):
    """A value model ``V(s_t)`` for every response token's state, loaded from an HF folder: a
    causal LM (the policy: the value head starts at zero) or a sequence-classification model
    (its ``score.weight`` is the head). Arguments and errors as :class:`MegatronPolicy`'s;
    :meth:`train_step`'s ``loss_fn`` is ``(values [B, T] fp32 with grad, mb) -> (loss 0-dim,
    stats {name: 0-dim tensor})``."""

    head = "value"

    def _loss(self, loss_fn, mb: dict, select, out: torch.Tensor):
        values = self._values(out, mb, select)
        loss, stats = loss_fn(values, mb)
        return loss, torch.zeros((), dtype=torch.int), stats

    @staticmethod
    def _values(out: torch.Tensor, mb: dict, select) -> torch.Tensor:
        """Head outputs -> values ``[B, T]`` fp32 at the tokens whose state they value (0 elsewhere)."""
        ids = mb["input_ids"]
        if select is None:  # out [B, T, 1] at the predicting position
            return _shift_right(out[..., 0].float())
        rows, cols = select  # out [1, N, 1]: the state before the token at cols + 1
        return ids.new_zeros(ids.shape, dtype=torch.float32).index_put((rows, cols + 1), out[0, :, 0].float())

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
