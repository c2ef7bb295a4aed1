#!/usr/bin/env bash
# YATT under PBS Pro / OpenPBS with MPICH's mpirun over the allocated slots:
#   qsub -v CONFIG=configs/grpo_smollm2.yaml,ARGS="trainer.total_steps=50" launch/pbs.sh
# Dry run (prints the command, needs no PBS):  DRY_RUN=1 CONFIG=... NP=2 bash launch/pbs.sh
# One rank per line of $PBS_NODEFILE (mpiprocs per chunk = GPUs per node). Exit 75: yatt saved a
# checkpoint after SIGTERM; resubmit and it resumes (resume=auto).
#PBS -N yatt
#PBS -l select=2:ncpus=64:ngpus=8:mpiprocs=8
#PBS -l walltime=24:00:00
#PBS -j oe
set -euo pipefail
root="${YATT_ROOT:-${PBS_O_WORKDIR:-$(cd "$(dirname "$0")/.." && pwd)}}"
config="${CONFIG:?set CONFIG, e.g. qsub -v CONFIG=configs/grpo_smollm2.yaml launch/pbs.sh}"
# shellcheck source=launch/common.sh
source "$root/launch/common.sh"
read -r -a args <<< "${ARGS:-}"
if [[ -n "${PBS_NODEFILE:-}" ]]; then
    np="$(wc -l < "$PBS_NODEFILE")"
    hosts=(-f "$PBS_NODEFILE")
else
    np="${NP:-2}"
    hosts=()
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# log.progress=false: tqdm's redraws would clutter the job's log file (a later log.progress=true wins)
run "$root/.venv/bin/mpirun" -np "$np" "${hosts[@]}" \
    "$root/.venv/bin/python" -m yatt.launch --config "$config" log.progress=false "${args[@]}"
