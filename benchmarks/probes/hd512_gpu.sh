#!/usr/bin/env bash
# Issue 20's head dim 512 on one GPU: build every kernel, prebuild the mask kernels (head dims 64 / 128 / 512), the
# tests of head dims 320 / 512 (batch, varlen, GQA, dropout, window / softcap / ALiBi, mask_mod, many tiles) and the
# features' torch.compile test, then head dims 256 / 512 against every SDPA backend, the forward's 64 x 64 tiles as an
# A/B (its own process), and the feature benchmark's hd512 row. Logs in $OUT (default /tmp/hd512).
#   [ALL_CUDA_TESTS=SECONDS] bash benchmarks/probes/hd512_gpu.sh [OUT]   (then every cuda-marked test)
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/hd512 "${1:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
step build python -m flashtrain.kernels.build -j 16
step prebuild python benchmarks/probes/prebuild_mask_mod.py sm_90a
step hd512_tests timeout 420 python -m pytest -q -m cuda --maxfail=10 tests/test_cuda_kernels.py \
    -k "512 or 320 or torch_compile_with_the_features"
step wide timeout 200 python benchmarks/probes/wide_head_dims.py --out "$OUT/wide_head_dims.json"
step wide_64x64 env FLASHTRAIN_FWD_TILES=512=64x64x8x2 timeout 120 python benchmarks/probes/wide_head_dims.py \
    --head-dims 512 --seqlens 4096 --out "$OUT/wide_head_dims_64x64.json"
step features timeout 200 python benchmarks/attention_features.py --repeats 10 --rounds 1 --only "head dim 512" \
    --out "$OUT/attention_features_hd512.json"
[ -n "${ALL_CUDA_TESTS:-}" ] && step cuda_tests timeout "${ALL_CUDA_TESTS}" python -m pytest -q -m cuda tests/
exit $status
