"""The policy on Megatron-Core: teacher-forced logprobs, a training step, HF weight export.

One :class:`MegatronPolicy` per role (actor with an optimizer, frozen reference without) on
every rank. World = TP x DP (pipeline size 1). Gradients of one :meth:`MegatronPolicy.train_step`
are the plain SUM over DP ranks and micro-batches of the caller's loss: Megatron's
``1/num_microbatches`` and ``1/DP`` scalings are switched off (``calculate_per_token_loss=True``
with a gradient finaliser that does not divide by the token count), so the loss function alone
decides the normalisation.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from yatt.dist import mpi_comm
from yatt.trainer import megatron_cpu, packing
from yatt.trainer.grad_sum import SharedGradSum
from yatt.trainer.hf_mapping import global_param_name, stage_layers
from yatt.trainer.lora import LoraSpec, adapted_layers, add_adapters, is_adapter, merged_weight
from yatt.trainer.model import build_gpt_model

_PADDED_LOGIT = -1e30  # logit of vocab padding rows: exp() underflows to exactly 0


@dataclass
class OptimConfig:
    """AdamW (Megatron optimizer) with linear warmup then cosine decay to ``min_lr``.

    Step k (0-based) runs at Megatron's ``OptimizerParamScheduler`` value for k: with warmup
    the first step has lr 0, like Megatron and HF schedules.
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 1


_DOT_CHUNK = 128  # elements per partial dot product of _row_dot


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` without the product's temporary: batched dot products over chunks of
    128 elements, then a sum of the partials (one dot over a 49k vocabulary row in fp32 loses
    ~4e-5 relative to rounding; chunks keep it at the plain sum's ~2e-7). Measured 2026-12-03 on
    the 2-core dev machine, 1000 x 49152 fp32, one thread: 40 ms against 178 ms."""
    n = a.shape[-1]
    if n % _DOT_CHUNK:
        return (a * b).sum(-1)
    parts = torch.bmm(a.reshape(-1, 1, _DOT_CHUNK), b.reshape(-1, _DOT_CHUNK, 1))
    return parts.view(*a.shape[:-1], n // _DOT_CHUNK).sum(-1)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Log-probability of the targets and entropy of logits split over the TP vocab shards, in
    one pass over the logits: max, ``exp``, the sums ``Z = sum_i e_i`` and ``sum_i e_i z_i``
    (:func:`_row_dot`, no temporary); over the TP group one all-reduce of the max and one of
    the three sums (``Z``, ``sum_i e_i z_i`` and the target's logit, which one shard holds).

    ``log p_t = z_t - log Z``, ``H = log Z - sum_i p_i z_i`` (logits shifted by their max).
    Gradients: ``d log p_t / dz_i = 1[i = t] - p_i`` (as ``vocab_parallel_cross_entropy``) and
    ``dH/dz_i = -p_i (log p_i + H)`` (from ``dH/dz_i = p_i (E_p[z] - z_i)``), both from this
    shard's ``p`` and the global ``H``: no communication in the backward pass. Saves ``p`` (the
    size of the logits shard) and writes the backward's gradient into it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, group):
        z = logits.detach()
        z -= _all_reduce(z.amax(-1, keepdim=True), dist.ReduceOp.MAX, group)
        local = targets - start
        here = (local >= 0) & (local < z.shape[-1])
        local = local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)
        target_z = z.gather(-1, local).squeeze(-1).masked_fill_(~here, 0.0)
        exp = z.exp()
        sums = torch.stack([exp.sum(-1), _row_dot(exp, z), target_z])
        sum_exp, dot, target_z = _all_reduce(sums, dist.ReduceOp.SUM, group)
        log_z = sum_exp.log()
        entropy = log_z - dot / sum_exp
        p = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(p, local, here, entropy)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return target_z - log_z, entropy

    @staticmethod
    def backward(ctx, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None):
        p, local, here, entropy = ctx.saved_tensors
        grad = None
        if grad_entropy is not None:  # -g_H p (log p + H), before p is overwritten
            grad = torch.special.xlogy(p, p).add_(p * entropy.unsqueeze(-1)).mul_(-grad_entropy.unsqueeze(-1))
        if grad_logprob is not None:  # g (1[i = t] - p), written into p
            from_logprob = p.mul_(-grad_logprob.unsqueeze(-1))
            from_logprob.scatter_add_(-1, local, (grad_logprob * here).unsqueeze(-1))
            grad = from_logprob if grad is None else grad.add_(from_logprob)
        return grad, None, None, None


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` and entropy from logits split over the TP vocab shards.

    Args:
        logits: [B, T, Vp/tp] this TP rank's slice of the vocabulary (rank r holds ids
            ``[r*Vp/tp, (r+1)*Vp/tp)``), any float dtype. Consumed when fp32: the max is
            subtracted from it in place.
        targets: [B, T] int64 token ids (< vocab_size).
        vocab_size: true vocab size V; ids in ``[V, Vp)`` are padding and get probability 0.
        entropy_grad: the entropy carries a gradient (an entropy bonus).
    Returns:
        (logprobs [B, T] fp32, differentiable w.r.t. ``logits``; entropy [B, T] fp32, no grad
        unless ``entropy_grad``),
        both at the position of the logits (``logits[:, t]`` scores ``targets[:, t]``).
        Identical on every TP rank; full logits are never gathered.
    Source: Megatron-Core's ``vocab_parallel_cross_entropy`` (max / sum all-reduces over the TP
    group, the softmax saved for the backward), extended with the entropy's sum in the same pass
    (:class:`_VocabParallelLogprobEntropy`). On CUDA the same function runs as Triton kernels
    (:func:`yatt.trainer.fused.logprob.logprobs_entropy`: one read of the logits in their own
    dtype forward, the gradient written over them backward, the max and sums kept per row).
    """
    from megatron.core import parallel_state

    from yatt.trainer.fused import logprob as fused

    group = parallel_state.get_tensor_model_parallel_group()
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if fused.supported(logits):  # CUDA: one pass over the logits as they are, no fp32 copy
        return fused.logprobs_entropy(logits, targets, start, vocab_size, group, entropy_grad)
    logits = logits.float()
    if start + local > vocab_size:
        padded = torch.arange(start, start + local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, _PADDED_LOGIT)
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(logits, targets, start, group)
    if not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return logprobs, entropy


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scored_positions(mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) pairs whose next token is scored: a response token (``response_mask``), or
    without a mask every token after the first. The output layer runs on these alone, on a
    ``[1, N, H]`` selection of the hidden states (no ``[B, T, V]`` logits to transpose)."""
    mask = mb.get("response_mask")
    ids = mb["input_ids"]
    scored = mask[:, 1:] > 0 if mask is not None else torch.ones_like(ids[:, 1:], dtype=torch.bool)
    return torch.nonzero(scored, as_tuple=True)


