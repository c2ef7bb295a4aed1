"""The Python API under ``mpirun -np 2``, as a user script: one GRPO step of ``MODEL`` (a packaged
model's name or a HF folder; the tests give conftest's tiny random policy) on a 2-stage pipeline
with DAPO dynamic sampling, on a jsonl file of the user's own schema (examples/own_data) scored by
a weighted mix of reward sources: the user's function by import path, a regex match,
math-verify at weight 0 and the parity of the response's characters (a signal for any policy)
(test_e2e checks the run's files; the settings reach the job only through ``Trainer``'s arguments
and overrides).

``python tests/mpi/api_train.py OUTPUT_DIR [MODEL]`` (default ``smollm2-135m-instruct``); rank 0
prints ``api OK <n records>``.
"""
import json
import math
import os
import sys

from yatt import Trainer

out = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m-instruct"
eval_file = f"{out}_eval.jsonl"  # 16 of the held-out problems: the run checks the eval path, not accuracy
with open("examples/own_data/eval.jsonl") as src, open(f"{eval_file}.{os.getpid()}", "w") as dst:
    dst.writelines(src.readlines()[:16])
os.replace(f"{eval_file}.{os.getpid()}", eval_file)  # each rank writes it whole; neither sees a partial file
trainer = Trainer(actor_model=model, reward_model=None, strategy="colocate",
                  recipe="configs/grpo_smollm2.yaml",
                  overrides={"output_dir": out, "trainer.total_steps": 1, "trainer.pp": 2, "rollout.n": 2,
                             "rollout.max_tokens": 24, "data.eval_size": 4, "eval.max_tokens": 16,
                             "algo.dynamic_sampling": True, "algo.max_sampling_rounds": 1,
                             "data.eval_files": [eval_file], "data.question_key": "problem",
                             "data.answer_key": "solution", "reward.accuracy": "correct", "reward.sources": [
                                 {"name": "correct", "type": "function", "path": "examples.own_data.rewards:correct"},
                                 {"name": "digit", "type": "match", "pattern": r"\d", "weight": 0.25},
                                 {"name": "math", "type": "math_verify", "weight": 0.0},
                                 # a signal for any policy, the tiny random one too
                                 {"name": "parity", "type": "function", "path": "tests.reward_fns:parity",
                                  "weight": 0.5}]})
records = trainer.train(dataset="examples/own_data/train.jsonl", batch_size=4, ppo_epochs=1)
if records:  # rank 0
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1], records
    assert all(math.isfinite(v) for r in train for v in r.values() if isinstance(v, float)), train
    for r in train:  # the training reward is the weighted sum of the sources' means; accuracy is 'correct''s
        mix = r["reward_correct_mean"] + 0.25 * r["reward_digit_mean"] + 0.5 * r["reward_parity_mean"]
        assert math.isclose(r["reward_mean"], mix), r
        assert r["accuracy"] == r["reward_correct_mean"] and 0 <= r["reward_math_mean"] <= 1, r
        assert r["reward_correct_errors"] == r["reward_math_errors"] == 0 and r["reward_correct_timeouts"] == 0, r
    on_disk = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in on_disk] == [r["step"] for r in records], (on_disk, records)
    print(f"api OK {len(records)}", flush=True)
