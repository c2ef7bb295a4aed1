"""launch/: every script passes shellcheck, prints the command it would run (DRY_RUN=1), and the
Slurm scripts requeue the job when yatt exits 75 (a signal's checkpoint saved). Slurm and PBS
are not on the dev machines: their commands are stand-ins on PATH that record their arguments."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

SCRIPTS = sorted((ROOT / "launch").glob("*.s*"))  # *.sh, *.sbatch
PY = f"{ROOT}/.venv/bin/python"


def _bash(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "YATT_ROOT": str(ROOT), **(env or {})}
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_SUBMIT_DIR", "PBS_NODEFILE", "PBS_O_WORKDIR"):
        if k not in (env or {}):
            full.pop(k, None)
    return subprocess.run(["bash", str(ROOT / "launch" / script), *args], env=full, capture_output=True,
                          text=True, timeout=60)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\necho \"{name} $*\" >> \"{bin_dir}/calls\"\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_scripts_pass_shellcheck():
    assert {p.name for p in SCRIPTS} >= {"local.sh", "common.sh", "slurm_1node.sbatch", "slurm_multinode.sbatch",
                                          "pbs.sh"}
    out = subprocess.run([str(Path(sys.executable).parent / "shellcheck"), "-x", *map(str, SCRIPTS)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", ["slurm_1node.sbatch", "slurm_multinode.sbatch"])
def test_slurm_dry_run_prints_the_srun_command(script):
    out = _bash(script, "configs/grpo_smollm2.yaml", "trainer.total_steps=1", env={"DRY_RUN": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"srun --kill-on-bad-exit=1 --cpu-bind=cores {PY} -m yatt.launch "
                                  "--config configs/grpo_smollm2.yaml log.progress=false trainer.total_steps=1")


def test_pbs_dry_run_uses_the_node_file(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("n1\nn1\nn2\n")
    env = {"DRY_RUN": "1", "CONFIG": "configs/grpo_smollm2.yaml", "ARGS": "trainer.total_steps=1 seed=3"}
    out = _bash("pbs.sh", env={**env, "PBS_NODEFILE": str(nodes)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"{ROOT}/.venv/bin/mpirun -np 3 -f {nodes} {PY} -m yatt.launch "
                                  "--config configs/grpo_smollm2.yaml log.progress=false trainer.total_steps=1 seed=3")
    assert "-np 2 " in _bash("pbs.sh", env=env).stdout  # outside PBS: NP (default 2), no host file
    missing = _bash("pbs.sh", env={"DRY_RUN": "1"})
    assert missing.returncode != 0 and "set CONFIG" in missing.stderr


@pytest.mark.parametrize("rc,requeued", [(75, True), (0, False), (3, False)])
def test_slurm_requeues_only_after_a_preemption_save(tmp_path, rc, requeued):
    _fake(tmp_path, "srun", f'echo "MASTER_ADDR=${{MASTER_ADDR:-}}" >> "{tmp_path}/calls"; exit {rc}')
    _fake(tmp_path, "scontrol", 'if [[ "$1" == show ]]; then printf "node7\\nnode8\\n"; fi')
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[7-8]"}
    out = _bash("slurm_multinode.sbatch", "configs/grpo_smollm2.yaml", env=env)
    assert out.returncode == rc
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "scontrol show hostnames node[7-8]" and "MASTER_ADDR=node7" in calls
    assert ("scontrol requeue 4242" in calls) == requeued
