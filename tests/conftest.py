"""Shared test helpers: launching a script or a YATT job under ``mpirun`` from pytest, and the
one demo-recipe run that several test files check (``demo_run``)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.prefix) / "bin" / "mpirun"


def _mpi_script(name: str):
    """``tests/mpi/<name>.py`` as a module (its reference helpers, imported once per session)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "mpi" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


trainer_tp = _mpi_script("trainer_tp")  # tiny HF models and the HF references of the trainer tests

# Set by yatt.dist / torch.distributed in this pytest process: a child rank that inherits
# MASTER_PORT would try to join this process's (world 1) store.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# MPICH busy-polls while a rank waits, so a job with more ranks than cores (-np 3 and 4 on our 2) spends
# cores spinning: yielding at every poll took tests/mpi/dp_balance.py at -np 4 from 30 s to 23 s (sys 24 -> 10 s).
_JOB_ENV = {"OMP_NUM_THREADS": "1", "MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a job a test starts: this one without torch.distributed's or an MPI
    launcher's variables (pytest itself may hold them), one thread per rank, the repo on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV and not k.startswith(("PMI_", "PMIX_", "OMPI_"))}
    env.update(_JOB_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def pytest_collection_modifyitems(items) -> None:
    """Tiers: users of the ``mpirun``, ``shared_job``, ``hosted`` and ``demo_run`` fixtures start
    multi-process jobs (``mpi``); every test marked neither ``mpi`` nor ``e2e`` runs in this process
    (``unit``)."""
    for item in items:
        if {"mpirun", "shared_job", "demo_run", "hosted"} & set(item.fixturenames):
            item.add_marker(pytest.mark.mpi)
        if not any(item.get_closest_marker(m) for m in ("mpi", "e2e")):
            item.add_marker(pytest.mark.unit)


SHM = Path("/dev/shm")


def _mpich_segments() -> set[Path]:
    return set(SHM.glob("mpich_shm_*")) if SHM.is_dir() else set()


def _mapped_segments() -> set[str]:
    """The MPICH shared-memory files some live process maps."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split()[-1] for line in maps.read_text().splitlines() if "/mpich_shm_" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    return mapped


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_shared_memory():
    """Remove, at the end of the session, the MPICH shared-memory files (``/dev/shm``, RAM) that the
    session's jobs left behind and no live process maps: a rank killed by a signal, as the resume and
    watchdog tests kill them on purpose, never unlinks its segment (measured: 188 files, 381 MB after
    a few suite runs on the dev machine)."""
    before = _mpich_segments()
    yield
    mapped = _mapped_segments()
    for f in _mpich_segments() - before:
        if str(f) not in mapped:
            f.unlink(missing_ok=True)


def run_mpi(args: list[str], ranks: int, timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
    """``mpirun -np ranks python *args`` from the repo root, one thread per rank; fails the test on a
    non-zero exit, with the output's tail. ``args`` is the argv after ``python`` (a script path or
    ``-m module ...``)."""
    cmd = [str(MPIRUN), "-np", str(ranks), sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(**extra_env), capture_output=True, text=True, timeout=timeout)
    tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{tail}"
    return proc


@pytest.fixture
def mpirun():
    """``mpirun(args, ranks, timeout=600, **env) -> CompletedProcess``: :func:`run_mpi`."""
    return run_mpi


# tests/mpi scripts that share one mpirun job per world size (tests/mpi/in_one_job.py: one after
# another in the same processes, so the ~10 s start of a job is paid once, not once per script).
# Each script checks its own properties and prints its own OK lines; the tests read them.
SHARED_JOBS = {
    "ranks_2": (2, ["sync_onpolicy", "push_apart", "reshard_sync:tp", "reshard_sync:pp", "rollout_dp",
                    "trainer_tp:dp", "dp_balance:train", "genrm_dp", "estimator_contract", "zero_signal",
                    "checkpoint_memory", "lora_tp", "rollout_tp:2"]),
    "ranks_3": (3, ["trainer_tp:tp", "trainer_tp:subgroup"]),
    "ranks_4": (4, ["data_memory", "dp_balance"]),
}


@pytest.fixture(scope="session")
def shared_job():
    """``shared_job(name) -> stdout`` of the :data:`SHARED_JOBS` job ``name``, run once per session on
    first use. A failed or timed-out job fails every test that reads it, each with the job's output
    tail, and is not run again."""
    outputs: dict[str, str | Exception] = {}

    def get(name: str) -> str:
        if name not in outputs:
            ranks, scripts = SHARED_JOBS[name]
            try:
                outputs[name] = run_mpi(["tests/mpi/in_one_job.py", *scripts], ranks, timeout=1200).stdout
            except (AssertionError, subprocess.TimeoutExpired) as e:
                outputs[name] = e
        if isinstance(outputs[name], Exception):
            pytest.fail(f"shared job {name} failed: {outputs[name]}")
        return outputs[name]

    return get


def write_jsonl(path: Path, rows: list) -> str:
    """``rows`` (dicts as JSON, strings as they are: a malformed line) one per line into ``path``; its path."""
    path.write_text("".join(f"{r if isinstance(r, str) else json.dumps(r)}\n" for r in rows))
    return str(path)


@dataclass(frozen=True)
class JobSpec:
    """A whole YATT job for :func:`run_jobs`: ``python -m yatt.launch --config config overrides...``
    (``output_dir`` is the job's own folder), after each ``(src, dst)`` of ``copy`` has been copied
    (a folder or a file: a resumed run's checkpoint and metrics from a job before it). ``hook``:
    ``(module, *args)``, a patch of YATT for this job only: ``tests/mpi/<module>.py``'s
    ``install(*args)`` runs before the job and the callable it returns after it."""

    config: str
    overrides: list[str]
    copy: tuple[tuple[Path, Path], ...] = ()
    hook: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostedJob:
    """A YATT job that ran in a :func:`run_jobs` host: its output folder, its exit code and its log
    (every rank's stdout and stderr, as ``mpirun`` merges them)."""

    out: Path
    code: int
    log: str


def run_jobs(jobs: dict[str, JobSpec], folder: Path, ranks: int = 2, timeout: int = 1200) -> dict[str, HostedJob]:
    """Whole YATT jobs, one after another in one ``mpirun -np ranks`` job (``tests/mpi/jobs_in_one.py``:
    the ~10 s of imports per rank paid once), each into ``folder/<name>``, its log in
    ``folder/<name>.log`` (the host's own lines, each job's exit code and seconds, in
    ``folder/host.log``). Fails the test when the host itself fails (a job that raises aborts it),
    with the output's tail; a job's own exit code is the caller's to check (3: not run, a ``copy``
    source was missing)."""
    listing = [{"name": n, "config": j.config, "overrides": [*j.overrides, f"output_dir={folder / n}"],
                "copy": [[str(a), str(b)] for a, b in j.copy], "hook": list(j.hook), "log": str(folder / f"{n}.log")}
               for n, j in jobs.items()]
    (folder / "jobs.json").write_text(json.dumps(listing))
    try:
        host = run_mpi(["tests/mpi/jobs_in_one.py", folder / "jobs.json"], ranks, timeout=timeout)
        (folder / "host.log").write_text(host.stdout)  # each job's exit code and seconds
    except AssertionError as e:
        logs = "".join(f"\n--- {n}.log\n{(folder / f'{n}.log').read_text()[-3000:]}" for n in jobs
                       if (folder / f"{n}.log").exists())
        raise AssertionError(f"{e}{logs}") from None
    return {n: HostedJob(folder / n, int((folder / f"{n}.log.code").read_text()), (folder / f"{n}.log").read_text())
            for n in jobs}


@dataclass(frozen=True)
class TinyModels:
    """conftest's tiny random models (``tiny_policy``, ``tiny_rm``, ``tiny_judge``), for job builders."""

    policy: Path
    rm: Path
    judge: Path


# test module name -> its builder of whole 2-rank jobs (``@hosted_jobs``), all run in one host
HOSTED_JOBS: dict[str, Callable[[Path, TinyModels], dict[str, JobSpec]]] = {}


def hosted_jobs(builder: Callable[[Path, TinyModels], dict[str, JobSpec]]):
    """Decorator: registers a test module's ``builder(root, models) -> {name: JobSpec}``, whole jobs
    under ``mpirun -np 2`` that the :func:`hosted` fixture runs together with every other module's
    in one :func:`run_jobs` host (one interpreter start and import per rank for all of them; they
    run in the builders' order, so a job may resume from a job before it). Names are suite-wide."""
    HOSTED_JOBS[builder.__module__] = builder
    return builder


def resume_from(ref: Path, run: Path, step: int) -> tuple[tuple[Path, Path], ...]:
    """Make ``run`` a folder that resumes (``resume=auto``) from ``ref``'s step-``step`` checkpoint:
    writes ``run/checkpoints/latest`` and returns the ``(src, dst)`` copies still to make (that
    checkpoint and ``ref``'s whole metrics.jsonl, the later steps included: the resumed run must cut
    them), for when ``ref`` has run (:func:`copy_paths`, or a :class:`JobSpec`'s ``copy``)."""
    ckpt = Path("checkpoints") / f"step_{step:06d}"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text(f"{ckpt.name}\n")
    return (ref / ckpt, run / ckpt), (ref / "metrics.jsonl", run / "metrics.jsonl")


def copy_paths(pairs) -> None:
    """Copy each ``(src, dst)``: a folder or a file."""
    for src, dst in pairs:
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)


def resumed_pair(root: Path, name: str, config: str, overrides: list[str], step: int) -> dict[str, JobSpec]:
    """Two jobs for a :func:`hosted_jobs` builder: ``<name>_ref``, a whole run, then ``<name>_run``,
    the same job resumed from ``<name>_ref``'s step-``step`` checkpoint (:func:`resume_from`)."""
    ref, run = root / f"{name}_ref", root / f"{name}_run"
    copy = resume_from(ref, run, step)
    return {ref.name: JobSpec(config, overrides), run.name: JobSpec(config, overrides, copy=copy)}


# metrics that differ between runs of the same samples: timings, waits, memory and throughput
TIMING = ("time_", "mem_peak_", "idle_", "tokens_per_s")


def metric_records(out: Path, drop: tuple[str, ...] = TIMING) -> list[dict]:
    """The records of ``out/metrics.jsonl``, without the metrics whose names start with ``drop``."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


@pytest.fixture(scope="session")
def hosted(request, tmp_path_factory, tiny_policy, tiny_rm, tiny_judge):
    """``hosted(name) -> HostedJob``: the job ``name`` of a :func:`hosted_jobs` builder, which exited 0.
    On first use, the jobs of every module with a selected test that uses this fixture run in one
    host; a failed host fails every test that reads it, each with the output's tail, and is not run
    again; a job that exited otherwise fails each test that reads it, with its log's tail."""
    state: dict[str, object] = {}

    def get(name: str) -> HostedJob:
        if not state:
            wanted = {item.module.__name__ for item in request.session.items if "hosted" in item.fixturenames}
            root, models, jobs = tmp_path_factory.mktemp("hosted"), TinyModels(tiny_policy, tiny_rm, tiny_judge), {}
            for module, build in HOSTED_JOBS.items():
                if module in wanted:
                    more = build(root, models)
                    assert not jobs.keys() & more.keys(), f"{module}: job names taken: {jobs.keys() & more.keys()}"
                    jobs |= more
            try:
                state["jobs"] = run_jobs(jobs, root, timeout=1800)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                state["jobs"] = e
        if isinstance(state["jobs"], Exception):
            pytest.fail(f"the hosted jobs failed: {state['jobs']}")
        job = state["jobs"][name]
        if job.code != 0:
            pytest.fail(f"hosted job {name} exited {job.code}\n{job.log[-4000:]}")
        return job

    return get


@pytest.fixture(scope="session")
def world1():
    """torch.distributed, Megatron's parallel state (TP=1, PP=1) and its RNG tracker (as a
    ``MegatronPolicy`` sets them up) for a world of one rank, in this process."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from yatt.dist import init_distributed
    from yatt.trainer.actor import init_parallel_state

    info = init_distributed()
    assert info.world_size == 1
    init_parallel_state(1, 1)
    with torch.random.fork_rng(devices=[]):
        model_parallel_cuda_manual_seed(1234)
    return info


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of ``<run_dir>/tensorboard`` as TensorBoard's own reader sees
    it (purged steps dropped; every event kept, not TensorBoard's default sample)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


# -- YATT jobs in the background (a test may signal or kill them) -----------------------------

# The demo recipe, smaller: 4 steps of 1 prompt x 2 samples per rank, a checkpoint every step;
# 3 prompts per rank, so step 4 crosses the data's epoch boundary.
DEMO_ARGS = ("trainer.total_steps=4", "trainer.prompts_per_rank=1", "rollout.n=2", "rollout.max_tokens=24",
             "data.train_size=6", "data.eval_size=4", "eval.max_tokens=16", "checkpoint.every_steps=1")
DEMO_RECIPE = "configs/grpo_smollm2.yaml"
DEMO_EVAL_SET = "eval.sets=[{name: chain, type: task, task: chain_sum, size: 4}]"  # a named set besides data's


def launch_job(out: Path, *extra: str, script: str | None = None) -> subprocess.Popen:
    """``mpirun -np 2`` of the demo recipe with :data:`DEMO_ARGS` into ``out`` (``python -m yatt.launch``,
    or ``script`` given the same arguments), stdout and stderr appended to ``<out>.log``; the job runs
    in a session of its own (see :func:`kill_job`)."""
    entry = [script] if script else ["-m", "yatt.launch"]
    cmd = [str(MPIRUN), "-np", "2", sys.executable, *entry, "--config", DEMO_RECIPE, *DEMO_ARGS,
           f"output_dir={out}", *extra]
    log = open(out.parent / f"{out.name}.log", "ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_job(proc: subprocess.Popen, until=None, timeout: float = 400) -> int | None:
    """Wait for the job to end (its exit code) or for ``until()`` to hold (None); kills the job
    and fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until is not None and until():
            return None
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.05)
    kill_job(proc)
    pytest.fail("the job did not reach the expected point in time")


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL mpirun and every rank (hydra starts each rank in a session of its own)."""
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in reversed(procs):
        p.kill()
    psutil.wait_procs(procs, timeout=30)
    proc.wait()


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with SmolLM2's tokenizer (tests/mpi/trainer_tp.py's ``save_tiny_vllm``),
    for whole jobs whose property is not the model's."""
    path = tmp_path_factory.mktemp("tiny_policy")
    trainer_tp.save_tiny_vllm(path, tied=True)
    return path


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory) -> Path:
    """A tiny random one-label Qwen2 sequence classifier (a reward model) with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp("tiny_rm")
    trainer_tp.save_tiny_reward_model(path)
    return path


@pytest.fixture(scope="session")
def tiny_judge(tmp_path_factory) -> Path:
    """A tiny random Qwen2 judge (SmolLM2's tokenizer) whose output layer favours the yes/no tokens
    (their rows scaled x20), so they are among its top logprobs and P(yes) is read for every
    judgement; what it says is random."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from yatt.reward.genrm import yes_no_token_ids

    path = tmp_path_factory.mktemp("tiny_judge")
    trainer_tp.save_tiny_vllm(path, tied=False, max_position_embeddings=2048)  # judge prompts hold question and answer
    yes, no = yes_no_token_ids(AutoTokenizer.from_pretrained(path))
    state = load_file(path / "model.safetensors")
    head = state["lm_head.weight"]
    rows = torch.tensor(sorted(yes | no))
    head[rows] *= 20.0
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@dataclass(frozen=True)
class DemoRun:
    """A finished 2-step demo run: its output folder and its log (both ranks' stdout + stderr)."""

    out: Path
    log: str
    shm_left: set[Path]  # MPICH /dev/shm files the run created and left behind


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """One run of the demo recipe (:data:`DEMO_ARGS`, 2 steps) on the demo model, started once per
    session and shared: test_e2e's data-parallel run, test_logs' log, test_trackers' three trackers
    (TensorBoard, W&B offline, an MLflow file store), test_eval_cli's checkpoint and named eval set. It goes through
    ``tests/mpi/planted_warnings.py``, which runs ``yatt.launch.main`` unchanged and then plants two
    warnings that need action (the run's metrics and files are those of ``python -m yatt.launch``)."""
    out = tmp_path_factory.mktemp("demo") / "ref"
    before = _mpich_segments()
    code = wait_job(launch_job(out, "trainer.total_steps=2", "checkpoint.every_steps=0",  # the final save only
                               "log.trackers=[tensorboard,wandb,mlflow]", "log.wandb.mode=offline", DEMO_EVAL_SET,
                               script="tests/mpi/planted_warnings.py"))
    log = (out.parent / "ref.log").read_text()
    assert code == 0, log[-4000:]
    return DemoRun(out, log, _mpich_segments() - before)
