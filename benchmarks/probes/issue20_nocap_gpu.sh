#!/usr/bin/env bash
# Issue 20 on one Hopper GPU (~8 minutes): the mods kernels without softcap (`_nocap`, the calls without one), ALiBi by
# rows in the Hopper forward and backward. Builds the mods kernels and the mask kernels of the tests, runs the
# score-mod and mask tests of both kernel families, the window / softcap / ALiBi feature rows, then
# benchmarks/probes/mods_overhead.py (hd128) by default and with FLASHTRAIN_BWD_SM90_MODS_Q80=1 (the backward's
# 80-query blocks; also the window and ALiBi rows), and with CAP_AB=1 FLASHTRAIN_MODS_NOCAP=0 (the softcap variants
# for every call, as before the nocap ones).
#   bash benchmarks/probes/issue20_nocap_gpu.sh [OUT]
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
[ -n "${CAP_AB:-}" ] && FLASHTRAIN_MODS_NOCAP=0 step overhead_cap timeout 100 python benchmarks/probes/mods_overhead.py \
    --seqlens 2048 8192 --out "$OUT/overhead_cap.json"
FLASHTRAIN_BWD_SM90_MODS_Q80=1 step overhead_q80 timeout 100 python benchmarks/probes/mods_overhead.py \
    --seqlens 2048 8192 --head-dims 128 --out "$OUT/overhead_q80.json"
for row in window ALiBi; do
  FLASHTRAIN_BWD_SM90_MODS_Q80=1 step "features_q80_$row" timeout 120 python benchmarks/attention_features.py \
      --repeats 20 --rounds 2 --only "$row" --out "$OUT/attention_features_q80_$row.json"
done
exit $status
