#!/usr/bin/env bash
# Run a YATT recipe on this machine: launch/local.sh NP CONFIG [key=value ...]
# Uses the project's venv (make setup); mpich's mpirun comes from the venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
np="${1:?usage: launch/local.sh NP CONFIG [key=value ...]}"
config="${2:?usage: launch/local.sh NP CONFIG [key=value ...]}"
shift 2
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$root/.venv/bin/mpirun" -np "$np" "$root/.venv/bin/python" -m yatt.launch --config "$config" "$@"
