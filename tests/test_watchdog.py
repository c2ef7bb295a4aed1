"""yatt.watchdog: the failure decision in-process (pure logic, and two watchdogs on a local store),
then real jobs (tests/mpi/watchdog.py) where a rank hangs or dies: the job must end within the
timeout, naming the rank and its phase, and leave no process behind."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from yatt.watchdog import EXIT_RANK_LOST, Beat, Monitor, Snapshot, Watchdog, observe, stale

from conftest import MPIRUN, ROOT, job_env

SCRIPT = ROOT / "tests" / "mpi" / "watchdog.py"
TIMEOUT = 5.0  # the watchdog's timeout in the jobs; heartbeat every 0.5 s
SLACK = 10.0  # detection may take timeout + ~2 intervals; the rest is for a loaded 2-core machine


# -- pure logic ------------------------------------------------------------------------------

def test_observe_moves_changed_at_only_when_the_value_changes():
    seen = observe({}, 1.0, {1: 5, 2: 7})
    assert seen == {1: (5, 1.0), 2: (7, 1.0)}
    seen = observe(seen, 2.0, {1: 5, 2: 8})
    assert seen == {1: (5, 1.0), 2: (8, 2.0)}
    assert observe(seen, 3.0, {}) == seen  # a rank missing from a round keeps its entry


def test_stale_lists_ranks_past_the_timeout_stalest_first():
    assert stale(10.0, {0: 9.0, 1: 4.0, 2: 2.0, 3: 5.0}, 5.0) == [2, 1]
    assert stale(10.0, {1: 5.0}, 5.0) == []  # exactly the timeout is not yet late


def beat(seq, phase="train", step=3, rank=1, done=False, abort=None):
    return Beat(seq, 0.0, phase, step, 1000 + rank, "h", done, abort)


def test_monitor_flags_a_silent_peer_with_its_phase():
    m = Monitor(0, [1, 2], now=0.0, timeout_s=5, interval_s=0.5)
    assert m.tick(0.5, Snapshot(0.5, {1: beat(1), 2: beat(1, rank=2)})) is None
    for t in (1.0, 1.5, 2.0):  # rank 2 keeps beating, rank 1 went silent after t=0.5
        snap = Snapshot(t, {1: beat(1), 2: beat(int(t * 2), rank=2)})
        assert m.tick(t, snap) is None
    t = 2.0
    while (msg := m.tick(t, Snapshot(t, {1: beat(1), 2: beat(int(t * 2), rank=2)}))) is None:
        t += 0.5
    assert t == 6.0  # 5 s after its heartbeat was last seen changing (t=0.5)
    assert msg == "yatt: rank 1 (h:1001) sent no heartbeat for 5.5 s; its last phase was 'train' of step 3; aborting the job"


def test_monitor_flags_a_rank_that_never_started():
    m = Monitor(0, [1], now=0.0, timeout_s=2, interval_s=0.5)
    msgs = [m.tick(t, Snapshot(t, {})) for t in (1.0, 2.0, 2.5)]
    assert msgs[:2] == [None, None] and "rank 1 sent no heartbeat within 2.5 s of the watchdog's start" in msgs[2]


def test_monitor_flags_an_unanswering_store_and_names_rank_0():
    m = Monitor(1, [0], now=0.0, timeout_s=2, interval_s=0.5)
    assert m.tick(0.5, Snapshot(0.5, {0: beat(1, rank=0)})) is None
    stuck = Snapshot(0.5, {0: beat(1, rank=0)})  # the I/O thread never comes back
    assert m.tick(2.0, stuck) is None and m.tick(2.5, stuck) is None
    msg = m.tick(3.0, Snapshot(0.5, {0: beat(1, rank=0)}, error="DistNetworkError: Connection reset by peer"))
    assert msg.startswith("yatt: rank 1 got no answer from the rendezvous store served by rank 0 (h:1000) for 2.5 s")
    assert "Connection reset by peer" in msg and "rank 0's last phase was 'train' of step 3" in msg


def test_monitor_forgives_peers_while_it_was_itself_frozen():
    m = Monitor(0, [1], now=0.0, timeout_s=2, interval_s=0.5)
    assert m.tick(0.5, Snapshot(0.5, {1: beat(1)})) is None
    # this process was SIGSTOPped from t=0.5 to t=30: nothing it read since then says the peer is dead
    assert m.tick(30.0, Snapshot(0.5, {1: beat(1)})) is None
    assert m.tick(30.5, Snapshot(30.4, {1: beat(2)})) is None
    assert m.tick(32.0, Snapshot(31.9, {1: beat(2)})) is None
    assert "rank 1" in m.tick(33.0, Snapshot(32.9, {1: beat(2)}))  # but a real silence still counts


def test_monitor_done_ranks_are_never_flagged_and_rank_0_done_silences_the_rest():
    m = Monitor(0, [1, 2], now=0.0, timeout_s=2, interval_s=0.5)
    assert m.tick(0.5, Snapshot(0.5, {1: beat(1, done=True), 2: beat(1, rank=2)})) is None
    msgs = [m.tick(t, Snapshot(t, {2: beat(1, rank=2)})) for t in (1.0, 1.5, 2.0, 2.5, 3.0)]
    assert msgs[:-1] == [None] * 4 and "rank 2" in msgs[-1] and "rank 1" not in msgs[-1]
    m = Monitor(1, [0], now=0.0, timeout_s=2, interval_s=0.5)
    assert m.tick(0.5, Snapshot(0.5, {0: beat(1, rank=0, done=True)})) is None
    assert m.quiet and m.tick(60.0, Snapshot(0.5, {})) is None


def test_monitor_relays_rank_0_abort_note_and_flags_stalls():
    m = Monitor(1, [0], now=0.0, timeout_s=5, interval_s=0.5)
    msg = m.tick(0.5, Snapshot(0.5, {0: beat(1, rank=0, abort="yatt: rank 7 (h:7) sent no heartbeat")}))
    assert msg == "yatt: rank 7 (h:7) sent no heartbeat [reported by rank 0's watchdog]"
    m = Monitor(0, [1, 2], now=0.0, timeout_s=5, interval_s=0.5, stall_s=3)
    for i, t in enumerate((0.5, 1.0, 2.0, 3.0)):
        assert m.tick(t, Snapshot(t, {1: beat(i), 2: beat(i, "rollout", i, rank=2)})) is None
    msg = m.tick(4.0, Snapshot(4.0, {1: beat(9), 2: beat(9, "rollout", 9, rank=2)}))
    assert msg.startswith("yatt: rank 1 (h:1001) has been in phase 'train' of step 3 for 3.5 s (stall limit 3 s)")


# -- two watchdogs in this process, on a local TCPStore -------------------------------------

@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield server


def test_watchdogs_in_process_stay_quiet_then_flag_a_wedged_rank(store):
    failures = {0: [], 1: []}
    wds = [Watchdog(r, 2, timeout_s=1.0, on_failure=failures[r].append, store=store) for r in (0, 1)]
    for w in wds:
        w.start()
    for step in range(4):
        for w in wds:
            w.phase("train", step)
        time.sleep(0.3)
    assert failures == {0: [], 1: []}
    gate, publish = threading.Event(), wds[1]._beat
    wds[1]._beat = lambda seq, done: (gate.wait(), publish(seq, done))[1]  # rank 1's heartbeat wedges
    t0 = time.monotonic()
    while not failures[0] and time.monotonic() < t0 + 5:
        time.sleep(0.05)
    took = time.monotonic() - t0
    gate.set()
    for w in wds:
        w.stop()
    assert len(failures[0]) == 1 and failures[0][0].startswith("yatt: rank 1 (") and "'train' of step 3" in failures[0][0]
    # rank 1's last beat went out up to one heartbeat interval before t0, so its silence reaches the
    # timeout that much sooner (a loaded machine showed 0.956 s)
    assert wds[0].failure == failures[0][0] and 1.0 - wds[1].interval_s <= took < 2.0, took
    # rank 1's own view froze with its wedged heartbeat: whichever of its checks fires first (the store
    # stopped answering, or rank 0's heartbeat stopped changing), it names rank 0, the only rank it watches
    assert all("from the rendezvous store served by rank 0" in m or m.startswith("yatt: rank 0 (")
               for m in failures[1]), failures[1]


def test_watchdog_stop_publishes_done(store):
    failures = []
    wds = [Watchdog(r, 2, timeout_s=1.0, on_failure=failures.append, store=store) for r in (0, 1)]
    for w in wds:
        w.start()
    time.sleep(0.3)
    wds[1].stop()
    time.sleep(1.5)  # longer than the timeout: a rank that left cleanly is not a hang
    assert failures == []
    wds[0].stop()
    assert not any(t.is_alive() for w in wds for t in w._threads)


def test_a_later_watchdog_does_not_trust_an_earlier_ones_done_markers(store):
    first = [Watchdog(r, 2, timeout_s=1.0, on_failure=pytest.fail, store=store) for r in (0, 1)]
    for w in first:
        w.start()
    time.sleep(0.3)
    for w in first:
        w.stop()  # both publish "done"
    failures = []
    again = Watchdog(0, 2, timeout_s=1.0, on_failure=failures.append, store=store)
    again.start()  # rank 1 never starts its second watchdog
    time.sleep(2.0)
    again.stop()
    assert len(failures) == 1 and "rank 1 sent no heartbeat within" in failures[0], failures


def test_store_errors_count_toward_the_timeout_then_fail(caplog):
    class Broken:
        def clone(self):
            raise RuntimeError("boom")

    failures = []
    w = Watchdog(1, 2, timeout_s=1.0, on_failure=failures.append, store=Broken())
    w.start()
    time.sleep(1.8)
    w.stop()
    assert len(failures) == 1 and "(last error: RuntimeError: boom)" in failures[0], failures
    assert "store call failed (RuntimeError: boom)" in caplog.text  # logged when it starts, not only at the end


def test_watchdog_rejects_bad_settings_and_is_a_no_op_alone():
    with pytest.raises(ValueError):
        Watchdog(0, 2, timeout_s=1.0, interval_s=1.0)
    assert Watchdog(0, 2, timeout_s=600).interval_s == 5.0 and Watchdog(0, 2, timeout_s=10).interval_s == 1.0
    w = Watchdog(0, 1)
    w.start()  # nothing to watch in a world of one
    w.phase("train", 0)
    w.stop()


# -- real jobs ---------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _no_strays(pids: list[int]) -> list[int]:
    """Waits up to 5 s for ``pids`` to go; kills and returns the ones that did not."""
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def run_job(args: list[str], ranks: int, mpi: bool = True, wait_for: list[int] | None = None, limit: float = 60):
    """Runs the job; returns ``(exit codes, stdout, stderr, end wall time)``. With ``mpi`` one ``mpirun``;
    otherwise one process per rank (torchrun-style env) and only ``wait_for`` ranks are awaited (the
    others are then killed). Every process is killed on timeout, and none may survive."""
    cmd = [sys.executable, str(SCRIPT), *args]
    if mpi:
        procs = [subprocess.Popen([str(MPIRUN), "-np", str(ranks), *cmd], cwd=ROOT, env=job_env(), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)]
        wait_for = [0]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  start_new_session=True,
                                  env=job_env(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(ranks)]
    deadline = time.monotonic() + limit
    outs: dict[int, tuple[str, str]] = {}
    end = None
    try:
        for i in wait_for:
            outs[i] = procs[i].communicate(timeout=max(0.1, deadline - time.monotonic()))
        end = time.time()
    except subprocess.TimeoutExpired:
        pass
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            if i not in outs:
                outs[i] = p.communicate()
    stdout = "".join(o for o, _ in outs.values())
    stderr = "".join(e for _, e in outs.values())
    assert end is not None, f"{args} still running after {limit} s\n{stdout[-3000:]}\n{stderr[-3000:]}"
    pids = [int(p) for p in re.findall(r"pid \d+ (\d+)", stdout)]  # hydra may run two ranks' lines together
    assert len(pids) == ranks, stdout
    assert not _no_strays(pids), f"processes left behind by {args}"
    return [procs[i].returncode for i in wait_for], stdout, stderr, end


# The real jobs, by test: (script arguments, ranks, run_job options). They mostly wait (for a timeout,
# in sleeps), so they run at the same time, started together by the first test that needs one.
JOBS = {
    "test_job_ends_when_a_rank_hangs": (["hang", "1"], 2, {}),
    "test_job_ends_when_rank_0_hangs": (["hang", "0"], 2, {}),
    "test_job_ends_when_a_rank_is_killed": (["kill", "1"], 2, {}),
    "test_clean_job_has_no_false_alarm": (["clean", "1"], 2, {}),
    "test_without_mpi_rank_0_report_reaches_the_other_ranks": (["hang", "2"], 3, {"mpi": False, "wait_for": [0, 1]}),
}


@pytest.fixture(scope="module")
def job_results(request):
    """``job_results(test name) -> run_job's result`` of that test's :data:`JOBS` entry. The jobs of
    every selected test of this module start together on first use, each awaited by a thread of
    its own (its end time is its own); a job's failure is raised in its test."""
    from concurrent.futures import ThreadPoolExecutor

    selected = [name for name in JOBS if any(item.name == name for item in request.session.items)]
    with ThreadPoolExecutor(max(len(selected), 1)) as pool:
        futures = {name: pool.submit(run_job, [*JOBS[name][0], str(TIMEOUT)], JOBS[name][1], **JOBS[name][2])
                   for name in selected}
        yield lambda name: futures[name].result()


