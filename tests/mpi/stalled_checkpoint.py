"""A YATT job as ``python -m yatt.launch`` runs it, except that the async write of step 2's
checkpoint never finishes: each rank's writer thread stops after its first file of that step. So
test_resume can SIGKILL the job while that write is in flight however fast the machine writes (a
tiny model's checkpoint is written in milliseconds); training goes on meanwhile until the next save
waits for this one.

``python tests/mpi/stalled_checkpoint.py --config FILE [key=value ...]``; exits with the job's code.
"""
import sys
import threading

from yatt.checkpoint import saver
from yatt.launch import main

_save = saver._save


def _stalling_save(obj, path):
    written = _save(obj, path)
    if "step_000002.tmp" in path.parts:
        threading.Event().wait()  # this writer thread never returns; the test kills the job
    return written


saver._save = _stalling_save
sys.exit(main(sys.argv[1:]))