def _select_hidden(index, module, args, kwargs):
    """Output-layer pre-hook: keep the hidden states [S, B, H] at ``index`` (long [N], positions of
    the flattened ``[S * B]``) only -> [N, 1, H]. An ``index_select``: its backward is an
    ``index_add_``, not advanced indexing's sort-based accumulation (slow on CUDA)."""
    return (args[0].flatten(0, 1).index_select(0, index).unsqueeze(1), *args[1:]), kwargs


def init_parallel_state(tp: int, pp: int = 1) -> None:
    """Megatron ``parallel_state`` with TP=tp, PP=pp over the world (collective: every rank
    calls it, also ranks that never build a model); a no-op when it already has these sizes.

    Raises:
        ValueError: it exists with another TP or PP.
    """
    from megatron.core import parallel_state

    megatron_cpu.apply()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        return
    have = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
    if have != (tp, pp):
        raise ValueError(f"Megatron parallel_state already has TP={have[0]}, PP={have[1]}, asked for TP={tp}, PP={pp}")


@contextlib.contextmanager
def _world_is(group):
    """Within the block, torch.distributed's default-group ``get_world_size`` and
    ``all_gather_object`` act on ``group`` (None: unchanged). Megatron-Core 0.16.1's optimizer
    setup all-gathers parameter-group keys over the whole world; with ranks that never train
    (``placement.mode=disaggregated``) that gather must stay among the trainers."""
    if group is None:
        yield
        return
    size, gather, sub = dist.get_world_size, dist.all_gather_object, group

    def get_world_size(group=None):
        return size(sub if group is None else group)

    def all_gather_object(object_list, obj, group=None):
        return gather(object_list, obj, group=sub if group is None else group)

    dist.get_world_size, dist.all_gather_object = get_world_size, all_gather_object
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = size, gather


def _all_reduce_grad_buffers(model_chunks, group) -> None:
    for chunk in model_chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            dist.all_reduce(buffer.grad_data, group=group)


