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
    """Write the run's curves to a PNG (default ``RUN_DIR/curves.png``) and return its path: reward
    and accuracy (train samples, held-out greedy eval), KL, entropy, response length, per-phase
    time and grad norm, per step. A metric missing from some record leaves its panel empty.

    Raises:
        FileNotFoundError: no ``RUN_DIR/metrics.jsonl``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = load_records(run_dir)
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    axes = axes.ravel()
    steps = [r["step"] for r in train]

    def curve(ax, key: str, title: str, **style) -> None:
        if train and all(key in r for r in train):
            ax.plot(steps, [r[key] for r in train], marker=".", **style)
        ax.set_title(title)

    curve(axes[0], "reward_mean", "reward and accuracy", label="reward_mean")
    curve(axes[0], "accuracy", "reward and accuracy", label="accuracy (samples)")
    axes[0].plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "s--",
                 label="held-out greedy accuracy")
    curve(axes[1], "kl", "KL", color="tab:red")
    curve(axes[2], "entropy", "entropy (response tokens)", color="tab:purple")
    curve(axes[3], "response_len_mean", "response length (tokens)", color="tab:green")
    for key in ("time_rollout_s", "time_genrm_s", "time_reward_s", "time_logprob_s", "time_train_s",
                "time_sync_s", "time_engines_s"):
        curve(axes[4], key, "phase time (s)", label=key[5:-2])
    curve(axes[5], "grad_norm", "grad norm (pre-clip)", color="tab:gray")
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
