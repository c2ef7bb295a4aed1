"""Preload tcmalloc and Intel OpenMP into a job's processes when they are installed.

vLLM's CPU backend asks for both in ``LD_PRELOAD`` ("for best performance"); a library in
``LD_PRELOAD`` must be there when the process starts, so ``python -m yatt.launch`` restarts
itself once (:func:`restart_with_preload`, same process id and arguments) before it imports
anything heavy. Measured on the 2-core dev machine (2026-12-02, demo runs, same metrics to the
printed digit): 3-step runs, twice each, alternating: steps 2-3 took 69.0 and 56.7 s with glibc
malloc and GNU OpenMP, 55.7 and 58.8 s with tcmalloc, 51.8 and 54.7 s with tcmalloc and Intel
OpenMP (whole runs 148/127, 130/124, 116/116 s); a 4-step run each way later: steps 2-4 79.8 s
without, 80.0 s with (whole runs 166 and 154 s). So a gain of 0-10%, within this machine's
run-to-run spread; kept because it never measured slower and vLLM's CPU backend asks for it.

Where to find them: Debian's ``libtcmalloc-minimal4`` (``make setup`` installs it as root), and
``libiomp5.so`` from the ``intel-openmp`` wheel in the venv's ``lib`` (a dependency of the
pinned packages). ``YATT_PRELOAD=0`` turns the restart off; rank 0's log line names the allocator
and OpenMP runtime in use either way (:func:`yatt.logs.native_runtime`). :func:`release_free_heap`
hands freed heap back to the OS through whichever allocator is loaded.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

_MARK = "_YATT_PRELOADED"  # set in the restarted process: never restart twice


def runtime_libraries() -> list[str]:
    """Paths (or ldconfig names) of tcmalloc and Intel OpenMP that are installed here, in that order."""
    found = []
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if tcmalloc:
        found.append(tcmalloc)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    iomp = str(iomp) if iomp.is_file() else ctypes.util.find_library("iomp5")
    if iomp:
        found.append(iomp)
    return found


def turned_off(environ) -> bool:
    """``YATT_PRELOAD=0`` in ``environ``: no restart."""
    return environ.get("YATT_PRELOAD", "1") == "0"


def preload_env(environ: dict[str, str], libraries: list[str]) -> dict[str, str] | None:
    """The environment to restart with, or None when there is nothing to add (:func:`turned_off`,
    already restarted, or every library already in ``LD_PRELOAD``)."""
    if turned_off(environ) or environ.get(_MARK):
        return None
    have = environ.get("LD_PRELOAD", "")
    new = [lib for lib in libraries if Path(lib).name not in have]
    if not new:
        return None
    return {**environ, "LD_PRELOAD": ":".join(filter(None, [have, *new])), _MARK: "1"}


def restart_with_preload() -> None:
    """Replace this process by itself (``os.execve``: same pid, argv and open descriptors, so an
    MPI launcher's connection survives) with the installed runtime libraries in ``LD_PRELOAD``;
    returns only when there is nothing to do or the restart failed (then the job runs as it is).
    Call it first thing in ``__main__``, before anything is printed or imported."""
    env = preload_env(dict(os.environ), runtime_libraries())
    if env is None:
        return
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as e:
        print(f"yatt: could not restart with LD_PRELOAD={env['LD_PRELOAD']} ({e}); running without",
              file=sys.stderr, flush=True)


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS, through the allocator in use: tcmalloc's
    ``MallocExtension_ReleaseFreeMemory`` when tcmalloc is loaded (:func:`restart_with_preload`),
    else glibc's ``malloc_trim``; a no-op elsewhere.

    An engine teardown (a vLLM engine, a reward model) frees gigabytes in many small blocks that
    the allocator otherwise keeps resident; with an engine rebuilt every step (colocated GenRM on
    CPU) the resident size crept up by ~1 GiB per step without this. Measured: RSS after a SmolLM2 / Qwen-0.5B
    teardown 1.15-2.0 GiB without, 0.73-1.4 GiB with (glibc). Under tcmalloc, malloc_trim
    releases nothing: three SmolLM2 build/teardown cycles left 2.47, 3.49, 3.51 GiB resident
    (2026-12-02, dev machine).
    """
    process = ctypes.CDLL(None)
    for release, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        fn = getattr(process, release, None)
        if fn is not None:
            fn(*args)
            return
