"""The Python API under ``mpirun -np 2``: a 1-step GRPO run of the demo model, as a user script.

``python tests/mpi/api_train.py OUTPUT_DIR``; rank 0 prints ``api OK <n records>``.
"""
import json
import math
import sys

from yatt import Trainer

out = sys.argv[1]
trainer = Trainer(actor_model="smollm2-135m-instruct", reward_model=None, strategy="colocate",
                  recipe="configs/grpo_smollm2.yaml",
                  overrides={"output_dir": out, "trainer.total_steps": 1, "rollout.n": 4, "rollout.max_tokens": 24,
                             "data.eval_size": 8, "eval.max_tokens": 16, "checkpoint.save_final": False})
records = trainer.train(dataset="basic_arithmetic", batch_size=4, ppo_epochs=1)
if records:  # rank 0
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1], records
    assert all(math.isfinite(v) for k, v in train[0].items() if isinstance(v, float)), train[0]
    on_disk = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in on_disk] == [r["step"] for r in records], (on_disk, records)
    print(f"api OK {len(records)}", flush=True)
