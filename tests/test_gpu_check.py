"""bench/gpu_check.sh, the one prepared GPU run, as a CPU dry run: every script it runs (correctness
against transformers, the trainer against transformers, the sync, the packed layouts) starts, runs the
same code on the CPU with tiny shapes, and prints each ratio line (numbers that say nothing about a GPU)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, job_env

RATIOS = ("gpu_train_vs_hf", "gpu_logprob_vs_hf", "gpu_mfu", "gpu_sync_vs_d2d", "gpu_packed_vs_padded",
          "gpu_packed_only_vs_padded")


def test_gpu_check_dry_run_prints_every_ratio(tmp_path):
    shellcheck = Path(sys.executable).parent / "shellcheck"
    lint = subprocess.run([str(shellcheck), str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=job_env(PY=sys.executable, OUT=str(tmp_path)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tail = out.stdout[out.stdout.index("== ratios"):]
    values = dict(line.split("=", 1) for line in tail.splitlines() if line.startswith("gpu_") and "=" in line)
    for name in RATIOS:
        assert name in values, tail
        assert math.isfinite(float(values[name].split()[0])), (name, values[name])
    assert "gpu_check device=cpu" in tail
    assert (tmp_path / "4.packing.log").exists()