def _detection_s(stdout: str, end: float) -> float:
    return end - float(re.search(r"stopping at (\d+\.\d{3})", stdout).group(1))


@pytest.mark.mpi
def test_job_ends_when_a_rank_hangs(job_results):
    codes, out, err, end = job_results("test_job_ends_when_a_rank_hangs")
    took = _detection_s(out, end)
    print(f"rank 1 hung: job ended {took:.1f} s later")
    assert codes == [EXIT_RANK_LOST], (codes, err[-3000:])
    assert "yatt: rank 1 (" in err and "its last phase was 'train' of step 3; aborting the job" in err, err[-3000:]
    assert TIMEOUT - 1.5 <= took < TIMEOUT + SLACK, took  # from the last print: an answer may precede it
    assert re.search(r"rank=host:pid 0=\S+:\d+ 1=\S+:\d+", err), err[-3000:]  # the rank map, logged at start


@pytest.mark.mpi
def test_job_ends_when_rank_0_hangs(job_results):
    codes, out, err, end = job_results("test_job_ends_when_rank_0_hangs")
    took = _detection_s(out, end)
    print(f"rank 0 hung: job ended {took:.1f} s later")
    assert codes == [EXIT_RANK_LOST], (codes, err[-3000:])
    # Rank 1 detects it by either of two correct paths, whichever comes first on this machine: rank 0's
    # store stops answering, or rank 0's heartbeat (read from that store) stops changing.
    store = "yatt: rank 1 got no answer from the rendezvous store served by rank 0 (" in err
    silent = re.search(r"yatt: rank 0 \(\S+:\d+\) sent no heartbeat for [\d.]+ s", err)
    assert store or silent, err[-3000:]
    assert ("rank 0's last phase was 'train' of step 3" if store else "its last phase was 'train' of step 3") in err
    assert TIMEOUT - 1.5 <= took < TIMEOUT + SLACK, took  # from the last print: an answer may precede it


