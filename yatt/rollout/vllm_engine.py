"""Rollout engine: one in-process vLLM engine per rank (SPMD, each rank an independent engine).

Every rank builds its own engine after torch.distributed is up; vLLM joins the existing
process group through ``distributed_executor_backend="external_launcher"`` with its own data
parallel size 1, so engines never step in lockstep: ranks may run different models at the
same time (policy on sampler ranks, judge on GenRM ranks) and finish at different times.
Construction and ``shutdown`` are **collective** (vLLM creates and destroys process groups
over the whole world): every rank must build or shut down *some* engine of the same TP size
at the same point, or call :func:`join_engine_groups` there if it builds none. ``generate``/``generate_within``/``generate_stream``/``score`` are local.

Logprobs: the engine runs with vLLM's ``raw_logprobs`` mode, so ``Completion.logprobs`` holds
the log-softmax of the *unscaled* model logits at the sampled token (before temperature /
top-p). With ``temperature=1, top_p=1`` that is exactly the distribution vLLM sampled from,
and it is what a trainer's teacher-forced ``log_softmax(logits)`` should reproduce.
Pass ``logprobs_mode="processed_logprobs"`` to get the post-temperature/top-p value instead.
"""
from __future__ import annotations

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine; must precede vllm import

import contextlib
import gc
import itertools
import math
import random
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from yatt import logs
from yatt.preload import release_free_heap
from yatt.rollout.tp_group import EngineGroup, load_shards_on_worker

_SEED_STRIDE = 1_000_003  # per-DP-rank offset of request seeds
CPU_BLOCK_SIZE = 32  # tokens per KV-cache block on CPU: the prefix cache's unit of sharing
_CALLS = itertools.count()  # unique request-id prefix per streamed call
_BUILDS = itertools.count()  # engines built by this process (collective: the same count on each rank)


@dataclass
class SamplingSpec:
    """Sampling settings shared by all prompts of one ``generate`` call.

    n: samples per prompt. max_tokens: response length cap in tokens. temperature: 0 = greedy.
    top_p: nucleus mass in (0, 1]. seed: None = draw the call's base seed from the engine's
    private stream (seeded by ``(engine seed, dp_rank)``); an int makes the call reproducible
    on its own. Prompt i on DP rank r uses request seed ``base + r * 1_000_003 + i * n`` and
    vLLM gives its k-th sample ``+ k``. Samples never depend on the global RNGs, and
    ``generate``/``score`` leave the global torch RNG state unchanged.
    """

    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Completion:
    """One sampled response.

    token_ids: response token ids as sampled (ends with the EOS/stop id when it stopped on one).
    logprobs: float log-probability (nats) of each sampled token, ``len == len(token_ids)``.
    finish_reason: ``"stop"`` (EOS/stop token) or ``"length"`` (cut at max_tokens / max_model_len);
        ``generate_within`` also returns ``"timeout"`` (aborted at its deadline: no tokens).
    top_logprobs: only from ``generate_within(..., top_logprobs=K)``: per response position a
        ``{token_id: logprob}`` dict of the K most likely tokens (plus the sampled one), same
        logprobs mode as ``logprobs``; None otherwise.
    mask, final_ids, episode, prompt_ids: only for a multi-turn episode
        (:mod:`yatt.rollout.episodes`): per token 1 (the model's) or 0 (the environment's; its
        logprob is 0.0), the last model turn's tokens, the episode's info (turns, end reason,
        counters) and its prompt (the environment's first messages); None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None
    mask: list[int] | None = None
    final_ids: list[int] | None = None
    episode: dict | None = None
    prompt_ids: list[int] | None = None


def _reload_on_worker(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on the vLLM worker: in-place reload, then re-pack a tied lm_head.

    On CPU the output layer keeps a pre-packed GEMM handle of the embedding matrix; with
    tied embeddings no ``lm_head`` weight is loaded, so the reload leaves that handle stale
    (~4e-2 logprob error) unless the layer's post-load processing runs again.
    """
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    tied = getattr(worker.model_config.hf_config, "tie_word_embeddings", False)
    if tied and lm_head is not None and getattr(lm_head, "quant_method", None) is not None:
        lm_head.quant_method.process_weights_after_loading(lm_head)


