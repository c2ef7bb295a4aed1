"""The fused kernels wired into the Megatron policy (yatt.trainer.model on CUDA, the logprob
dispatch in yatt.trainer.actor) compute what the unfused policy computes: checked on a tiny model on
the CPU through Triton's interpreter, in a child process (tests/fused_model_check.py) so that
``TRITON_INTERPRET=1`` never reaches this one."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, job_env


def test_policy_with_fused_kernels_equals_the_unfused_policy():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "fused_model_check.py")], capture_output=True,
                         text=True, timeout=600, env=job_env(TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["activation"] == "SwiGLU", result
    assert result["calls"]["rope"] > 0 and result["calls"]["logprob"] > 0, result
    assert result["max_diff"] < 1e-4, result
    plain, fused = result["norm"]
    assert abs(fused - plain) <= 1e-4 * plain, result
