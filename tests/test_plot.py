"""python -m yatt.plot on a real run's metrics (the demo's metrics.jsonl, 2026-11-30)."""
import json
import shutil
import subprocess
import sys

import matplotlib.image
import pytest

from conftest import ROOT
from yatt.plot import compare, load_records, panels, plot

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


def test_compare_writes_one_png_of_several_runs(tmp_path):
    """Two runs (the demo's records, the second with IS statistics added): one line per run where a
    run has the metric."""
    runs = [tmp_path / "sync", tmp_path / "async"]
    for run in runs:
        run.mkdir()
        shutil.copy(METRICS, run / "metrics.jsonl")
    rows = [json.loads(line) for line in METRICS.read_text().splitlines()]
    (runs[1] / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "is_weight_mean": 1.0, "is_ratio_max": 1.2, "rollout_kl": 1e-3} if "reward_mean" in r else r)
        + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "yatt.plot", *map(str, runs), "--labels", "K=0,K=1",
                          "--out", str(tmp_path / "cmp.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    image = matplotlib.image.imread(tmp_path / "cmp.png")
    assert image.shape[0] > 500 and image[..., :3].std() > 0.05
    # panels no run has a value for (staleness, episode turns, tool use) are left out
    shown = [k for k, _ in panels([load_records(run) for run in runs])]
    assert shown == ["reward_mean", "eval_accuracy", "rollout_kl", "is_weight_mean", "is_ratio_max"]
    assert [k for k, _ in panels([[{"step": 1, "turns_mean": 2.0}]])] == ["reward_mean", "turns_mean"]
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        compare(runs, ["one"], tmp_path / "x.png")
    usage_errors = (([], "--out: give the PNG"), (["--labels", "one", "--out", "x.png"], "--labels: 1 labels for 2"))
    for extra, says in usage_errors:
        bad = subprocess.run([sys.executable, "-m", "yatt.plot", *map(str, runs), *extra], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr
