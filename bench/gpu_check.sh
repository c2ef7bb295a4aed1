#!/usr/bin/env bash
# The GPU check (issue 18, item 8), one prepared run on a lent GPU machine (torch with CUDA, nvcc,
# mpi4py; no vLLM, no internet: carry a megatron-core 0.16.1 wheel and install it first, e.g.
# `pip install --no-deps wheels/megatron_core-0.16.1-*.whl`). From the repository root:
#
#     bash bench/gpu_check.sh
#
# 1. builds yatt._C with CUDA (csrc/copy_blocks.cu) into the working tree;
# 2. bench/reshard_gpu.py: the CUDA copy kernel bit-equal to the CPU kernel, and its bandwidth
#    against a device-to-device copy of the same bytes (gpu_reshard_vs_d2d=...);
# 3. bench/gpu_check.py: the Megatron policy in bf16 on the GPU against transformers' logprobs,
#    one training step over NCCL (grad norm), and the packed layouts against padded rows.
# Without CUDA (a dry run on a CPU machine) steps 1-2 are skipped with a message and step 3 runs
# the same code on the CPU in fp32 over gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "== 1. yatt._C with CUDA"
    YATT_WITH_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -e . > gpu_check_build.log 2>&1 \
        || { tail -30 gpu_check_build.log; exit 1; }
    "$PY" -c 'from yatt import _C; assert _C.with_cuda; print("yatt._C built with CUDA")'
    echo "== 2. resharding kernel"
    "$PY" bench/reshard_gpu.py --repeats 20
else
    echo "== no CUDA device: skipping the CUDA build (1) and the kernel check (2); step 3 runs on the CPU"
fi
echo "== 3. Megatron policy, training step, packing"
"$PY" bench/gpu_check.py