@pytest.mark.mpi
def test_job_ends_when_a_rank_is_killed(job_results):
    codes, out, err, end = job_results("test_job_ends_when_a_rank_is_killed")
    took = _detection_s(out, end)
    print(f"rank 1 killed: job ended {took:.1f} s later")
    assert codes[0] != 0 and took < TIMEOUT + SLACK, (codes, took)


@pytest.mark.mpi
@pytest.mark.slow
def test_clean_job_has_no_false_alarm(job_results):
    codes, out, err, _ = job_results("test_clean_job_has_no_false_alarm")
    assert codes == [0] and out.count("clean OK") == 2, (codes, out[-2000:], err[-3000:])
    assert "aborting the job" not in err, err[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_without_mpi_rank_0_report_reaches_the_other_ranks(job_results):
    """torchrun-style launch (os._exit, no MPI_Abort): rank 2 hangs, rank 0 flags it, rank 1 (asleep,
    not in a collective) exits on rank 0's abort note; the frozen rank is the launcher's to kill."""
    codes, out, err, end = job_results("test_without_mpi_rank_0_report_reaches_the_other_ranks")
    took = _detection_s(out, end)
    print(f"rank 2 hung (no MPI): ranks 0 and 1 exited {took:.1f} s later")
    assert codes == [EXIT_RANK_LOST, EXIT_RANK_LOST], (codes, err[-3000:])
    assert "yatt: rank 2 (" in err and "[reported by rank 0's watchdog]" in err, err[-3000:]
    assert TIMEOUT - 1.5 <= took < TIMEOUT + SLACK, took  # from the last print: an answer may precede it
