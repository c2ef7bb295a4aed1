"""Library log lines that need no action, dropped at a job's start (config key ``log.level``).

:data:`NOISE` lists every line a YATT run on CPU gets from a library that asks nothing of the
user: where it comes from, how its message starts, and why dropping it is safe. Each is
dropped where it is made, by the library's own mechanism:

- a Python warning (``category`` set): a :mod:`warnings` filter on that category, message and
  the modules of ``source``;
- a library log record (``source`` a logger's name): a :class:`logging.Filter` on that logger;
- a C++ warning of torch's c10 log (``source`` ``"c10"``): ``TORCH_CPP_LOG_LEVEL=ERROR``, read by
  c10 when torch is imported. c10 filters by level only, so this drops every C++ warning of the
  process (c10d, gloo, vLLM's kernels); C++ errors still print, and the warnings torch raises
  inside a Python call are Python warnings, not affected. A script that imports torch before
  ``Trainer(...).train`` keeps the C++ warnings (the rest is filtered as in any job).

``log.level=all`` installs none of them. Warnings and errors not listed here always show. The
vLLM CPU worker's advice to preload tcmalloc and Intel OpenMP becomes one line of YATT's,
:func:`native_runtime`: which allocator and OpenMP runtime this process uses.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from yatt import preload

LEVELS = ("quiet", "all")  # log.level


@dataclass(frozen=True)
class Noise:
    """One library line that needs no action.

    source: the package or module a Python warning is raised from, the name of the logger of a
        log record, or ``"c10"`` (torch's C++ log). message: a regular expression matched at the
        message's start (case-insensitive for warnings, as :mod:`warnings` does). why: why dropping
        it loses nothing. category: the class of a Python warning; None for a log line.
    """

    source: str
    message: str
    why: str
    category: type[Warning] | None = None


_FALLBACK = "Megatron-Core uses its torch code instead of Apex's/Transformer Engine's CUDA kernels: the CPU path"
_TRITON = "vLLM's CPU build runs its own C++ kernels; Triton, a GPU kernel compiler here, is not used on CPU"
_ADVICE = "speed advice; YATT's own line names the allocator and OpenMP runtime in use (native_runtime)"

NOISE: tuple[Noise, ...] = (
    Noise("megatron.core", r"Apex is not installed\. Falling back to Torch Norm", _FALLBACK, UserWarning),
    Noise("megatron.core", r"Transformer Engine and Apex are not installed\. Falling back", _FALLBACK, UserWarning),
    Noise("vllm.triton_utils.dispatcher", r"`torch\.distributed\.reduce_op` is deprecated",
          "vLLM's kernel dispatcher scans torch.distributed's attributes and so touches the deprecated alias; "
          "nothing in YATT or a recipe uses it", FutureWarning),
    Noise("vllm.triton_utils.importing", r"Triton is installed, but doesn't include CPU backend", _TRITON),
    Noise("vllm.triton_utils.importing", r"Triton is installed but 0 active driver\(s\) found", _TRITON),
    Noise("vllm.triton_utils.importing", r"Triton not installed or not compatible", _TRITON),
    Noise("vllm.platforms.cpu", r"Triton is not installed\. triton-cpu is expected", _TRITON),
    Noise("vllm.config.vllm", r"Model Runner V2 requires Triton; using the V1 model runner",
          "the V1 model runner is the one YATT's engine is built and tested on"),
    Noise("vllm.config.vllm", r"Enforce eager set, disabling torch\.compile",
          "YATT's engine asks for eager mode on CPU (no compile time at each engine build)"),
    Noise("vllm.config.vllm", r"Inductor compilation was disabled by user settings", "follows from eager mode"),
    Noise("vllm.engine.arg_utils", r"The global random seed is set to",
          "YATT's engine restores the caller's Python, NumPy and torch RNG states after each build"),
    Noise("vllm.engine.arg_utils", r"This model does not officially support disabling chunked prefill",
          "YATT's CPU engines prefill whole prompts (a split prompt crashes vLLM's CPU sampler for seeded "
          "requests); tests/test_rollout.py checks their logprobs against transformers' and their samples repeat"),
    Noise("vllm.platforms.cpu", r"Reset SSM cache type to float32",
          "a setting for Mamba/SSM layers; the policies and judges YATT loads have none"),
    Noise("vllm.v1.worker.cpu_worker", r"libtcmalloc is not found in LD_PRELOAD", _ADVICE),
    Noise("vllm.v1.worker.cpu_worker", r"libiomp is not found in LD_PRELOAD", _ADVICE),
    Noise("vllm.v1.worker.cpu_worker", r"CPU backend doesn't allow to use `torch\.set_num_threads`",
          "YATT's engine restores torch.set_num_threads and the rank's thread count after each build"),
    Noise("vllm.model_executor.model_loader.reload.layerwise", r"\w+: Failed to load weights",
          "on a weight push, RoPE and a tied lm_head have no checkpoint weights and keep their own tensors; "
          "each step's logprob_diff_rollout_vs_train checks the push"),
    Noise("vllm.triton_utils.dispatcher", r"Kernel vllm\.\S+ is already registered\. Overwriting",
          "each engine build in a process registers vLLM's C++ stand-ins for its Triton kernels again, the same ones"),
    Noise("vllm.platforms.interface", r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT$",
          "vLLM's own CPU worker sets VLLM_DIST_IDENT; the next engine build of the process flags it "
          "(any other unknown VLLM_ variable still shows)"),
    Noise("vllm.v1.engine.input_processor", r"Passing raw prompts to InputProcessor is deprecated",
          "YATT's streamed calls pass token ids as a prompt dict, which the pinned vLLM accepts; moving them to "
          "Renderer.render_cmpl belongs to the next vLLM upgrade, not to the user"),
    Noise("c10", r"NUMA binding: Using MEMBIND policy",
          "vLLM's CPU worker binds its memory to the NUMA node of its cores, as designed"),
)

# Chatter below WARNING, kept out at every level (export VLLM_LOGGING_LEVEL=INFO to see vLLM's).
_ENV_DEFAULTS = {"VLLM_LOGGING_LEVEL": "WARNING"}
_QUIET_LOGGERS = ("megatron",)  # its DDP lists every parameter at INFO

_level = "quiet"
_env_set: dict[str, str] = {}  # what setup() exported, so that a later setup("all") can undo it


class _Drop(logging.Filter):
    """Drops the records of one logger whose message starts as one of NOISE's for it."""

    def __init__(self, logger: str):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{n.message})" for n in NOISE if n.source == logger))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def _logger_names() -> list[str]:
    return sorted({n.source for n in NOISE if n.category is None and n.source != "c10"})


