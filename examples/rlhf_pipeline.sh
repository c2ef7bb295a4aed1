#!/usr/bin/env bash
# The RLHF pipeline on the demo task, stage after stage, each feeding the next by path:
#   1. SFT of SmolLM2-135M-Instruct            -> runs/sft_smollm2/export
#   2. preference pairs from the SFT model      -> runs/pairs/{train,eval}.jsonl
#   3. a Bradley-Terry reward model on them     -> runs/rm_qwen/export (a reward_model source; the body of
#      Qwen2.5-Coder-0.5B-Instruct, TP=2; RM_CONFIG=configs/rm_smollm2.yaml: SmolLM2's, faster, weaker)
#   4. DPO of the SFT model on them             -> runs/dpo_smollm2
#   5. GRPO of the SFT model with the trained reward model, alone and mixed with the task's rule
#
#   examples/rlhf_pipeline.sh            # the recipes' settings (about 40 min on our 2-core machine)
#   QUICK=1 examples/rlhf_pipeline.sh    # a few steps per stage, to check the chain (9 min 6 s on 2026-12-03)
#
# Run from the repository root after `make setup`. NP sets the ranks (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
NP="${NP:-2}"
PY=.venv/bin/python
RUN=(.venv/bin/mpirun -np "$NP" "$PY" -m yatt.launch)
if [[ "${QUICK:-0}" == 1 ]]; then
  SFT=(trainer.total_steps=4 data.eval_size=24) PAIRS=(data.train_size=48 data.eval_size=48)
  RM=(trainer.total_steps=3) DPO=(trainer.total_steps=3) RL=(trainer.total_steps=2 data.eval_size=24)
else
  SFT=() PAIRS=(data.train_size=240) RM=() DPO=() RL=(trainer.total_steps=10)
fi
COMMON=(overwrite=true log.progress=false)

"${RUN[@]}" --config configs/sft_smollm2.yaml "${COMMON[@]}" "${SFT[@]}"
"$PY" -m yatt.export runs/sft_smollm2/checkpoints runs/sft_smollm2/export --overwrite

"$PY" -m yatt.stages.pairs --config configs/sft_smollm2.yaml --model runs/sft_smollm2/export --out runs/pairs \
  --max-tokens 48 "${PAIRS[@]}"

RM_CONFIG="${RM_CONFIG:-configs/rm_qwen.yaml}"
RM_DIR="runs/$(basename "$RM_CONFIG" .yaml)"
"${RUN[@]}" --config "$RM_CONFIG" "${COMMON[@]}" "${RM[@]}"
"$PY" -m yatt.export "$RM_DIR/checkpoints" "$RM_DIR/export" --role critic --overwrite

"${RUN[@]}" --config configs/dpo_smollm2.yaml "${COMMON[@]}" "${DPO[@]}"

RM_SOURCE="{name: rm, type: reward_model, model: $RM_DIR/export}"
"${RUN[@]}" --config configs/grpo_smollm2.yaml "${COMMON[@]}" "${RL[@]}" model.path=runs/sft_smollm2/export \
  output_dir=runs/grpo_rm "reward.sources=[$RM_SOURCE]"
"${RUN[@]}" --config configs/grpo_smollm2.yaml "${COMMON[@]}" "${RL[@]}" model.path=runs/sft_smollm2/export \
  output_dir=runs/grpo_rm_rule "reward.sources=[{name: rule, type: rule, weight: 1.0}, ${RM_SOURCE%\}}, weight: 0.5}]" \
  reward.accuracy=rule
echo "rlhf_pipeline: done (runs/sft_smollm2, runs/pairs, $RM_DIR, runs/dpo_smollm2, runs/grpo_rm, runs/grpo_rm_rule)"
