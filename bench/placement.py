"""Placement benchmark: the GenRM recipe in all three placement modes, same world, same seeds.

    python bench/placement.py [--np 2] [--steps 4] [--config configs/grpo_smollm2_genrm.yaml]
                              [--out runs/bench_placement] [override ...]

Runs ``mpirun -np NP python -m yatt.launch`` once per mode (colocate, partial_colocate,
disaggregated) with the same recipe, seed and overrides, and colocate once more with
``placement.keep_engines=never`` (every engine torn down and rebuilt around each phase, as before
engines could stay resident), then reads each run's ``metrics.jsonl``. Step 1 is dropped from the means (first-call warm-up); the remaining steps
are averaged. Prints a table of per-phase and per-step seconds and a final line

    colocate_vs_disaggregated=<step time ratio> partial_vs_colocate_rollout=<ratio>
    colocate_engines_saved_s=<engine switch seconds per step that keeping engines saves>

where the rollout ratio compares the rollout + GenRM phase *including* the engine switches it
needs (CPU: engine teardown/rebuild; the weight push), i.e. ``step - logprob - train - reward``.
The compute-only ratio (``time_rollout_genrm_s``: sampling and judging, no engine switches)
is printed beside it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from timing import run_job
MODES = ("colocate", "partial_colocate", "disaggregated")
RELEASE = "colocate_release"  # colocate with placement.keep_engines=never
COLUMNS = ("time_rollout_s", "time_genrm_s", "time_rollout_genrm_s", "time_engines_s", "time_sync_s",
           "time_logprob_s", "time_train_s", "idle_s", "time_step_s")


def run_mode(mode: str, args, extra: list[str]) -> tuple[list[dict], float]:
    out = Path(args.out) / mode
    if mode == RELEASE:
        mode, extra = "colocate", ["placement.keep_engines=never", *extra]
    records, wall = run_job(args.np, ["--config", args.config, f"placement.mode={mode}",
                                      f"trainer.total_steps={args.steps}", f"output_dir={out}", "overwrite=true",
                                      *extra], out, mode)
    return [r for r in records if "time_step_s" in r], wall


def means(steps: list[dict]) -> dict[str, float]:
    used = steps[1:] if len(steps) > 1 else steps  # step 1 pays first-call warm-up
    out = {k: sum(r.get(k, 0.0) for r in used) / len(used) for k in COLUMNS}
    out["rollout_phase_s"] = out["time_step_s"] - out["time_logprob_s"] - out["time_train_s"] - sum(
        r.get("time_reward_s", 0.0) for r in used) / len(used)
    out["reward_genrm_mean"] = sum(r.get("reward_genrm_mean", 0.0) for r in used) / len(used)
    out["engines_resident"] = used[-1].get("engines_resident", 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--config", default="configs/grpo_smollm2_genrm.yaml")
    ap.add_argument("--out", default="runs/bench_placement")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every mode")
    args = ap.parse_args()
    extra = ["data.eval_size=8", *args.overrides]  # evaluation is outside the step; keep it short
    results = {}
    for mode in (*MODES, RELEASE):
        steps, wall = run_mode(mode, args, extra)
        results[mode] = means(steps)
        print(f"  {mode}: {len(steps)} steps, {wall:.0f} s wall", flush=True)
    cols = (*COLUMNS, "rollout_phase_s")
    print(f"\nworld {args.np}, {args.steps} steps per mode, means over steps 2..{args.steps} (seconds; phase times"
          " are the max over ranks, idle the mean over ranks)")
    print(f"{'mode':<18}" + "".join(f"{c.removeprefix('time_').removesuffix('_s'):>15}" for c in cols))
    for mode, m in results.items():
        print(f"{mode:<18}" + "".join(f"{m[c]:>15.1f}" for c in cols))
    co, pa, di, rel = (results[m] for m in (*MODES, RELEASE))
    print(f"compute-only rollout+GenRM: partial/colocate = {pa['time_rollout_genrm_s'] / co['time_rollout_genrm_s']:.3f}")
    print(f"colocate_vs_disaggregated={co['time_step_s'] / di['time_step_s']:.3f} "
          f"partial_vs_colocate_rollout={pa['rollout_phase_s'] / co['rollout_phase_s']:.3f}")
    print(f"colocate_engines_saved_s={rel['time_engines_s'] - co['time_engines_s']:.1f} (engines resident in colocate: "
          f"{co['engines_resident']:.0f}; colocate_release_vs_disaggregated={rel['time_step_s'] / di['time_step_s']:.3f})")


if __name__ == "__main__":
    main()
