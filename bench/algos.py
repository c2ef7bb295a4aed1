"""Algorithm benchmark: the demo task trained with each estimator / loss of the algorithm layer.

    python bench/algos.py [--np 2] [--steps 20] [--algos grpo,dr_grpo,rloo,reinforce_pp,gspo,ppo]
                          [--out runs/bench_algos] [override ...]

Runs ``mpirun -np NP python -m yatt.launch`` once per algorithm, one after another, with the same
seed, data, model and sample budget (32 responses per rank per step), then reads each run's
``metrics.jsonl`` and prints one table: held-out accuracy before and after (greedy, the recipe's
eval set), the mean reward of the first and last 5 steps, seconds per step (mean over steps 2..N:
step 1 pays first-call warm-ups) and the peak resident memory of a rank (GiB, the max over phases
and ranks). The algorithms (docs/algorithms.md):

- grpo: configs/grpo_smollm2.yaml as is (GRPO, DAPO's clip-higher and token-mean loss);
- dr_grpo: Dr. GRPO's advantage (no std division) and its constant-length aggregation;
- rloo: the leave-one-out baseline;
- reinforce_pp: REINFORCE++ (no baseline; KL in the token rewards, beta 0.01; a reference model);
- gspo: GSPO's sequence-level ratio with the sequence-mean aggregation;
- ppo: configs/ppo_smollm2.yaml (GAE over a critic, KL in reward, entropy bonus; 8 prompts x 4).

Overrides after the options apply to every run (``trainer.total_steps`` is ``--steps``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from timing import run_job
GRPO, PPO = "configs/grpo_smollm2.yaml", "configs/ppo_smollm2.yaml"
ALGOS = {
    "grpo": (GRPO, []),
    "dr_grpo": (GRPO, ["algo.estimator=dr_grpo", "algo.loss_agg=seq_mean_token_sum_norm"]),
    "rloo": (GRPO, ["algo.estimator=rloo"]),
    "reinforce_pp": (GRPO, ["algo.estimator=reinforce_pp", "algo.kl_in_reward=0.01"]),
    "gspo": (GRPO, ["algo.policy_loss=gspo", "algo.loss_agg=seq_mean_token_mean"]),
    "ppo": (PPO, []),
}


def run(name: str, args, extra: list[str]) -> tuple[list[dict], float]:
    """One run of algorithm ``name``; returns (its metric records, wall seconds)."""
    config, overrides = ALGOS[name]
    out = Path(args.out) / name
    return run_job(args.np, ["--config", config, *overrides, f"trainer.total_steps={args.steps}", f"output_dir={out}",
                             "overwrite=true", "log.progress=false", *extra], out, name)


def summary(records: list[dict]) -> dict[str, float]:
    """The table's row of one run's records."""
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    timed = train[1:] if len(train) > 1 else train

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    return {"eval_before": evals[0]["eval_accuracy"], "eval_after": evals[-1]["eval_accuracy"],
            "reward_first5": mean(train[:5], "reward_mean"), "reward_last5": mean(train[-5:], "reward_mean"),
            "s_per_step": mean(timed, "time_step_s"),
            "peak_gib": max(v for r in train for k, v in r.items() if k.startswith("mem_peak_")),
            "explained_variance_last5": (mean(train[-5:], "explained_variance")
                                         if "explained_variance" in train[-1] else float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--algos", default=",".join(ALGOS), help=f"comma-separated, of {', '.join(ALGOS)}")
    ap.add_argument("--out", default="runs/bench_algos")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every run")
    args = ap.parse_args()
    names = args.algos.split(",")
    if unknown := sorted(set(names) - set(ALGOS)):
        sys.exit(f"--algos: unknown {unknown}; of {sorted(ALGOS)}")
    rows = {}
    for name in names:
        records, wall = run(name, args, args.overrides)
        rows[name] = summary(records)
        print(f"  {name}: {wall:.0f} s wall", flush=True)
    cols = ("eval_before", "eval_after", "reward_first5", "reward_last5", "s_per_step", "peak_gib",
            "explained_variance_last5")
    print(f"\nworld {args.np}, {args.steps} steps each; s_per_step: mean over steps 2..{args.steps}; peak_gib: "
          "resident memory of the largest rank")
    print(f"{'algo':<14}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<14}" + "".join(f"{row[c]:>{len(c) + 2}.3f}" for c in cols))


if __name__ == "__main__":
    main()
