"""yatt.preload: which environment a job's process restarts with (the restart itself: every
``python -m yatt.launch`` job in the suite; test_resume checks its log names what was preloaded)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yatt.preload import preload_env, runtime_libraries

LIBS = ["libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"]


def test_adds_the_libraries_after_an_existing_preload_and_marks_the_restart():
    env = preload_env({"PATH": "/bin", "LD_PRELOAD": "/opt/libmine.so"}, LIBS)
    assert env["LD_PRELOAD"] == "/opt/libmine.so:libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"
    assert env["PATH"] == "/bin" and env["_YATT_PRELOADED"] == "1"
    assert preload_env({}, LIBS)["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"


def test_adds_only_what_is_missing():
    env = preload_env({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, LIBS)
    assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"
    assert preload_env({"LD_PRELOAD": ":".join(LIBS)}, LIBS) is None


def test_no_restart_when_turned_off_already_restarted_or_nothing_installed():
    assert preload_env({"YATT_PRELOAD": "0"}, LIBS) is None
    assert preload_env({"_YATT_PRELOADED": "1"}, LIBS) is None  # never a second restart
    assert preload_env({}, []) is None


def test_finds_installed_libraries_only():
    for lib in runtime_libraries():
        assert ("tcmalloc" in lib or "iomp5" in lib) and (Path(lib).is_file() or "/" not in lib)


_RELEASE = """
import psutil, torch
from yatt.preload import release_free_heap
rss = lambda: psutil.Process().memory_info().rss / 2**20
blocks = [torch.ones(16384) for _ in range(16384)]  # 1 GiB in 64 KiB tensors
held = rss()
del blocks
release_free_heap()
print(held - rss())
"""


@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_freed_heap_goes_back_to_the_os_with_either_allocator(allocator):
    """An engine teardown's freed memory is handed back through the allocator the process runs on
    (tcmalloc keeps it past glibc's malloc_trim: 1 GiB stayed resident before this was fixed)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    if allocator == "tcmalloc":
        tcmalloc = next((lib for lib in runtime_libraries() if "tcmalloc" in lib), None)
        if tcmalloc is None:
            pytest.skip("tcmalloc is not installed here (make setup installs it as root)")
        env["LD_PRELOAD"] = tcmalloc
    out = subprocess.run([sys.executable, "-c", _RELEASE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) > 900  # MiB of the 1024 given back
