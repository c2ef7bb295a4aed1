"""Placement benchmark: the GenRM recipe in every placement mode, same world, same seeds.

    python bench/placement.py [--np 2] [--steps 6] [--config configs/grpo_smollm2_genrm.yaml]
                              [--modes colocate,apart_sync,apart_async] [--out runs/bench_placement]
                              [override ...]

Runs ``mpirun -np NP python -m yatt.launch`` once per mode (colocate, partial_colocate,
disaggregated) with the same recipe, seed and overrides, colocate once more with
``placement.keep_engines=never`` (every engine torn down and rebuilt around each phase, as before
engines could stay resident), and ``rollout_apart`` (the last rank samples and judges, the others
train) twice: ``apart_sync`` with ``rollout.max_staleness=0`` (samplers wait for each new policy)
and ``apart_async`` with ``rollout.max_staleness=1`` (the next step's batch is sampled while this
one trains), and ``apart_async2`` with 2; ``--modes`` picks a subset. It then reads each run's
``metrics.jsonl`` and averages steps 2 .. N-1 (2 .. N-2 for ``apart_async2``): step 1 pays the
first calls' warm-up and makes ``rollout_apart``'s first batches, and in the last K steps the
samplers have no batch ahead to make. Prints a table of per-phase and per-step seconds and, for
the modes that ran,

    colocate_vs_disaggregated=<step time ratio> partial_vs_colocate_rollout=<ratio>
    colocate_engines_saved_s=<engine switch seconds per step that keeping engines saves>

where the rollout ratio compares the rollout + GenRM phase *including* the engine switches it
needs (CPU: engine teardown/rebuild; the weight push), i.e. ``step - logprob - train - reward``.
The compute-only ratio (``time_rollout_genrm_s``: sampling and judging, no engine switches)
is printed beside it. With both rollout_apart runs it also prints

    async_vs_sync_disaggregated=<apart_async step / apart_sync step> overlap_bound_s=<s>
    async_vs_bound=<apart_async step / overlap_bound_s> colocate_step_s=<s>

where the overlap bound is the larger of the samplers' and the trainers' busy seconds per step in
the synchronous run: what a step costs when either side's work hides the other's entirely.
``async_vs_busier_side`` compares the async step with its own run's busier side, step by step
(1.0: each step's overlap is perfect; above the bound when the sides' work varies from step to
step, as each step waits for that step's slower side). ``apart_async2`` (``rollout.max_staleness=2``)
prints the same line, named ``..._k2``.

``--judge-share X`` runs the rollout_apart modes with ``placement.trainer_judge_share=X`` (the
trainers judge that share of each batch). Without it, and with a judge in the recipe, the
``apart_sync`` run suggests the share that gives both sides the same busy time,
``balanced_judge_share=(rollout + genrm - trainer busy) / (2 genrm)``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from timing import run_job
MODES = ("colocate", "partial_colocate", "disaggregated")
RELEASE = "colocate_release"  # colocate with placement.keep_engines=never
APART = {"apart_sync": 0, "apart_async": 1, "apart_async2": 2}  # rollout_apart, one sampler: rollout.max_staleness
COLUMNS = ("time_rollout_s", "time_genrm_s", "time_rollout_genrm_s", "time_engines_s", "time_sync_s",
           "time_logprob_s", "time_train_s", "idle_s", "time_step_s")


def run_mode(mode: str, args, extra: list[str]) -> tuple[list[dict], float]:
    out = Path(args.out) / mode
    if mode == RELEASE:
        mode, extra = "colocate", ["placement.keep_engines=never", *extra]
    elif mode in APART:
        share = [f"placement.trainer_judge_share={args.judge_share}"] if args.judge_share else []
        mode, extra = "rollout_apart", ["placement.rollout_ranks=1", f"rollout.max_staleness={APART[mode]}", *share,
                                        *extra]
    records, wall = run_job(args.np, ["--config", args.config, f"placement.mode={mode}",
                                      f"trainer.total_steps={args.steps}", f"output_dir={out}", "overwrite=true",
                                      *extra], out, mode)
    return [r for r in records if "time_step_s" in r], wall


def means(steps: list[dict], drain: int = 1) -> dict[str, float]:
    """Means over steps 2 .. N-drain of the run's step records (all of them when fewer)."""
    # step 1 pays first-call warm-up (and fills rollout_apart's pipeline), the last K steps drain it
    # (no batch ahead to make): the steps between are the steady state
    used = steps[1:-drain] if len(steps) > drain + 1 else steps
    out = {k: sum(r.get(k, 0.0) for r in used) / len(used) for k in COLUMNS}
    out["rollout_phase_s"] = out["time_step_s"] - out["time_logprob_s"] - out["time_train_s"] - sum(
        r.get("time_reward_s", 0.0) for r in used) / len(used)
    out["reward_genrm_mean"] = sum(r.get("reward_genrm_mean", 0.0) for r in used) / len(used)
    out["engines_resident"] = used[-1].get("engines_resident", 0.0)
    for side in ("sampler_busy_s", "trainer_busy_s"):  # rollout_apart only
        out[side] = sum(r.get(side, 0.0) for r in used) / len(used)
    # rollout_apart: the busier side's seconds, step by step (what a perfect overlap of each step would take)
    busier = [max(r.get("sampler_busy_s", 0.0), r.get("trainer_busy_s", 0.0)) for r in used]
    out["busier_side_s"] = sum(busier) / len(used)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--config", default="configs/grpo_smollm2_genrm.yaml")
    ap.add_argument("--modes", default=",".join((*MODES, RELEASE, *APART)),
                    help=f"comma-separated subset of {', '.join((*MODES, RELEASE, *APART))}")
    ap.add_argument("--out", default="runs/bench_placement")
    ap.add_argument("--judge-share", type=float, default=0.0,
                    help="rollout_apart modes: placement.trainer_judge_share (0: the samplers judge everything)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides applied to every mode")
    args = ap.parse_args()
    extra = ["data.eval_size=8", *args.overrides]  # evaluation is outside the step; keep it short
    modes = args.modes.split(",")
    if unknown := set(modes) - {*MODES, RELEASE, *APART}:
        ap.error(f"--modes: unknown {sorted(unknown)}")
    results = {}
    for mode in modes:
        steps, wall = run_mode(mode, args, extra)
        results[mode] = means(steps, max(1, APART.get(mode, 1)))
        print(f"  {mode}: {len(steps)} steps, {wall:.0f} s wall", flush=True)
    cols = (*COLUMNS, "rollout_phase_s")
    print(f"\nworld {args.np}, {args.steps} steps per mode, means over steps 2..{args.steps - 1} "
          f"(2..{args.steps - 2} for apart_async2; seconds; phase times"
          " are the max over ranks, idle the mean over ranks)")
    print(f"{'mode':<18}" + "".join(f"{c.removeprefix('time_').removesuffix('_s'):>15}" for c in cols))
    for mode, m in results.items():
        print(f"{mode:<18}" + "".join(f"{m[c]:>15.1f}" for c in cols))
    print_ratios(results)
    if (sync := results.get("apart_sync")) and not args.judge_share and sync["time_genrm_s"] > 0:
        busy = sync["time_rollout_s"] + sync["time_genrm_s"] - sync["trainer_busy_s"]
        print(f"balanced_judge_share={min(max(busy / (2 * sync['time_genrm_s']), 0.0), 0.9):.2f} "
              "(placement.trainer_judge_share that would give both sides the same busy time)")


