"""yatt.preload: which environment a job's process restarts with (the restart itself: every
``python -m yatt.launch`` job in the suite; test_resume checks its log names what was preloaded)."""
from pathlib import Path

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