def _warning_filters() -> list[tuple]:
    """NOISE's Python warnings as ``warnings.filters`` entries (as ``filterwarnings`` makes them)."""
    return [("ignore", re.compile(n.message, re.I), n.category, re.compile(rf"{re.escape(n.source)}(\..*)?\Z"), 0)
            for n in NOISE if n.category is not None]


def install() -> None:
    """Install (level ``quiet``) or remove (``all``) NOISE's warning and logger filters in this
    process, at the level :func:`setup` chose (``quiet`` if none did). Idempotent; engines call
    it too, for the scripts that build one without a job."""
    ours = _warning_filters()
    warnings.filters[:] = [f for f in warnings.filters if f not in ours]
    for name in _logger_names():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _Drop)]:
            logger.removeFilter(f)
        if _level == "quiet":
            logger.addFilter(_Drop(name))
    if _level == "quiet":
        for action, message, category, module, _ in reversed(ours):
            warnings.filterwarnings(action, message.pattern, category, module.pattern)


def setup(level: str = "quiet") -> None:
    """A job's log settings for libraries, on every rank, before torch is imported (c10 reads
    ``TORCH_CPP_LOG_LEVEL`` then): environment defaults, quiet loggers, and :func:`install` at
    ``level``. A variable the user exported is left as it is.

    Raises:
        ValueError: ``level`` is not one of :data:`LEVELS`.
    """
    global _level
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {LEVELS}")
    _level = level
    wanted = dict(_ENV_DEFAULTS, **({"TORCH_CPP_LOG_LEVEL": "ERROR"} if level == "quiet" else {}))
    for key in [k for k in _env_set if k not in wanted]:
        if os.environ.get(key) == _env_set.pop(key):
            del os.environ[key]
    for key, value in wanted.items():
        if key not in os.environ:
            os.environ[key] = _env_set[key] = value
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    install()


def level() -> str:
    """The level :func:`setup` chose: ``quiet`` (the default) or ``all``."""
    return _level


_ALLOCATORS = {"libtcmalloc": "tcmalloc", "libjemalloc": "jemalloc", "libmimalloc": "mimalloc"}
_OPENMP = {"libiomp5": "Intel", "libgomp": "GNU", "libomp": "LLVM"}


def native_runtime(maps: str | None = None) -> str:
    """One line naming the memory allocator and the OpenMP runtime(s) mapped into this process
    (read from ``/proc/self/maps``, or from the text ``maps``), in place of vLLM's advice."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "memory allocator and OpenMP runtime: unknown here (no /proc/self/maps)"
    files = {Path(f[5]).name for f in (line.split(maxsplit=5) for line in maps.splitlines()) if len(f) == 6}

    def found(kinds: dict[str, str]) -> str:
        return ", ".join(f"{kinds[k]} ({name})" for name in sorted(files) for k in kinds
                         if re.match(rf"{k}[._-]", name) and ".so" in name)

    allocator, openmp = found(_ALLOCATORS) or "glibc malloc", found(_OPENMP) or "none loaded"
    advice = "" if "tcmalloc" in allocator and "Intel" in openmp else (
        "; YATT_PRELOAD=0 turned preloading off" if preload.turned_off(os.environ) else
        "; for speed, install Debian's libtcmalloc-minimal4 (make setup does, as root): python -m yatt.launch "
        "then preloads it and Intel OpenMP (yatt/preload.py)")
    return f"memory allocator: {allocator}; OpenMP: {openmp}{advice}"
