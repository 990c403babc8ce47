#!/usr/bin/env bash
# Issue 20's GPU checks of the mask-expression kernels (one GPU): build, prebuild the tests' mask kernels in
# parallel, the mask_mod tests and the score-mod / opcheck / compile tests, the block states' cost. Logs in $OUT
# (default /tmp/issue20_maskmod); every step runs, the exit status says whether any failed.
#   bash benchmarks/probes/issue20_maskmod_gpu.sh [OUT]
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue20_maskmod "${1:-}"
step build python -m flashtrain.kernels.build -j 16
step prebuild python benchmarks/probes/prebuild_mask_mod.py sm_90a
step mask_tests timeout 240 python -m pytest -q -m cuda --maxfail=6 tests/test_mask_mod.py tests/test_cuda_kernels.py \
    -k "mask_mod or block_states or error_word or opcheck or compile_with_score or window_softcap"
step states timeout 60 python benchmarks/probes/mask_states_time.py
exit $status
