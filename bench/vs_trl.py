"""YATT against TRL's GRPOTrainer on the same GRPO work, both measured in one run of this script.

    make bench-trl                      # installs bench/requirements-trl.txt, then runs this
    python bench/vs_trl.py [--steps 4] [--out runs/bench_vs_trl] [--skip-trl]

The work of one step, for both: 8 prompts x 4 samples x at most 64 new tokens (temperature 1),
SmolLM2-135M-Instruct in fp32 (the packaged model, the same HF folder), the demo's reasoning-gym
``basic_arithmetic`` prompts and rule reward (``yatt.reward.rule.RuleReward``), no KL term (beta 0,
no reference model), one AdamW step over the 32 responses at lr 1e-5.

- reference: TRL's ``GRPOTrainer`` (transformers ``generate`` for the rollout, HF forward/backward),
  one process with a thread per core (how it runs on a workstation without a GPU).
- YATT: ``mpirun -np 2 python -m yatt.launch`` with the demo recipe set to that work (vLLM rollout,
  Megatron-Core training, DP=2 with one thread per rank), checkpoints and eval off.

Step 1 of each is warm-up and left out; the printed times are medians of the other steps (TRL:
from ``on_step_begin`` to ``on_step_end``, generation included; YATT: ``time_step_s``). The last
line is ``trl_vs_yatt_step_time=<TRL s/step over YATT s/step>`` (above 1: YATT is faster). Mean
response lengths are printed beside them: the two policies sample their own responses, so the
token counts differ a little; the line before the last, ``trl_vs_yatt_per_response_token``, is
the same ratio per mean response token (each run's seconds per step over its mean response length).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS, SAMPLES, MAX_TOKENS, LR = 8, 4, 64, 1e-5


def trl_steps(steps: int, out: Path) -> tuple[list[float], list[float]]:
    """Run TRL's GRPOTrainer for ``steps`` steps; returns (seconds per step, mean response length per step)."""
    import reasoning_gym as rg
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from yatt.assets.model import resolve_model
    from yatt.config import load_config
    from yatt.reward.rule import RuleReward

    cfg = load_config(ROOT / "configs" / "grpo_smollm2.yaml")
    torch.set_num_threads(os.cpu_count() or 1)
    rows = rg.create_dataset(cfg.data.task, size=cfg.data.train_size, seed=cfg.data.seed, **cfg.data.task_config)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                               "entry": json.dumps({"question": r["question"], "answer": r["answer"],
                                                    "metadata": r["metadata"]})} for r in rows])
    rule = RuleReward(cfg.data.task, cfg.reward.extract, cfg.data.task_config)

    def reward(completions, entry, **_):
        return [rule(c[0]["content"], json.loads(e)) for c, e in zip(completions, entry)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._t0 = [], 0.0

        def on_step_begin(self, *args, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

    model = str(resolve_model(cfg.model.path))
    args = GRPOConfig(output_dir=str(out / "trl"), max_steps=steps, per_device_train_batch_size=PROMPTS * SAMPLES,
                      num_generations=SAMPLES, max_completion_length=MAX_TOKENS, temperature=1.0, learning_rate=LR,
                      lr_scheduler_type="constant", beta=0.0, num_iterations=1, gradient_accumulation_steps=1,
                      use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", report_to="none",
                      seed=cfg.seed, model_init_kwargs={"dtype": torch.float32}, dataloader_num_workers=0)
    timer = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[timer])
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return timer.times, lengths


def yatt_steps(steps: int, out: Path, np: int) -> tuple[list[float], list[dict]]:
    """Run YATT's demo recipe set to the same work; returns (time_step_s per step, the step records)."""
    run = out / "yatt"
    cmd = [str(Path(sys.prefix) / "bin" / "mpirun"), "-np", str(np), sys.executable, "-m", "yatt.launch",
           "--config", "configs/grpo_smollm2.yaml", f"trainer.total_steps={steps}", f"output_dir={run}",
           "overwrite=true", f"trainer.prompts_per_rank={PROMPTS // np}", f"rollout.n={SAMPLES}",
           f"rollout.max_tokens={MAX_TOKENS}", f"trainer.lr={LR}", f"trainer.min_lr={LR}", "algo.mini_batches=1",
           "data.eval_size=0", "checkpoint.every_steps=0", "checkpoint.every_minutes=0",
           "checkpoint.save_final=false", "log.progress=false"]
    print("+", " ".join(cmd[3:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"yatt failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "time_step_s" in r]
    return [r["time_step_s"] for r in train], train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="steps of each run (the first is left out)")
    ap.add_argument("--np", type=int, default=2, help="YATT ranks")
    ap.add_argument("--out", default="runs/bench_vs_trl")
    ap.add_argument("--skip-trl", action="store_true", help="YATT only (no ratio)")
    args = ap.parse_args()
    out = ROOT / args.out
    y_times, y_records = yatt_steps(args.steps, out, args.np)  # first: TRL's threads would linger in this process
    y = statistics.median(y_times[1:])
    phases = {k: statistics.median(r[k] for r in y_records[1:]) for k in ("time_rollout_s", "time_train_s",
                                                                            "time_sync_s", "time_balance_s")}
    y_len = statistics.mean(r["response_len_mean"] for r in y_records[1:])
    print(f"yatt: {y:.1f} s/step (steps {[round(t, 1) for t in y_times]}); rollout {phases['time_rollout_s']:.1f} "
          f"train {phases['time_train_s']:.1f} sync {phases['time_sync_s']:.2f} balance {phases['time_balance_s']:.2f};"
          f" mean response {y_len:.1f} tokens", flush=True)
    if args.skip_trl:
        return
    t_times, t_lengths = trl_steps(args.steps, out)
    t = statistics.median(t_times[1:])
    t_len = statistics.mean(t_lengths[1:]) if len(t_lengths) > 1 else float("nan")
    print(f"trl:  {t:.1f} s/step (steps {[round(x, 1) for x in t_times]}); mean response {t_len:.1f} tokens")
    print(f"trl_vs_yatt_per_response_token={(t / t_len) / (y / y_len):.2f}")  # seconds per mean response token
    print(f"trl_vs_yatt_step_time={t / y:.2f}")


if __name__ == "__main__":
    main()