def print_ratios(results: dict[str, dict[str, float]]) -> None:
    """The summary lines of the modes that ran."""
    co, pa, di, rel = (results.get(m) for m in (*MODES, RELEASE))
    if co and pa:
        print(f"compute-only rollout+GenRM: partial/colocate = "
              f"{pa['time_rollout_genrm_s'] / co['time_rollout_genrm_s']:.3f}")
        print(f"partial_vs_colocate_rollout={pa['rollout_phase_s'] / co['rollout_phase_s']:.3f}")
    if co and di:
        print(f"colocate_vs_disaggregated={co['time_step_s'] / di['time_step_s']:.3f}")
    if co and rel:
        print(f"colocate_engines_saved_s={rel['time_engines_s'] - co['time_engines_s']:.1f} (engines resident in "
              f"colocate: {co['engines_resident']:.0f})")
    if rel and di:
        print(f"colocate_release_vs_disaggregated={rel['time_step_s'] / di['time_step_s']:.3f}")
    sync = results.get("apart_sync")
    for mode, k in (("apart_async", 1), ("apart_async2", 2)):
        if sync and (async_ := results.get(mode)):
            bound = max(sync["sampler_busy_s"], sync["trainer_busy_s"])
            name = "async_vs_sync_disaggregated" + ("" if k == 1 else f"_k{k}")
            print(f"{name}={async_['time_step_s'] / sync['time_step_s']:.3f} "
                  f"overlap_bound_s={bound:.1f} (sampler {sync['sampler_busy_s']:.1f}, trainer "
                  f"{sync['trainer_busy_s']:.1f}) async_vs_bound={async_['time_step_s'] / bound:.3f} "
                  f"async_vs_busier_side={async_['time_step_s'] / async_['busier_side_s']:.3f}"
                  + (f" colocate_step_s={co['time_step_s']:.1f}" if co else ""))

if __name__ == "__main__":
    main()
