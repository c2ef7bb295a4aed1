"""The faults a user meets first, in this process: Ctrl-C's triggers and exit codes, the run
folder's lock, the path checks before anything loads, and the message of a re-run after a run
stopped before its first checkpoint. Under ``mpirun -np 2``: tests/test_resume.py (SIGINT mid-step,
a second job on a locked folder) and :func:`test_bad_paths_stop_an_mpi_job_before_any_model_loads`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import MPIRUN, ROOT, job_env
from yatt.checkpoint import triggers
from yatt.checkpoint.triggers import EXIT_INTERRUPTED, EXIT_PREEMPTED, Preempted, SaveTriggers
from yatt.config import ConfigError, load_config
from yatt.launch import _check_output_dir, _check_resume_layout
from yatt.paths import check_job_paths
from yatt.run_lock import RunLock, RunLocked, check_free

RECIPE = "configs/grpo_smollm2.yaml"


def _wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_ctrl_c_stops_after_the_step_with_130_and_a_second_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    trig = SaveTriggers(signals=("SIGINT",))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: trig.received is not None)
        assert trig.received == "SIGINT" and trig.check(7) == (True, "SIGINT")  # save this step, then stop
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(lambda: False, timeout=2.0)
    finally:
        trig.close()
    assert signal.getsignal(signal.SIGINT) is before
    assert Preempted(7, "SIGINT").exit_code == EXIT_INTERRUPTED == 130
    assert Preempted(7, "SIGTERM").exit_code == Preempted(7, "SIGUSR1").exit_code == EXIT_PREEMPTED == 75


def test_a_sigterm_after_ctrl_c_is_the_signal_acted_on():
    """Ranks agree on the highest-numbered signal any got (an all-reduce MAX): SIGTERM (15) over
    SIGINT (2), so a batch system's preemption is reported as such (75) whatever came first."""
    trig = SaveTriggers(signals=("SIGINT", "SIGTERM"))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: trig.received is not None)
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(lambda: trig.received == "SIGTERM")
        assert trig.stop_requested() == "SIGTERM"
    finally:
        trig.close()


def test_ctrl_c_during_start_up_is_recorded_not_fatal():
    triggers.catch_early(("SIGINT",))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: triggers._Early.received is not None)
        assert triggers.early_stop_requested() == "SIGINT"
    finally:
        triggers.release_early()


def test_the_run_lock_is_exclusive_names_its_holder_and_dies_with_it(tmp_path):
    check_free(tmp_path / "run")  # no lock file: free
    first = RunLock(tmp_path / "run")
    first.acquire()
    for ask in (RunLock(tmp_path / "run").acquire, lambda: check_free(tmp_path / "run")):
        with pytest.raises(RunLocked, match=rf"another YATT job \(host \S+, rank 0's pid {os.getpid()}, started 20"):
            ask()
    first.release()
    check_free(tmp_path / "run")  # the probe takes nothing: free after, also to a second probe
    check_free(tmp_path / "run")
    RunLock(tmp_path / "run").acquire()  # released: free again (and the second one's fd closes with it)

    # a holder killed by SIGKILL leaves no stale lock: the kernel drops flock with the process
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from yatt.run_lock import RunLock; "
                               f"RunLock({str(tmp_path / 'killed')!r}).acquire(); print('held', flush=True); "
                               "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunLocked, match=f"pid {holder.pid}"):
        RunLock(tmp_path / "killed").acquire()
    holder.kill()
    holder.wait()
    RunLock(tmp_path / "killed").acquire()


def test_path_checks_name_each_key(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cfg = load_config(RECIPE, ["data.source=file", f"data.train_files=[{tmp_path / 'missing.jsonl'}]",
                               f"data.eval_files=[{tmp_path}]", f"output_dir={a_file}",
                               f"checkpoint.dir={a_file / 'ckpt'}",
                               f"eval.sets=[{{name: mine, type: files, files: [{tmp_path / 'gone.jsonl'}]}}]"])
    with pytest.raises(ConfigError) as e:
        check_job_paths(cfg)
    lines = str(e.value).splitlines()
    assert len(lines) == 5, lines
    assert "'data.train_files[0]'" in lines[0] and "does not exist" in lines[0]
    assert "'data.eval_files[0]'" in lines[1] and "is not a file" in lines[1]
    assert "'eval.sets[0].files[0]'" in lines[2] and "does not exist" in lines[2]
    assert "'output_dir'" in lines[3] and "is a file, not a folder" in lines[3]
    assert "'checkpoint.dir'" in lines[4] and "cannot be created" in lines[4]
    check_job_paths(load_config(RECIPE, [f"output_dir={tmp_path / 'new' / 'run'}"]))  # to be created: fine


def test_a_rerun_after_a_run_stopped_before_its_first_checkpoint_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "checkpoints" / "step_000001.tmp").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"stopped before its first checkpoint was committed \(.*step_000001\.tmp "
                                          r"is an unfinished save\).*pass overwrite=true"):
        _check_output_dir(load_config(RECIPE, [f"output_dir={tmp_path}"]))


