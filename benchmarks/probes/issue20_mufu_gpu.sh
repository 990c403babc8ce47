#!/usr/bin/env bash
# Branch issue20-mufu-alibi on one Hopper GPU (~4 minutes with a cold kernel cache): softcap's tanh on f16x2 (forward
# and Hopper backward) and the Hopper forward's ALiBi by rows. Builds the kernels these touch, runs the score-mod tests
# of every head dim on both kernel families, then the softcap and ALiBi feature rows (their per-tile ratio against
# plain attention in the same run: the record is softcap 0.768 / 0.813, ALiBi 0.888 / 0.854, forward / fwd+bwd).
#   bash benchmarks/probes/issue20_mufu_gpu.sh [OUT]
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue20_mufu "${1:-}"
step build python -m flashtrain.kernels.build -j 16 --only '_mods$|hdim128_bf16_causal$|flash_aux'
step tests timeout 300 python -m pytest -q -m cuda tests/test_cuda_kernels.py \
    -k "window_softcap_and_alibi or torch_compile_with_the_features"
for row in softcap ALiBi; do
  step "features_$row" timeout 150 python benchmarks/attention_features.py --repeats 20 --rounds 2 --only "$row" \
      --out "$OUT/attention_features_$row.json"
done
exit $status
