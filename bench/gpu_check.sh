#!/usr/bin/env bash
# The one prepared GPU run (issue 37): everything YATT claims on a GPU, measured against a reference
# in the same run, in about 4.5 minutes on one H200. From the repository root:
#
#     bash bench/gpu_check.sh            # on a GPU machine (torch with CUDA, nvcc)
#     bash bench/gpu_check.sh --dry-run  # anywhere: the same scripts on the CPU with tiny shapes
#
# megatron-core 0.16.1 must be importable; where it is not and a wheel lies in .whl/, it is installed
# into a temporary folder first (the GPU machine has no package index). Logs and profiles go to
# $OUT (the device tool's output folder) or gpu_check_out/.
#
# 1. builds yatt._C with CUDA (csrc/copy_blocks.cu) into the working tree;
# 2. tests/test_fused_kernels.py -m gpu: the Triton kernels compiled for the GPU against their torch
#    references (if they fail, the rest runs with YATT_FUSED=0: torch's unfused code);
# 3. bench/gpu_trainer.py: the trainer against transformers (train step, logprob pass, MFU, peak
#    memory) for three model shapes, and the weight sync against a device-to-device copy;
# 4. bench/gpu_packing.py: packed and shared-prompt rows against padded rows on a GRPO-shaped batch;
# 5. bench/reshard_gpu.py: the CUDA copy kernel bit-equal to the CPU kernel; its speed against a
#    device-to-device copy, flat and for three t -> i reshardings;
# 6. bench/gpu_check.py: the Megatron policy in bf16 against transformers' logprobs and grad norm,
#    and the packed layouts against padded rows (fp32).
# Each step has a time limit, and a failed step does not stop the others. The last lines repeat
# every ratio, one per line (measured 2026-12-04 on an H200: docs/gpu.md). Without CUDA (or with
# --dry-run) steps 1, 2 and 5 are skipped and 3, 4 and 6 run on the CPU with tiny shapes, side by
# side: a check that the scripts run, not a measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
LOG=${OUT:-gpu_check_out}
mkdir -p "$LOG"
DRY=()
if [ "${1:-}" = "--dry-run" ] || ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    DRY=(--dry-run)
fi
# (found, not imported: its import takes ~5 s)
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("megatron.core") is None)' 2>/dev/null \
    && compgen -G ".whl/megatron_core-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/yatt-site .whl/megatron_core-*.whl
    export PYTHONPATH=/tmp/yatt-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
FAILED=()
run() {  # run NAME CMD...: output to the terminal and to $LOG/NAME.log; a failure is noted, the rest still runs
    echo "== $1 ($(date +%T))"
    local name=$1
    shift
    "$@" 2>&1 | tee "$LOG/$name.log" || FAILED+=("$name")
}
if [ ${#DRY[@]} -eq 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
    echo "== 1. yatt._C with CUDA ($(date +%T))"
    YATT_WITH_CUDA=1 YATT_CUDA_ARCHS=${YATT_CUDA_ARCHS:-90} "$PY" -m pip install --no-build-isolation --no-deps -e . \
        > /tmp/yatt_build.log 2>&1 || { tail -30 /tmp/yatt_build.log; exit 1; }
    "$PY" -c 'from yatt import _C; assert _C.with_cuda; print("yatt._C built with CUDA")'
    run 2.kernels timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_kernels.py
    if [[ " ${FAILED[*]} " == *" 2.kernels "* ]]; then
        echo "fused kernels failed: the rest runs torch's unfused code (YATT_FUSED=0)"
        export YATT_FUSED=0
    fi
else
    echo "== dry run: no CUDA build (1), no kernel checks (2, 5); steps 3, 4 and 6 on the CPU with tiny shapes"
fi
if [ ${#DRY[@]} -eq 0 ]; then
    run 3.trainer timeout 300 "$PY" bench/gpu_trainer.py --profile "$LOG"
    run 4.packing timeout 240 "$PY" bench/gpu_packing.py --profile "$LOG"
    run 5.reshard timeout 150 "$PY" bench/reshard_gpu.py --repeats 20
    run 6.correctness timeout 150 "$PY" bench/gpu_check.py
else  # a dry run times nothing that means anything: its three CPU steps run side by side, each log printed after
    PIDS=()
    for step in "3.trainer bench/gpu_trainer.py --profile $LOG --dry-run" "4.packing bench/gpu_packing.py --profile $LOG --dry-run" \
                "6.correctness bench/gpu_check.py"; do
        read -r -a args <<<"$step"
        timeout 300 "$PY" "${args[@]:1}" >"$LOG/${args[0]}.log" 2>&1 &
        PIDS+=("$!:${args[0]}")
    done
    for job in "${PIDS[@]}"; do
        wait "${job%%:*}" || FAILED+=("${job#*:}")
        echo "== ${job#*:}"
        cat "$LOG/${job#*:}.log"
    done
fi
echo "== ratios ($(date +%T))"
cat "$LOG"/*.log | grep -E '^(gpu_[a-z0-9_]+=|gpu_check )' || true
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${FAILED[*]}"
    exit 1
fi
