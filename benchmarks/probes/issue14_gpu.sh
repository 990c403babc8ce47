#!/usr/bin/env bash
# Issue 14's GPU checks in one go (one GPU; about 10-15 minutes on an H200 with a cold kernel cache). Logs and
# results land in $OUT (default /tmp/issue14); each step runs even when an earlier one fails, and the exit status
# says whether any failed.
#   bash benchmarks/probes/issue14_gpu.sh [OUT]
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue14 "${1:-}"
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
step doctor python -m flashtrain.kernels.doctor
step sync_free python -m pytest -q -m cuda tests/test_sync_free_cuda.py
step compile_modes python -m pytest -q -m cuda tests/test_compile_modes_cuda.py
step cuda_tests python -m pytest -q -m cuda $XDIST tests/
step cuda_tests_99kb env FLASHTRAIN_MAX_SMEM=99K FLASHTRAIN_SM90=0 python -m pytest -q -m cuda $XDIST tests/
step host_overhead python benchmarks/host_overhead.py --calls 100 --rounds 2 --out "$OUT/host_overhead.json"
step memcheck compute-sanitizer --tool memcheck --report-api-errors no python tests/test_cuda_kernels.py
step racecheck compute-sanitizer --tool racecheck python tests/test_cuda_kernels.py
step compile_modes_tokens python benchmarks/train_gpt2.py --impls flashtrain flashtrain-compile \
    flashtrain-reduce-overhead flashtrain-max-autotune --models small --seq-lens 1024 --out "$OUT/train_gpt2_modes.json"
exit $status
