"""Run Megatron-Core 0.16.1 on a machine without CUDA.

Megatron-Core is written for GPUs: many of its modules call ``torch.cuda`` or allocate with
``device="cuda"``, so on a CPU-only build of torch it stops at the first such call
(``Torch not compiled with CUDA enabled``). Its algorithms (TP/PP/DP, optimizer, schedules)
are device agnostic and run on gloo process groups once these calls land on the CPU.

:func:`apply` installs the seven redirects listed in ``shared/docs/ENVIRONMENT.md``. Each was
shown necessary by removing it (tests/test_trainer.py and tests/mpi/trainer_tp.py fail with it
removed); the feature that first needs it is in brackets:

1. ``torch.cuda.current_device`` returns the CPU device (~175 ``device=`` sites) [any model].
2. The CUDA RNG behind Megatron's RNG tracker (``torch.cuda.manual_seed / get_rng_state /
   set_rng_state`` and ``tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state``)
   is the CPU default generator [``model_parallel_cuda_manual_seed``, attention dropout].
3. ``Tensor.cuda()`` returns the tensor itself [pipeline parallel with tied embeddings].
4. ``device="cuda"`` literals in ``pipeline_parallel.schedules``, ``transformer.utils``,
   ``optimizer.optimizer``, ``optimizer.clip_grads`` and ``megatron.core.utils`` create CPU
   tensors: those modules see a ``torch`` whose factories map ``cuda`` to ``cpu`` [any step].
5. ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` grads [grad clipping].
6. ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer`` classify parameters by
   their ``Tensor.type()`` CUDA names [bf16 params, distributed optimizer].
   For 5 and 6, ``Tensor.type()`` reports CPU tensors under their CUDA names *only while those
   functions run* (a ``TorchFunctionMode``).
7. ``torch.cuda.synchronize`` is a no-op [pipeline-parallel p2p].

One more change is for speed, not needed to run: gradient clipping scales the gradients in place
with one foreach multiply (:func:`_scale_in_place`) instead of Megatron's Apex-less fallback.

Redirects 1, 2, 3 and 7 replace process-global ``torch`` functions; without CUDA these can only
raise, so code that checks ``torch.cuda.is_available()`` first (vLLM, transformers) is
unaffected. Through redirect 2 Megatron's RNG tracker forks the global CPU generator:
``model_parallel_cuda_manual_seed`` reseeds it (wrap it in ``torch.random.fork_rng`` to keep
the global stream), and with dropout > 0 Megatron logs the harmless warning "CPU RNG state
changed within GPU RNG context" (its CPU and "GPU" generators are now the same one).

The layer depends on 0.16.1 internals: :func:`apply` refuses any other megatron-core version.
Use it with the local layer spec (``get_gpt_layer_local_spec``), ``use_cpu_initialization=True``
and ``params_dtype`` / ``pipeline_dtype`` set.
"""
from __future__ import annotations

import functools
import types
from importlib.metadata import version

import torch
from torch.overrides import TorchFunctionMode

MEGATRON_CORE_VERSION = "0.16.1"
_CPU = torch.device("cpu")
_applied = False

# Modules whose hard-coded ``device="cuda"`` allocations must land on the CPU (redirect 4).
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


def _cpu_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)
    return factory


class _CpuTorch(types.ModuleType):
    """The ``torch`` module as seen by one Megatron module: factories map ``cuda`` to ``cpu``."""

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


class _CudaTypeNames(TorchFunctionMode):
    """While active, ``cpu_tensor.type()`` returns the CUDA type name (``torch.cuda.FloatTensor``)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            if not out.startswith("torch.cuda."):
                out = out.replace("torch.", "torch.cuda.", 1)
        return out


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaTypeNames():
            return fn(*args, **kwargs)
    return wrapper


def _scale_in_place(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """Megatron's ``multi_tensor_scale`` (``dst = src * scale`` over two tensor lists) for
    ``clip_grad_by_total_norm_fp32``, which passes one list as both. That case is one in-place
    ``torch._foreach_mul_``: Megatron's fallback without Apex (``local_multi_tensor_scale``)
    allocates each product and copies it back. 128M fp32 gradients in 212 tensors, one thread,
    2026-12-03 on the 2-core dev machine: 0.04 s against 0.16-0.18 s per clipped step."""
    from megatron.core.utils import local_multi_tensor_scale

    src, dst = tensor_lists
    if not dst:  # a rank whose stage holds no gradients
        return
    if src is dst or all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)


def _check_version() -> None:
    installed = version("megatron-core")
    if installed != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"yatt.trainer.megatron_cpu was written for megatron-core=={MEGATRON_CORE_VERSION} "
            f"but {installed} is installed; its CPU redirects patch that version's internals. "
            f"Install megatron-core=={MEGATRON_CORE_VERSION} or port and re-verify the layer.")


def apply() -> bool:
    """Install the CPU redirects for megatron-core (idempotent).

    Call before building any Megatron model or optimizer. Imports the Megatron modules it
    patches.

    Returns:
        True when the redirects are installed (now or by an earlier call), False when CUDA is
        available (nothing is changed).
    Raises:
        RuntimeError: the installed megatron-core is not ``MEGATRON_CORE_VERSION``.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _check_version()
    import importlib

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random as mp_random

    # 1. current device
    torch.cuda.current_device = lambda: _CPU
    # 2. CUDA RNG -> CPU default generator
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # 3. Tensor.cuda() -> identity
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # 4. device="cuda" literals
    cpu_torch = _CpuTorch()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = cpu_torch
    # 5. clip grads asserts CUDA grads (optimizer.optimizer imported it by name)
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    clip_grads.multi_tensor_scale_impl = _scale_in_place  # speed only: the clip's scaling in place
    # 6. optimizers classify params by CUDA type names
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    # 7. synchronize
    torch.cuda.synchronize = lambda device=None: None
    _applied = True
    return True
