"""Plot a run's curves: ``python -m yatt.plot RUN_DIR [--out FILE]`` writes a PNG.

Reads ``RUN_DIR/metrics.jsonl``: training records (with ``reward_mean``) and eval records
(with ``eval_accuracy``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_records(run_dir: str | Path) -> list[dict]:
    """Metric records of a run, in file order. Raises FileNotFoundError without metrics.jsonl."""
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write reward/accuracy curves (train) and held-out greedy accuracy (eval) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = load_records(run_dir)
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in train]
    axes[0].plot(steps, [r["reward_mean"] for r in train], marker=".", label="reward_mean")
    axes[0].plot(steps, [r["accuracy"] for r in train], marker=".", label="accuracy (samples)")
    axes[0].plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "s--", label="held-out greedy accuracy")
    axes[0].set_title("reward")
    axes[1].plot(steps, [r["response_len_mean"] for r in train], marker=".", color="tab:green")
    axes[1].set_title("response length (tokens)")
    for key in ("time_rollout_s", "time_genrm_s", "time_reward_s", "time_logprob_s", "time_train_s",
                "time_sync_s", "time_engines_s"):
        if train and all(key in r for r in train):
            axes[2].plot(steps, [r[key] for r in train], marker=".", label=key[5:-2])
    axes[2].set_title("phase time (s)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(plot(args.run_dir, args.out))


if __name__ == "__main__":
    main()
