#!/usr/bin/env bash
# Issue 20 on one Hopper GPU (~6 minutes): the score-modification kernels as of 2026-11-28 (`_nocap` variants for the
# calls without softcap, ALiBi by rows, the hd128 causal backward's 80-query blocks). Builds the mods kernels and the
# tests' mask kernels, runs the score-mod and mask tests of both kernel families, the window / softcap / ALiBi feature
# rows, then benchmarks/probes/mods_overhead.py (hd128); with CAP_AB=1 also under FLASHTRAIN_MODS_NOCAP=0 (the
# softcap variants for every call, as before the nocap ones).
#   [CAP_AB=1] bash benchmarks/probes/issue20_nocap_gpu.sh [OUT]
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue20_nocap "${1:-}"
step build python -m flashtrain.kernels.build -j 16 --only '_mods|hdim(64|128)_bf16_causal|flash_aux'
step prebuild python benchmarks/probes/prebuild_mask_mod.py sm_90a
step tests timeout 300 python -m pytest -q -m cuda --maxfail=10 tests/test_cuda_kernels.py tests/test_mask_mod.py \
    tests/test_host_layer_cuda.py -k "window_softcap_and_alibi or torch_compile_with_the_features or mask_mod or \
block_states or error_word or out_of_range or mods or features"
for row in window softcap ALiBi; do
  step "features_$row" timeout 120 python benchmarks/attention_features.py --repeats 20 --rounds 2 --only "$row" \
      --out "$OUT/attention_features_$row.json"
done
step overhead timeout 100 python benchmarks/probes/mods_overhead.py --seqlens 2048 8192 --head-dims 128 \
    --out "$OUT/overhead.json"
if [ -n "${CAP_AB:-}" ]; then
  FLASHTRAIN_MODS_NOCAP=0 step overhead_cap timeout 100 python benchmarks/probes/mods_overhead.py --seqlens 2048 8192 \
      --head-dims 128 --out "$OUT/overhead_cap.json"
fi
exit $status
