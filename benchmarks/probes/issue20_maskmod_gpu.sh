#!/usr/bin/env bash
# Issue 20's GPU checks of the mask-expression kernels (one GPU): build, prebuild the tests' and the benchmark's mask
# kernels in parallel (both families), the mask_mod tests, the block states' cost, then the feature rows against
# FlexAttention. Logs in $OUT (default /tmp/issue20_maskmod); every step runs, the exit status says whether any
# failed.
#   [ALL_CUDA_TESTS=SECONDS] bash benchmarks/probes/issue20_maskmod_gpu.sh [OUT]   (then every cuda-marked test)
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue20_maskmod "${1:-}"
step build python -m flashtrain.kernels.build -j 16
step prebuild python benchmarks/probes/prebuild_mask_mod.py sm_90a
step mask_tests timeout 200 python -m pytest -q -m cuda --maxfail=10 tests/test_mask_mod.py tests/test_cuda_kernels.py \
    -k "mask_mod or block_states or error_word or out_of_range"
step states timeout 60 python benchmarks/probes/mask_states_time.py
step features timeout 240 python benchmarks/attention_features.py --repeats 10 --rounds 1 \
    --out "$OUT/attention_features.json"
[ -n "${ALL_CUDA_TESTS:-}" ] && step cuda_tests timeout "${ALL_CUDA_TESTS}" python -m pytest -q -m cuda tests/
exit $status