def _last_stage() -> tuple[int, object]:
    """(global rank of the last stage of this rank's pipeline, the pipeline group): the source
    and group of a broadcast of the results that only the last stage computes."""
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_last_rank(), parallel_state.get_pipeline_model_parallel_group()


def _runs_packed(mb: dict) -> bool:
    """The model body runs the micro-batch's packed rows: it has them, and scored positions to
    gather back (``response_mask``)."""
    return "packed_ids" in mb and "response_mask" in mb


def _body_ids(mb: dict) -> torch.Tensor:
    """The token rows the model body runs for a micro-batch: packed (:func:`_runs_packed`) or padded."""
    return mb["packed_ids"] if _runs_packed(mb) else mb["input_ids"]


def _at_tokens(x: torch.Tensor, ids: torch.Tensor, select) -> torch.Tensor:
    """Scores at the predicting positions -> fp32 ``[B, T]`` at the tokens they score (0 elsewhere):
    ``x`` is ``[N]`` over the ``select``ed (row, position) pairs (:func:`_scored_positions`), whose
    next token it scores."""
    rows, cols = select
    return ids.new_zeros(ids.shape, dtype=torch.float32).index_put((rows, cols + 1), x.float())


def _fuse_adam(optimizer) -> None:
    """Switch the torch AdamW that Megatron-Core builds without Apex/Transformer Engine to torch's
    fused kernel (``fused=True``: one pass over each tensor, no temporaries), CPU and CUDA alike.
    Megatron-Core passes no ``fused``/``foreach``, so on CPU torch runs its per-tensor loop, which
    allocates two parameter-sized temporaries per tensor: measured 2026-12-01 on the 2-core dev
    machine, one AdamW step over 130M fp32 parameters (one thread) took 0.10-0.14 s fused against
    0.46-0.54 s. The update is AdamW's either way (to rounding); the flag is saved in the
    optimizer's state dict, so a resumed run keeps the kernel it was saved with."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if type(inner) in (torch.optim.AdamW, torch.optim.Adam) and all(
                p.is_floating_point() for g in inner.param_groups for p in g["params"]):
            inner.defaults.update(fused=True, foreach=None)
            for group in inner.param_groups:
                group.update(fused=True, foreach=None)


class MegatronPolicy:
    """A causal LM on Megatron-Core, loaded from an HF folder, on every rank of the job.

    Args:
        hf_path: HF folder (Llama / Qwen2, safetensors).
        tp: tensor-parallel size.
        pp: pipeline-parallel size (stages of ``num_layers / pp`` layers); DP = world / (tp pp).
            Initialises Megatron ``parallel_state`` (TP=tp, PP=pp) unless already initialised
            with the same sizes. Every stage returns the same results (the last stage's,
            broadcast over the pipeline).
        optim: None for a frozen model (reference policy: no grads, no optimizer).
        dtype: parameter dtype, fp32 or bf16 (bf16 trains with fp32 main params and grads).
        dp_group: process group whose ranks train together (gradients summed over it); None =
            Megatron's data-parallel group (every rank trains). A subgroup is for layouts where
            some ranks never train (``placement.mode=disaggregated``); it needs ``tp == pp == 1``.
        recompute: keep only each transformer layer's input in the forward pass and recompute the
            layer in the backward pass (Megatron-Core's full recompute, one layer per checkpoint;
            Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): activation memory
            of about one layer instead of all, for one more forward pass of compute. Same update.
        overlap_grad_reduce: reduce the gradients over DP ranks bucket by bucket while the last
            micro-batch's backward pass still runs (Megatron-Core's DDP buckets), as Megatron runs
            on GPUs; None: on CUDA with DP > 1 over the whole DP group. Otherwise they are summed
            after the backward pass (on CPU through shared memory, :mod:`yatt.trainer.grad_sum`).
            The same update either way.
        lora: train LoRA adapters on the frozen model (:mod:`yatt.trainer.lora`) instead of all
            of it: only the adapters (and a value head) get gradients and optimizer state, the
            weight sync and :meth:`export_hf_weights` give the merged weights, and
            :meth:`model_state_dict` holds the adapters only. None: full fine-tuning.
    Raises:
        RuntimeError: torch.distributed is not initialised (call ``yatt.dist.init_distributed``).
        ValueError: parallel_state exists with another TP / PP, world not divisible by tp pp,
            pp not dividing the layers, fp16, ``optim.warmup_steps >= optim.total_steps``, or
            ``dp_group`` with ``tp > 1`` or ``pp > 1``.
    Side effects: installs :mod:`yatt.trainer.megatron_cpu` on CPU; sets up Megatron's RNG
    tracker (seed 1234) without disturbing the global torch RNG.
    """

    head = "lm"  # the output layer (yatt.trainer.model.build_gpt_model); the critic's is "value"
    head_init = (0.0, 0)  # the value head's (std, seed) without an HF score head (MegatronCritic)

    def __init__(self, hf_path: str | Path, *, tp: int = 1, pp: int = 1, optim: OptimConfig | None = None,
                 dtype: torch.dtype = torch.float32, dp_group=None, recompute: bool = False,
                 overlap_grad_reduce: bool | None = None, lora: LoraSpec | None = None):
        megatron_cpu.apply()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call yatt.dist.init_distributed() first")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype {dtype} not supported (fp32 or bf16)")
        if dist.get_world_size() % (tp * pp):
            raise ValueError(f"world size {dist.get_world_size()} is not a multiple of TP*PP={tp * pp}")
        if dp_group is not None and tp * pp != 1:
            raise ValueError("a custom dp_group needs tp=1 and pp=1")
        init_parallel_state(tp, pp)
        with torch.random.fork_rng(devices=[]):
            model_parallel_cuda_manual_seed(1234)
        self.dp_group = dp_group
        self.tp, self.pp = tp, pp
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.last_stage = self.stage == pp - 1
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else parallel_state.get_data_parallel_world_size()
        self.optim = optim
        overlap = torch.cuda.is_available() if overlap_grad_reduce is None else overlap_grad_reduce
        self.overlap_grad_reduce = overlap and dp_group is None and self.dp > 1
        # full recompute: a layer's activations are recomputed in the backward pass from its input, kept per layer
        recompute_args = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.model, self.layout = build_gpt_model(hf_path, dtype=dtype, head=self.head, head_init_std=self.head_init[0],
                                                  head_seed=self.head_init[1], calculate_per_token_loss=True,
                                                  **(recompute_args if recompute else {}))
        self.config = self.model.config
        self._device = next(self.model.parameters()).device
        self.lora = lora
        if lora is not None:
            first = stage_layers(self.layout, pp, self.stage).start
            add_adapters(self.model, lora, tp=tp, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                         first_layer=first)
            if self.head == "value" and self.last_stage:  # a new head: trained whole
                self.model.output_layer.requires_grad_(True)
        self.module = self.model  # the bare GPTModel (this TP rank's shard of its stage), under any wrappers
        self._model_kwargs = {}
        if dtype == torch.bfloat16:
            from megatron.core.transformer.module import Float16Module

            self.model = Float16Module(self.config, self.model)
            # the head's output stays bf16: the logprob kernels read it as it is (an fp32 copy of
            # [tokens, vocab] logits is the step's largest tensor)
            self._model_kwargs = {"fp32_output": False}
        self.optimizer = self.scheduler = self.grad_sum = None
        self._syncs: dict = {}  # (bucket size, i, j) -> BucketedSync (live parameter references, no copies)
        if optim is None:
            self.model.requires_grad_(False)
            self.model.eval()
        else:
            self._setup_training(optim, dtype)

    def _setup_training(self, optim: OptimConfig, dtype: torch.dtype) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if not 0 <= optim.warmup_steps < optim.total_steps:
            raise ValueError(f"need 0 <= warmup_steps < total_steps, got {optim.warmup_steps}, {optim.total_steps}")
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False,
                                                   overlap_grad_reduce=self.overlap_grad_reduce)
        self.model = DistributedDataParallel(self.config, ddp_config, self.model)
        if self.overlap_grad_reduce:  # buckets wait for the last micro-batch's gradients
            self.config.no_sync_func = self.model.no_sync
        # Sum, not mean: finalise grads (DP all-reduce) without dividing by the token count.
        if self.dp_group is None:
            self.config.finalize_model_grads_func = (
                lambda model, num_tokens=None, **kw: finalize_model_grads(model, None, **kw))
        else:  # TP=1, PP=1: the DP sum of the grad buffers is all that finalising does
            self.config.finalize_model_grads_func = (
                lambda model, num_tokens=None, **kw: _all_reduce_grad_buffers(model, self.dp_group))
        if self.tp * self.pp == 1 and self.dp > 1 and not self.overlap_grad_reduce:  # one machine: shared memory
            ranks = dist.get_process_group_ranks(self.dp_group) if self.dp_group is not None else list(
                range(dist.get_world_size()))
            self.grad_sum = SharedGradSum.build([self.model], mpi_comm(ranks))
            if self.grad_sum is not None:
                self.config.finalize_model_grads_func = self.grad_sum
        with _world_is(self.dp_group):
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype), [self.model])
        _fuse_adam(self.optimizer)
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps, lr_decay_steps=optim.total_steps, lr_decay_style="cosine",
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=optim.total_steps,
            wd_incr_style="constant")

    # ---- forward -------------------------------------------------------------------------
    def _on_device(self, mb: dict) -> dict:
        """A micro-batch ready for the forward step, on the model's device: its tensors, the scored
        (row, position) pairs (``"_select"``), where the output layer reads them (``"_hidden_index"``,
        positions in the body's flattened ``[S * B]`` hidden states) and the packed row's attention
        plan (``"_plan"``). Every index is computed on the host before the copy, so the step itself
        makes no host round trip per micro-batch or layer."""
        from yatt.trainer.attention import DocumentAttention

        rows, cols = select = _scored_positions(mb)
        out = {"_hidden_index": (mb["packed_index"][rows, cols] if _runs_packed(mb)
                                 else cols * mb["input_ids"].shape[0] + rows)}
        if "packed_max_lens" in mb:  # ints for the attention kernel, read here rather than on the device
            out["packed_max_lens"] = tuple(int(x) for x in mb["packed_max_lens"].tolist())
        device = self._device
        out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
               for k, v in {**mb, **out}.items()}
        out["_select"] = tuple(x.to(device, non_blocking=True) for x in select)
        if _runs_packed(out):
            out["_plan"] = DocumentAttention.of(out)
        return out

    def _forward_step(self, loss_fn, data_iterator, model):
        mb = next(data_iterator)  # prepared by _on_device
        ids, select = mb["input_ids"], mb["_select"]
        hooks = []
        if _runs_packed(mb):  # the body runs one packed row (yatt.trainer.packing)
            ids, position_ids, plan = mb["packed_ids"], mb["packed_positions"], mb["_plan"]
            hooks.append(self.module.rotary_pos_emb.register_forward_hook(packing.rope_at_positions(position_ids)))
        else:
            position_ids, plan = torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None
        if self.last_stage:  # the output layer runs on scored positions only
            hooks.append(self.module.output_layer.register_forward_pre_hook(
                partial(_select_hidden, mb["_hidden_index"]), with_kwargs=True))
        try:
            # last stage: logits [1, N, Vp/tp] at the scored positions, in the parameter dtype;
            # other stages: hidden states for the next stage (input_ids are read by the first stage only)
            logits = model(ids, position_ids, None, packed_seq_params=plan, **self._model_kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        return logits, partial(self._loss, loss_fn, mb, select)

    def _loss(self, loss_fn, mb: dict, select, logits: torch.Tensor):
        ids = mb["input_ids"]
        entropy_grad = getattr(loss_fn, "entropy_grad", False)  # an entropy bonus in the loss
        rows, cols = select  # logits at position t score the token at t + 1
        logprobs, entropy = (x[0] for x in vocab_parallel_logprobs_entropy(
            logits, ids[rows, cols + 1].unsqueeze(0), self.layout.vocab_size, entropy_grad))
        logprobs, entropy = _at_tokens(logprobs, ids, select), _at_tokens(entropy, ids, select)
        loss, stats = loss_fn(logprobs, entropy, mb)
        # (loss, num_tokens, reported): 3 outputs + calculate_per_token_loss -> no rescaling.
        return loss, torch.zeros((), dtype=torch.int), stats

    def _run(self, micro_batches: list[dict], loss_fn, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro_batches = [self._on_device(mb) for mb in micro_batches]  # all copies before any compute
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(micro_batches),
            model=[self.model], num_microbatches=len(micro_batches),
            seq_length=max(_body_ids(mb).shape[1] for mb in micro_batches),
            micro_batch_size=max(_body_ids(mb).shape[0] for mb in micro_batches),
            forward_only=forward_only)

    def compute_logprobs(self, micro_batches: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Teacher-forced logprobs and entropies, without grad.

        Args:
            micro_batches: dicts with ``input_ids`` [B, T] int64 (right-padded, causal,
                positions 0..T-1) and optionally ``response_mask`` [B, T]: then only the
                masked tokens are scored (the output layer runs on those positions alone) and
                every other position is 0. With ``response_mask``, micro-batches that carry
                :func:`yatt.trainer.packing.pack_rows`' ``packed_*`` tensors run the model body on
                those packed rows instead of the padded ones (same results to fp32 rounding).
                Other keys are ignored.
        Returns:
            One (logprobs [B, T] fp32, entropy [B, T] fp32) per micro-batch, on the model's
            device, identical on all TP ranks and pipeline stages. For t >= 1
            ``logprobs[:, t] = log p(ids[:, t] | ids[:, :t])`` and ``entropy[:, t]`` is the
            entropy of that predictive distribution; both are 0 at t = 0.
        """
        def keep(logprobs, entropy, mb):
            return logprobs.new_zeros(()), {"logprobs": logprobs, "entropy": entropy}

        return [(o["logprobs"], o["entropy"]) for o in self._forward_only(micro_batches, keep, ("logprobs", "entropy"))]

    def _forward_only(self, micro_batches: list[dict], keep: Callable, names: tuple[str, ...]) -> list[dict]:
        """``keep``'s ``[B, T]`` outputs ``names`` per micro-batch, in eval mode and without grad,
        on every pipeline stage (the last stage's, broadcast over the pipeline)."""
        if not micro_batches:
            return []
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self._run(micro_batches, keep, forward_only=True)
        finally:
            self.model.train(training)
        if self.pp == 1:
            return out
        shapes = [mb["input_ids"].shape for mb in micro_batches]
        flat = (torch.cat([o[n].reshape(-1).float() for o in out for n in names]) if self.last_stage
                else torch.empty(len(names) * sum(s.numel() for s in shapes), device=self._device))
        dist.broadcast(flat, *_last_stage())
        parts = iter(flat.split([s.numel() for s in shapes for _ in names]))
        return [{n: next(parts).view(s) for n in names} for s in shapes]

    # ---- training ------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], loss_fn: Callable,
                   skip_update: Callable[[float], bool] | None = None) -> dict:
        """One optimizer step on the sum of ``loss_fn`` over micro-batches and DP ranks.

        Args:
            micro_batches: this DP rank's micro-batches (same on every TP rank and pipeline stage),
                each a dict with ``input_ids`` [B, T] int64 plus whatever ``loss_fn`` reads; none:
                this rank adds a zero gradient and still takes part in the DP reduction and the
                optimizer step (Adam's moments move the weights even then).
            loss_fn: ``(logprobs [B, T] with grad, entropy [B, T] detached, mb) -> (loss 0-dim,
                stats {name: 0-dim tensor})``; logprobs/entropy as in :meth:`compute_logprobs`.
            skip_update: called with the pre-clip global grad norm (the same on every rank)
                before the update; True skips the update and the scheduler step (e.g. a
                :class:`~yatt.algos.guard.StabilityGuard`).
        Returns:
            ``{"grad_norm": pre-clip global grad norm, "lr": lr of this step, "update_skipped":
            0.0 or 1.0, **stats}`` as floats; each stat is summed over this rank's micro-batches
            (not reduced over DP).
        Raises:
            RuntimeError: the policy is frozen (``optim=None``).
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen MegatronPolicy (optim=None)")

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if micro_batches:
            out = self._run(micro_batches, loss_fn, forward_only=False)  # entropy has no grad
        else:  # the zeroed grads join the reduction the schedule would have finished
            if self.overlap_grad_reduce:
                self.model.start_grad_sync()  # no backward pass dispatched the buckets
            self.config.finalize_model_grads_func([self.model])
            out = []
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = False
        if skip_update is not None:
            self.optimizer.prepare_grads()  # main grads ready (step() repeats this, idempotently)
            grad_norm = float(self.optimizer.get_grad_norm())
            skipped = bool(skip_update(grad_norm))
        if not skipped:
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        stats = {"grad_norm": float(grad_norm), "lr": float(lr), "update_skipped": float(skipped)}
        names = sorted(out[0]) if out else []
        if self.pp > 1:  # the loss stats exist on the last stage only
            names = [names]
            dist.broadcast_object_list(names, *_last_stage())
            names = names[0]
        sums = torch.tensor([float(sum(o[n].detach().float() for o in out)) if out else 0.0 for n in names],
                            dtype=torch.float64, device=self._device)
        if self.pp > 1:
            dist.broadcast(sums, *_last_stage())
        stats.update(zip(names, sums.tolist()))
        return stats

    # ---- export --------------------------------------------------------------------------
    def export_hf_weights(self, bucket_bytes: int = 512 << 20,
                          shard: tuple[int, int] = (1, 0)) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) for every weight, in the parameter dtype, on every rank;
        with ``shard = (i, j)``, each tensor's part on inference TP rank ``j`` of ``i`` instead
        (:mod:`yatt.reshard.plan`'s target layout: a rollout engine of TP ``i``,
        ``VLLMEngine.shard``).

        Bucketed (:class:`yatt.reshard.BucketedSync`): ``bucket_bytes`` of HF tensors are
        gathered over TP and resharded by the copy kernel at a time, so a consumer that loads
        each tensor as it comes (``VLLMEngine.update_weights``) holds about one bucket extra.
        Collective over the TP group: all TP ranks must consume the iterator fully, in step.
        Tied embeddings give ``model.embed_tokens.weight`` only; vocab padding is stripped.
        The tensors are copies (they stay valid after the next optimizer step).
        """
        from megatron.core import parallel_state

        from yatt.reshard import BucketedSync  # not at module level: yatt.reshard imports yatt.trainer

        key = (bucket_bytes, *shard)
        if key not in self._syncs:  # compiled copy programs (shapes only) are reused
            tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
            pp_group = parallel_state.get_pipeline_model_parallel_group() if self.pp > 1 else None
            pp_ranks = dist.get_process_group_ranks(pp_group) if pp_group is not None else [dist.get_rank()]
            merged = {global_param_name(name, self.layout, self.pp, self.stage): partial(merged_weight, layer)
                      for name, layer in adapted_layers(self.module)}
            self._syncs[key] = BucketedSync(self.module, self.layout, tp_group=tp_group, pp=self.pp,
                                            stage=self.stage, pp_group=pp_group, pp_ranks=pp_ranks,
                                            bucket_bytes=bucket_bytes, i=shard[0], j=shard[1], merged=merged)
        return iter(self._syncs[key])

    # ---- checkpoint state ----------------------------------------------------------------
    def optimizer_param_names(self) -> list[list[list[str]]]:
        """The name (in this shard's GPTModel, stage-local) of every parameter the optimizer state
        refers to, in its order: per optimizer of a chained one, per param group, per index
        (a bf16 model's fp32 main parameters under the names of the parameters they copy). Saved
        beside the optimizer state so that it can be matched to parameters by name, not position.

        Raises:
            RuntimeError: the policy is frozen (no optimizer).
        """
        if self.optimizer is None:
            raise RuntimeError("optimizer_param_names of a frozen MegatronPolicy (optim=None)")
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = []
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            main_of = {id(main): model for models, mains in zip(getattr(opt, "float16_groups", []),
                                                                 getattr(opt, "fp32_from_float16_groups", []))
                       for model, main in zip(models, mains)}
            out.append([[names[id(main_of.get(id(p), p))] for p in group["params"]]
                        for group in opt.optimizer.param_groups])
        return out

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This shard's checkpointed model state: the GPTModel's ``state_dict()``, or with LoRA
        only the trained tensors (adapters, a critic's value head); the frozen base comes from
        the HF folder again at resume."""
        state = self.module.state_dict()
        if self.lora is None:
            return state
        return {n: t for n, t in state.items()
                if is_adapter(n) or (self.head == "value" and n == "output_layer.weight")}

    def load_model_state_dict(self, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Load what :meth:`model_state_dict` gave (``source`` names it in errors).

        Raises:
            ValueError: the names differ from this model's (e.g. a LoRA checkpoint into a full
                fine-tune or back: naming ``trainer.lora``).
        """
        if self.lora is None:
            if any(map(is_adapter, state)):
                raise ValueError(f"{source} holds LoRA adapters, and this job has no trainer.lora")
            self.module.load_state_dict(state)
            return
        want = set(self.model_state_dict())
        if set(state) != want:
            missing, extra = sorted(want - set(state))[:3], sorted(set(state) - want)[:3]
            raise ValueError(f"{source} does not hold this job's trainer.lora adapters "
                             f"(missing e.g. {missing}, unexpected e.g. {extra})")
        self.module.load_state_dict(state, strict=False)
