"""python -m yatt.plot on a real run's metrics (the demo's metrics.jsonl, 2026-11-30)."""
import shutil
import subprocess
import sys

import matplotlib.image
import pytest

from conftest import ROOT
from yatt.plot import load_records, plot

METRICS = ROOT / "tests" / "data" / "grpo_smollm2_metrics.jsonl"


def test_plot_command_writes_a_png_of_every_panel(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(METRICS, run / "metrics.jsonl")
    out = subprocess.run([sys.executable, "-m", "yatt.plot", str(run)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    png = run / "curves.png"
    assert out.stdout.strip() == str(png) and png.stat().st_size > 20_000
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 1000 and image[..., :3].std() > 0.05  # not blank
    records = load_records(run)
    assert len([r for r in records if "reward_mean" in r]) == 20 and "kl" in records[1] and "entropy" in records[1]


def test_plot_without_metrics_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        plot(tmp_path)
