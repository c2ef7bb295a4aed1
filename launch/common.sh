# shellcheck shell=bash
# Helpers of the launch scripts (sourced). DRY_RUN=1: print the command instead of running it.

run() {
    if [[ -n "${DRY_RUN:-}" ]]; then
        printf '%q ' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# Run the job step; when yatt exits 75 (a signal's checkpoint is saved) requeue the Slurm job.
run_and_requeue() {
    local rc=0
    run "$@" || rc=$?
    if [[ "$rc" -eq 75 && -n "${SLURM_JOB_ID:-}" ]]; then
        echo "yatt saved a checkpoint and stopped (exit 75): requeueing job $SLURM_JOB_ID" >&2
        run scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$rc"
}