def test_a_checkpoint_of_another_layout_is_refused_before_any_model_loads(tmp_path):
    """A checkpoint that cannot resume into the job's layout is refused up front, naming ``resume``
    (or ``trainer.lora``) and both layouts: another world size under rollout_apart, another TP or
    PP for LoRA adapters or for optimizer states without names, LoRA where the job trains whole
    (and back). Another world size, TP or PP is resumed otherwise (tests/test_resume.py)."""
    import json

    import torch

    step = tmp_path / "checkpoints" / "step_000002"
    (step / "optim").mkdir(parents=True)
    meta = {"world": 2, "tp": 1, "pp": 1, "lora": {"actor": None}, "config": {"stage": "rl"}}
    (step / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "checkpoints" / "latest").write_text("step_000002\n")
    torch.save({"optimizer": {}, "scheduler": {}, "param_names": [[]]}, step / "optim" / "tp0_pp0.pt")
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}"])
    _check_resume_layout(cfg, 2)  # the same layout
    _check_resume_layout(cfg, 3)  # another world size: resumed
    tp2 = load_config(RECIPE, [f"output_dir={tmp_path}", "trainer.tp=2"])
    _check_resume_layout(tp2, 2)  # another TP: resharded
    with pytest.raises(ConfigError, match=r"rollout_apart .* \(mpirun -np 2\)"):
        _check_resume_layout(load_config(RECIPE, [f"output_dir={tmp_path}", "placement.mode=rollout_apart"]), 3)
    with pytest.raises(ConfigError, match=r"config key 'trainer.lora': .* holds a policy trained whole"):
        _check_resume_layout(load_config(RECIPE, [f"output_dir={tmp_path}", "trainer.lora={}"]), 2)
    _check_resume_layout(load_config(RECIPE, [f"output_dir={tmp_path}", "resume=none", "overwrite=true", "trainer.tp=2"]), 1)
    torch.save({"optimizer": {}, "scheduler": {}}, step / "optim" / "tp0_pp0.pt")  # written before param_names
    with pytest.raises(ConfigError, match=r"config key 'resume': checkpoint .*step_000002 was saved with world size 2, "
                                          r"TP 1, PP 1; this job has world size 2, TP 2, PP 1. It was written before "
                                          r".*trainer.tp=1 trainer.pp=1"):
        _check_resume_layout(tp2, 2)
    _check_resume_layout(cfg, 3)  # its own TP and PP: resumed
    (step / "meta.json").write_text(json.dumps(meta | {"lora": {"actor": {"rank": 8}}}))
    torch.save({"optimizer": {}, "scheduler": {}, "param_names": [[]]}, step / "optim" / "tp0_pp0.pt")
    _check_resume_layout(load_config(RECIPE, [f"output_dir={tmp_path}", "trainer.tp=2", "trainer.lora={}"]), 2)  # resharded


def test_bad_paths_stop_an_mpi_job_before_any_model_loads(tmp_path):
    """Under ``mpirun -np 2`` every bad path of the job is named at once, exit 2, with nothing loaded."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    out = subprocess.run([str(MPIRUN), "-np", "2", sys.executable, "-m", "yatt.launch", "--config",
                          "configs/rm_smollm2.yaml", f"data.train_files=[{tmp_path / 'pairs.jsonl'}]",
                          f"checkpoint.dir={a_file}", f"output_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "config key 'data.train_files[0]'" in out.stderr and "config key 'checkpoint.dir'" in out.stderr
    assert "Traceback" not in out.stderr and "world 2" not in out.stdout + out.stderr  # before torch.distributed
    assert not (tmp_path / "run").exists()
