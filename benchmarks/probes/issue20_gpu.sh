#!/usr/bin/env bash
# Issue 20's GPU checks of the score-modification kernels in one go (one GPU, ~8 minutes on an H200 with a warm kernel
# cache): the new kernels' tests first (window / softcap / ALiBi, odd head dims), then every cuda-marked test, then
# the feature rows against FlexAttention. Logs and results land in $OUT (default /tmp/issue20); each step runs even
# when an earlier one fails, and the exit status says whether any failed.
#   bash benchmarks/probes/issue20_gpu.sh [OUT]
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue20 "${1:-}"
step build python -m flashtrain.kernels.build -j 16
step new_kernels python -m pytest -q -m cuda -x tests/test_cuda_kernels.py \
    -k "window_softcap_and_alibi or off_the_multiples_of_8"
step cuda_tests timeout 420 python -m pytest -q -m cuda tests/
step features python benchmarks/attention_features.py --repeats 10 --rounds 1 --out "$OUT/attention_features.json"
exit $status
