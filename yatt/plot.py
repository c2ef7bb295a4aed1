"""Plot a run's curves: ``python -m yatt.plot RUN_DIR [--out FILE]`` writes a PNG;
``python -m yatt.plot RUN_DIR RUN_DIR ... [--labels A,B,...] --out FILE`` compares runs.

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
    return _finish(fig, axes, Path(out) if out else Path(run_dir) / "curves.png")


def _finish(fig, axes, out: Path) -> Path:
    """Step x-axes (integer ticks), grids and legends where a panel has labelled lines; the figure
    saved to ``out`` and closed. Returns ``out``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


COMPARED = (("reward_mean", "training reward"), ("eval_accuracy", "held-out greedy accuracy"),
            ("rollout_kl", "rollout KL (k3, rollout || old)"), ("is_weight_mean", "IS weight, mean"),
            ("is_ratio_max", "IS ratio pi_old / pi_rollout, max"), ("staleness_mean", "staleness (updates)"),
            ("turns_mean", "model turns per episode"), ("eval_tool_use", "held-out tool use (greedy)"))


def panels(runs: list[list[dict]]) -> list[tuple[str, str]]:
    """The :data:`COMPARED` ``(metric, title)`` panels that at least one run of ``runs`` (each a
    list of records) has a value for, in that order; the training reward always."""
    return [(k, t) for k, t in COMPARED if k == "reward_mean" or any(k in r for records in runs for r in records)]


def compare(run_dirs: list[str | Path], labels: list[str], out: str | Path) -> Path:
    """Write one PNG comparing runs, one line per run in each panel of :data:`COMPARED` (training
    reward, held-out accuracy, rollout KL, IS weight statistics, staleness, episode turns and tool
    use) per step; a panel no run has a value for is left out (:func:`panels`), and a run without
    a metric leaves no line in its panel.

    Raises:
        FileNotFoundError: a run without ``metrics.jsonl``. ValueError: not one label per run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [load_records(run_dir) for run_dir in run_dirs]
    shown = panels(runs)
    cols = min(3, len(shown))
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13 * cols / 3, 3.5 * rows), squeeze=False)
    for ax in axes.ravel()[len(shown):]:
        ax.set_visible(False)
    for i, (records, label) in enumerate(zip(runs, labels)):
        for ax, (key, _) in zip(axes.ravel(), shown):
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:  # one color per run in every panel
                ax.plot(*zip(*points), marker="s" if key.startswith("eval_") else ".", label=label, color=f"C{i % 10}")
    for ax, (_, title) in zip(axes.ravel(), shown):
        ax.set_title(title)
    return _finish(fig, axes.ravel()[:len(shown)], Path(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="+")
    ap.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/curves.png; required to compare)")
    ap.add_argument("--labels", default=None, help="comma-separated, one per run (default: the folder names)")
    args = ap.parse_args()
    if len(args.run_dir) == 1:
        print(plot(args.run_dir[0], args.out))
        return
    if args.out is None:
        ap.error("--out: give the PNG to write when comparing runs")
    labels = args.labels.split(",") if args.labels else [Path(d).name for d in args.run_dir]
    if len(labels) != len(args.run_dir):
        ap.error(f"--labels: {len(labels)} labels for {len(args.run_dir)} runs")
    print(compare(args.run_dir, labels, args.out))


if __name__ == "__main__":
    main()