def _forget_reload_state(worker) -> None:
    """Runs on the vLLM worker before shutdown: drop the model's in-place-reload records.

    vLLM keeps per-layer reload state (including the layer's kernel tensors) in the
    module-level ``layerwise.LAYERWISE_INFO``; those entries outlive the engine, so every
    engine that received ``update_weights`` leaked its weights (measured: +0.8 GiB RSS and
    +819 live tensors per SmolLM2 engine rebuilt and pushed to).
    """
    from vllm.model_executor.model_loader.reload import layerwise

    for module in worker.model_runner.get_model().modules():
        layerwise.LAYERWISE_INFO.pop(module, None)


def _get_rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


@contextlib.contextmanager
def _keep_default_process_group():
    """vLLM's engine teardown destroys torch.distributed's default group; keep the caller's."""
    from vllm.distributed import parallel_state as ps

    original = ps.destroy_distributed_environment

    def destroy_vllm_world_only():
        if ps._WORLD:
            ps._WORLD.destroy()
        ps._WORLD = None
        ps._NODE_COUNT = None

    ps.destroy_distributed_environment = destroy_vllm_world_only
    try:
        yield
    finally:
        ps.destroy_distributed_environment = original


@contextlib.contextmanager
def _local_memory_probe():
    """Each engine sizes its KV cache from its own rank's free memory.

    vLLM's external launcher takes the minimum over the whole world (an all-reduce in
    ``determine_available_memory``), as its ranks run one TP engine in lockstep. YATT's engines
    are independent: ranks build different models (policy, judge) or none at all
    (``rollout_apart`` trainers, :func:`join_engine_groups`), so the probe stays local."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    original = ExecutorWithExternalLauncher.determine_available_memory
    ExecutorWithExternalLauncher.determine_available_memory = UniProcExecutor.determine_available_memory
    try:
        yield
    finally:
        ExecutorWithExternalLauncher.determine_available_memory = original


@contextlib.contextmanager
def _job_shm_names(ident: str):
    """vLLM's CPU TP all-reduce names its shared-memory segments after the port of the init
    method, and under the external launcher there is none (``env://``): every engine on a host
    used the same names, so a second job, or the next one after a killed one (its segments
    stay in /dev/shm), failed with "create shm in SHMManager failed. errno: 17". Prefix them
    with ``ident`` (the same on the engine's ranks, unique on the host)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original = _CPUSHMDistributed.make_group_name
    _CPUSHMDistributed.make_group_name = staticmethod(lambda c: f"yatt-{ident}-{original(c).rsplit('/', 1)[-1]}")
    try:
        yield
    finally:
        _CPUSHMDistributed.make_group_name = original


def join_engine_groups(model_path) -> None:
    """On a rank that builds no engine while others build theirs (collective, at the same point):
    create the process groups that building an engine of ``model_path`` creates (vLLM's world and
    model-parallel groups over the whole torch.distributed world; which ones depends on the model,
    e.g. an expert-parallel group for MoE models), so the other ranks' builds do not wait for it.
    Only the first engine of a process creates them; later builds reuse them, so ``model_path``
    is the model the other ranks build first.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("join_engine_groups: torch.distributed is not initialised")
    config = VllmConfig(model_config=ModelConfig(model=str(model_path)),
                        parallel_config=ParallelConfig(distributed_executor_backend="external_launcher"))
    with set_current_vllm_config(config):
        ps.init_distributed_environment(dist.get_world_size(), dist.get_rank(), "env://",
                                        int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend())
        ps.ensure_model_parallel_initialized(1, 1)


def leave_engine_groups() -> None:
    """Counterpart of :func:`join_engine_groups`, where the other ranks shut their engines down:
    destroy vLLM's process groups on this rank as their shutdown does on theirs (the
    torch.distributed default group stays), so a later engine build on every rank creates them
    anew everywhere. A no-op where none exist."""
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    with _keep_default_process_group():
        ps.destroy_distributed_environment()


def _shutdown_keep_world(core) -> None:
    with _keep_default_process_group(), _no_heap_wide_gc():
        core.shutdown()
    gc.collect()


@contextlib.contextmanager
def _no_heap_wide_gc():
    """Make ``gc.freeze``, ``gc.unfreeze`` and ``gc.collect`` no-ops while vLLM builds or tears
    down an engine; the caller collects once afterwards.

    vLLM freezes the whole heap at engine start-up and, at teardown, unfreezes it and runs three
    full collections, each walking every object of torch, vLLM, Megatron-Core and transformers
    (~0.7 M objects, 0.6-3 s per collection on the dev machine). With the freeze skipped, the
    engine's objects stay collectable, so one collection after the teardown, walking only what
    is not frozen, frees them (the job froze its libraries at start: :func:`yatt.loop.run`).
    Automatic collections are unaffected.
    """
    saved = gc.freeze, gc.unfreeze, gc.collect
    gc.freeze = gc.unfreeze = lambda: None
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.freeze, gc.unfreeze, gc.collect = saved


def _final_only():
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY


def _check_finished(out) -> None:
    for c in out.outputs:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request {out.request_id} finished with {c.finish_reason!r}")


def _is_greedy(spec: SamplingSpec) -> bool:
    return spec.temperature < 1e-5


def _completions(out, spec: SamplingSpec, top_logprobs: bool) -> list[Completion]:
    """A finished vLLM RequestOutput as ``spec.n`` Completions (greedy: one sample, copied)."""
    comps = []
    for c in out.outputs:
        toks = list(c.token_ids)
        top = [{int(t): float(lp.logprob) for t, lp in d.items()} for d in c.logprobs] if top_logprobs else None
        comps.append(Completion(toks, [float(d[t].logprob) for t, d in zip(toks, c.logprobs)], c.finish_reason, top))
    if _is_greedy(spec):
        comps = [Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, c.top_logprobs)
                 for c in comps for _ in range(spec.n)]
    return comps


@contextlib.contextmanager
def _fork_global_rng():
    """vLLM's CPU sampler draws from the global torch RNG even when every request is seeded
    (the draws are overwritten); fork it so the caller's RNG stream is left untouched."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _eager_on_cpu():
    """On CPU, vLLM's sampler helper compiled with ``torch.compile`` (``batched_count_greater_than``,
    the rank of each sampled token's logprob) runs eagerly: compiling it took ~1.6 s of every job's
    first rollout on the dev machine (and again at each new batch shape) for a kernel that saves
    nothing there (its point is GPU memory). The result is the same integer count either way.
    On GPU the compiled kernel is kept."""
    return contextlib.nullcontext() if torch.cuda.is_available() else torch.compiler.set_stance("force_eager")


class VLLMEngine:
    """This rank's vLLM engine (TP group of ``tp`` ranks; ranks ``r // tp`` are independent replicas).

    With ``tp > 1`` every call is collective over the engine's ranks (:mod:`yatt.rollout.tp_group`):
    each rank passes its own prompts and gets its own results, as with ``tp = 1``, while the
    engine serves the whole group's requests at once, with the settings (SamplingSpec, deadline)
    of the group's first rank.

    Args:
        model_path: HF folder (config, tokenizer, safetensors).
        tp: tensor-parallel size; must divide the torch.distributed world size.
        max_model_len: max prompt + response tokens per sequence.
        kv_cache_memory_bytes: KV cache size on CPU (on GPU the size comes from
            ``gpu_memory_utilization``).
        seed: engine seed (with ``tp > 1``: the group's first rank's); the private sampling
            stream is seeded with ``(seed, dp_rank)``, ``dp_rank = rank // tp``.
            vLLM reseeds the global Python/NumPy/torch RNGs while building; this constructor
            restores the caller's RNG states afterwards, and restores ``torch.set_num_threads``
            (which vLLM's CPU worker replaces by a no-op) and the thread count.
        dtype: weights/activations dtype ("float32", "bfloat16", ...).
        gpu_memory_utilization: fraction of GPU memory for vLLM (GPU only).
        logprobs_mode: vLLM logprobs mode for sampled tokens ("raw_logprobs" default).
        progress: label of a tqdm bar over the samples of each call as they finish (vLLM's bar
            for batch calls, with its token speeds); None: no bar. Give it on one rank only.
        runner: ``"generate"`` (sampling, ``score``) or ``"pooling"`` (a sequence-classification
            model served by vLLM's pooling runner: :meth:`classify` only; no prefix cache).
        max_num_seqs: most sequences in one engine step (None: vLLM's default).
    Raises:
        ValueError: ``tp`` does not divide the world size, or ``tp > 1`` without torch.distributed.
        RuntimeError: torch.distributed is initialised but RANK/LOCAL_RANK/WORLD_SIZE/
            MASTER_ADDR/MASTER_PORT are missing from the environment.
    """

    def __init__(self, model_path: str, *, tp: int = 1, max_model_len: int = 1024,
                 kv_cache_memory_bytes: int = 1 << 30, seed: int = 0, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.5, logprobs_mode: str = "raw_logprobs",
                 progress: str | None = None, runner: str = "generate", max_num_seqs: int | None = None):
        from vllm import LLM

        logs.install()  # vLLM's lines that need no action (yatt/logs.py)

        self.max_model_len = max_model_len
        self.progress = progress
        self._owns_world = not dist.is_initialized()  # then vLLM creates (and later destroys) it
        kwargs: dict = dict(model=str(model_path), tensor_parallel_size=tp, max_model_len=max_model_len,
                            seed=seed, dtype=dtype, runner=runner, use_tqdm_on_load=logs.level() == "all")
        if runner == "generate":
            kwargs.update(logprobs_mode=logprobs_mode, enable_prefix_caching=True)
        if max_num_seqs is not None:
            kwargs.update(max_num_seqs=max_num_seqs)
        self.group = EngineGroup(tp)  # the ranks of this engine (ValueError: tp does not divide the world)
        # one engine: the same seed on each of its ranks, and its shared memory named after its first rank
        seed, pid = self.group.first((seed, os.getpid()))
        self._ident = f"{pid}.{next(_BUILDS)}"
        kwargs["seed"] = seed
        if dist.is_initialized():
            missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                       if k not in os.environ]
            if missing:
                raise RuntimeError(f"set {missing} before building the engine (yatt.dist.init_distributed)")
            kwargs.update(distributed_executor_backend="external_launcher", data_parallel_size=1)
            self.dp_rank, self.dp_size = dist.get_rank() // tp, dist.get_world_size() // tp
        else:
            self.dp_rank, self.dp_size = 0, 1
        self.can_sleep = torch.cuda.is_available()  # vLLM's sleep mode exists on GPU only
        if self.can_sleep:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True)
        else:
            # no chunked prefill on CPU: a seeded request whose prompt is split over engine steps
            # crashes vLLM's CPU runner ("CPU Generator does not use offset": it rewinds the
            # sampler's generator for the discarded partial-prefill sample), which happened as soon
            # as a call's prompts held more than max_num_batched_tokens (4096) tokens
            # KV blocks of 32 tokens (the CPU attention's smallest; its default is 128): the prefix
            # cache shares only whole blocks, so with 128 each of a group's n samples prefilled a
            # prompt under 128 tokens again (4 prompts of 48 tokens x 8 samples, 48 new tokens, one
            # thread: prefill 4.7 s of a 9.5 s call; 1.9 s of 6.2 s with 32-token blocks)
            kwargs.update(kv_cache_memory_bytes=kv_cache_memory_bytes, enforce_eager=True, block_size=CPU_BLOCK_SIZE,
                          enable_chunked_prefill=False, max_num_batched_tokens=max(4096, max_model_len))
        rng_states = _get_rng_states()
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            with _no_heap_wide_gc(), _local_memory_probe(), _job_shm_names(self._ident):
                self._llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            _set_rng_states(rng_states)
        self._rng = np.random.default_rng((seed, self.dp_rank))
        if not self._owns_world:  # dropping the engine without shutdown() must not kill the group
            client = self._llm.llm_engine.engine_core
            client._finalizer.detach()
            client._finalizer = weakref.finalize(client, _shutdown_keep_world, client.engine_core)

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], spec: SamplingSpec,
                 max_tokens: list[int] | None = None) -> list[list[Completion]]:
        """Sample ``spec.n`` responses for each prompt (may be called with ``[]``).

        Args:
            prompts: this rank's prompts as token ids (chat template already applied).
            max_tokens: per prompt, its response cap (>= 1) instead of ``spec.max_tokens``
                (multi-turn episodes: each has its own room left).
        Returns:
            ``out[i][k]``: k-th Completion of prompt i; ``len(out) == len(prompts)``,
            ``len(out[i]) == spec.n``.
        Raises:
            ValueError: an empty prompt, a prompt of ``>= max_model_len`` tokens, a token id
                outside the vocabulary, or invalid spec values (vLLM's validation).
            RuntimeError: vLLM finished a request for another reason (e.g. abort).
        """
        requests, mine, spec = self.group.gather(list(zip(prompts, max_tokens or [spec.max_tokens] * len(prompts))),
                                                 spec)
        prompts = [p for p, _ in requests]
        self._check(prompts, self.max_model_len - 1)
        params = self._sampling_params(spec, len(prompts), caps=[c for _, c in requests])
        result = []
        for out in self._run(prompts, params):
            _check_finished(out)
            result.append(_completions(out, spec, top_logprobs=False))
        return result[mine]

    def generate_stream(self, prompts: list[list[int]], spec: SamplingSpec) -> Iterator[tuple[int, list[Completion]]]:
        """``generate``, yielding each prompt's group as soon as all its samples finished.

        Yields:
            ``(i, group)`` in finishing order (not prompt order): ``group[k]`` is the k-th
            Completion of ``prompts[i]``; every ``i`` exactly once. Samples are the same as
            ``generate``'s for the same spec (same seeding rule). Closing the iterator early
            aborts the unfinished requests.
        Raises:
            as ``generate``.
        """
        prompts, mine, spec = self.group.gather(prompts, spec)
        self._check(prompts, self.max_model_len - 1)
        params = self._sampling_params(spec, len(prompts), output_kind=_final_only())
        for i, out in self._stream(prompts, params, timeout_s=None):
            _check_finished(out)
            if mine.start <= i < mine.stop:  # the engine's other ranks yield the rest
                yield i - mine.start, _completions(out, spec, top_logprobs=False)

    def generate_within(self, prompts: list[list[int]], spec: SamplingSpec, timeout_s: float, *,
                        top_logprobs: int = 0) -> list[list[Completion]]:
        """``generate`` with a deadline: requests unfinished after ``timeout_s`` are aborted.

        All requests are submitted together; the deadline is ``timeout_s`` seconds (wall clock)
        after submission and is checked between engine steps, so an abort lands at the first
        step boundary past it. Aborted requests are not waited for: their samples come back as
        ``Completion([], [], "timeout")`` (all n samples of a prompt, unless all n finished in
        time).

        Args:
            prompts: this rank's prompts as token ids (may be ``[]``).
            spec: sampling settings as for ``generate`` (same seeding rule).
            timeout_s: seconds; ``<= 0`` aborts everything not finished by the first step.
            top_logprobs: K >= 0; with K > 0 each Completion carries ``top_logprobs``.
        Returns:
            ``out[i][k]`` as for ``generate`` (``finish_reason`` may also be ``"timeout"``).
        Raises:
            ValueError: as ``generate``.
        """
        prompts, mine, (spec, timeout_s) = self.group.gather(prompts, (spec, timeout_s))
        self._check(prompts, self.max_model_len - 1)
        params = self._sampling_params(spec, len(prompts), logprobs=top_logprobs, output_kind=_final_only())
        outs = dict(self._stream(prompts, params, timeout_s=timeout_s))
        result = []
        for i in range(mine.start, mine.stop):
            out = outs.get(i)
            if out is None or any(c.finish_reason not in ("stop", "length") for c in out.outputs):
                result.append([Completion([], [], "timeout") for _ in range(spec.n)])
                continue
            result.append(_completions(out, spec, top_logprobs=top_logprobs > 0))
        return result

    def _stream(self, prompts: list[list[int]], all_params: list, timeout_s: float | None):
        """Submit all requests, step the engine, yield ``(i, RequestOutput)`` as each finishes.

        Requests still running ``timeout_s`` after submission are aborted and yield
        ``(i, None)``; on an exception or an early close every unfinished request is aborted.
        """
        engine, call = self._live().llm_engine, next(_CALLS)
        pending = {f"yatt-{call}-{i}": i for i in range(len(prompts))}
        bar = self._bar(total=sum(p.n for p in all_params))
        with _fork_global_rng(), _eager_on_cpu(), bar:
            try:
                for (rid, i), params in zip(pending.items(), all_params):
                    engine.add_request(rid, {"prompt_token_ids": prompts[i]}, params)
                deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
                while pending and engine.has_unfinished_requests():
                    if deadline < math.inf and self.group.any(time.monotonic() >= deadline):  # TP: all ranks at once
                        engine.abort_request(sorted(pending))
                        for rid in sorted(pending):
                            yield pending.pop(rid), None
                        break
                    for out in engine.step():
                        if out.finished and out.request_id in pending:
                            bar.update(len(out.outputs))
                            if bar.n == bar.total:  # shown even if it came within tqdm's mininterval
                                bar.refresh()
                            yield pending.pop(out.request_id), out
            finally:
                if pending:
                    engine.abort_request(sorted(pending))

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced logprobs under the engine's current weights.

        Args:
            sequences: token ids (prompt + response), each of length in [1, max_model_len - 1].
        Returns:
            ``out[i][t] = log p(seq[t] | seq[:t])`` as floats (nats, raw logits, no
            temperature); ``out[i][0] = 0.0``; ``len(out[i]) == len(sequences[i])``.
        Raises:
            ValueError: an empty or too long sequence, or a token id outside the vocabulary.
        """
        from vllm import SamplingParams

        sequences, mine, _ = self.group.gather(sequences)
        self._check(sequences, self.max_model_len - 1)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self._run(sequences, [params] * len(sequences))
        return [[0.0] + [float(d[t].logprob) for t, d in zip(seq[1:], out.prompt_logprobs[1:])]
                for seq, out in zip(sequences[mine], outs[mine])]

    def classify(self, sequences: list[list[int]]) -> list[list[float]]:
        """A pooling engine's class logits for each sequence (its last token's, before any
        sigmoid or softmax).

        Args:
            sequences: token ids, each of length in [1, max_model_len].
        Returns:
            ``out[i]``: the ``num_labels`` logits of ``sequences[i]`` as floats.
        Raises:
            ValueError: an empty or too long sequence, or a token id outside the vocabulary.
        """
        from vllm import PoolingParams

        sequences, mine, _ = self.group.gather(sequences)
        self._check(sequences, self.max_model_len)
        outs = self._live().classify([{"prompt_token_ids": s} for s in sequences],
                                     pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        return [[float(x) for x in o.outputs.probs] for o in outs[mine]]

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], shards: bool = False) -> None:
        """Load new weights in place (no restart) and drop the prefix cache (collective over TP).

        Args:
            weights: ``(hf_name, tensor)`` pairs of full (unsharded) tensors in HF naming, e.g.
                ``model.layers.0.mlp.gate_proj.weight``; any float dtype (cast to the engine's).
                Send whole vLLM modules: q/k/v of a layer together, gate/up together (the
                full state dict is the safe choice); modules not sent keep their weights.
                A tied ``lm_head.weight`` is ignored (it follows ``model.embed_tokens.weight``).
            shards: the tensors are this rank's TP shards (:attr:`shard`: inference TP rank ``j``
                of ``i`` in :mod:`yatt.reshard.plan`'s target layout, e.g. from
                ``MegatronPolicy.export_hf_weights(..., shard=engine.shard)``), not full tensors.
        Raises:
            KeyError / RuntimeError / AssertionError from vLLM's loader for unknown names or wrong shapes.
        """
        llm = self._live()
        load = load_shards_on_worker if shards and self.group.tp > 1 else _reload_on_worker
        llm.collective_rpc(load, args=(iter(weights),))
        llm.reset_prefix_cache()

    @property
    def shard(self) -> tuple[int, int]:
        """``(i, j)``: this rank's part of the engine, TP rank ``j`` of ``i`` (``(1, 0)``: all of it)."""
        return self.group.tp, self.group.rank

    def sleep(self) -> None:
        """GPU only: release the engine's device memory (vLLM sleep level 1: weights offloaded to
        host memory, KV cache discarded) until :meth:`wake_up`. Local to this rank.

        Raises:
            RuntimeError: on CPU, where vLLM has no sleep mode (shut down and rebuild instead).
        """
        if not self.can_sleep:
            raise RuntimeError("vLLM has no sleep mode on CPU")
        self._live().sleep(level=1)

    def wake_up(self) -> None:
        """GPU only: bring a slept engine back (weights as before the sleep, empty KV cache)."""
        if not self.can_sleep:
            raise RuntimeError("vLLM has no sleep mode on CPU")
        self._live().wake_up()

    def shutdown(self) -> None:
        """Free the engine (KV cache, weights); idempotent, collective (see the module docstring).

        A torch.distributed default group that existed before the engine stays usable (vLLM's
        own teardown would destroy it); only vLLM's subgroups are destroyed.
        """
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        llm.collective_rpc(_forget_reload_state)
        with contextlib.nullcontext() if self._owns_world else _keep_default_process_group(), _no_heap_wide_gc():
            llm.llm_engine.engine_core.shutdown()
        self._llm = None
        del llm
        gc.collect()
        release_free_heap()

    # ------------------------------------------------------------------ helpers
    def _run(self, prompts: list[list[int]], params: list) -> list:
        """Add requests and step the engine until all are done (outputs in prompt order)."""
        llm = self._live()

        def use_tqdm(iterable=None, *, total: int = 0, **kw):  # vLLM's total: the samples (n per request)
            if iterable is not None:  # vLLM's short "Rendering prompts" pass: no bar
                return iterable
            return self._bar(total=total, postfix=kw.get("postfix"))

        with _fork_global_rng(), _eager_on_cpu():
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=use_tqdm if self.progress else False)

    def _bar(self, total: int, **kw):
        """The progress bar of one call (a disabled one without ``progress``), below the step bar."""
        from tqdm import tqdm

        return tqdm(total=total, desc=self.progress, unit="sample", leave=False, position=1, dynamic_ncols=True,
                    disable=self.progress is None, **kw)

    def _sampling_params(self, spec: SamplingSpec, count: int, logprobs: int = 0, caps: list[int] | None = None,
                         **extra) -> list:
        """One SamplingParams per prompt, seeded by the rule in :class:`SamplingSpec` (``caps``: per
        prompt, its ``max_tokens``).

        Greedy specs get ``n=1`` (vLLM rejects greedy ``n > 1``); :func:`_completions` copies it.
        The call's base seed is drawn even for ``count == 0``, keeping the private stream in step.
        """
        from vllm import SamplingParams

        greedy = _is_greedy(spec)
        base = spec.seed if spec.seed is not None else int(self._rng.integers(1 << 62))
        return [SamplingParams(n=1 if greedy else spec.n, max_tokens=spec.max_tokens if caps is None else caps[i],
                               temperature=spec.temperature,
                               top_p=spec.top_p, logprobs=logprobs, detokenize=False,
                               seed=None if greedy else (base + self.dp_rank * _SEED_STRIDE + i * spec.n) % (1 << 62),
                               **extra)
                for i in range(count)]

    def _live(self):
        if self._llm is None:
            raise RuntimeError("engine was shut down")
        return self._llm

    def _check(self, seqs: list[list[int]], max_len: int) -> None:
        """Validate before any request is added (a half-added batch would leak into the next call)."""
        vocab = self._live().llm_engine.model_config.get_vocab_size()
        for i, s in enumerate(seqs):
            if not 0 < len(s) <= max_len:
                raise ValueError(f"sequence {i} has {len(s)} tokens; allowed 1..{max_len}")
            if min(s) < 0 or max(s) >= vocab:
                raise ValueError(f"sequence {i} has token ids outside [0, {vocab})")
