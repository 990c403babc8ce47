#!/bin/bash
# Probe: correctness and same-process speed of the kernels' A/B switches (FT_* macros) on one GPU, in one call of at
# most ~570 s: the GPU suite and memcheck with every switch on, then forward / backward A/Bs (default vs each switch,
# cuDNN in the same process, the order reversed every other round). Writes logs under ${OUT:-/tmp/switch_ab}.
# racecheck is left to the validation call of the chosen defaults (it takes ~150 s).
#
#   FWD_SWITCHES="FT_A=1 FT_B=0" BWD_SWITCHES="FT_C=1" bash benchmarks/probes/switch_ab.sh [FT_A=1,FT_B=0,FT_C=1]
#   (the argument: the GPU suite's macros, default every switch not set to 0; default switches:
#   FT_FWD_L2_PREFETCH, prepared 2026-11-25, and two of that day's defaults turned off)
set -u
out=${OUT:-/tmp/switch_ab}
mkdir -p "$out"
read -r -a fwd_switches <<< "${FWD_SWITCHES:-FT_FWD_L2_PREFETCH=1 FT_FWD_HALF_FIRST=0}"
read -r -a bwd_switches <<< "${BWD_SWITCHES:-FT_BWD_SKIP_HIDDEN=0}"
all=${1:-$(printf '%s\n' "${fwd_switches[@]}" "${bwd_switches[@]}" | grep -v '=0$' | sort -u | paste -sd,)}
probed='sm90_hdim(64|128)_bf16(_causal)?(_det|_192x128)?$'  # the kernels the A/Bs below run
date -u
python -m flashtrain.kernels.build -j 8 > "$out/build.log" 2>&1 &
FLASHTRAIN_EXTRA_DEFINES=$all python -m flashtrain.kernels.build -j 8 > "$out/build_switches.log" 2>&1
echo "build (switches) rc $?"
wait
echo "build rc $?"
# each switch alone (the A/B variants), compiled in the background while the tests run
fwd_all=$(IFS=,; echo "${fwd_switches[*]}")
bwd_all=$(IFS=,; echo "${bwd_switches[*]}")
for sw in $(printf '%s\n' "${fwd_switches[@]}" "${bwd_switches[@]}" | sort -u) "$fwd_all" "$bwd_all"; do
    FLASHTRAIN_EXTRA_DEFINES=$sw python -m flashtrain.kernels.build -j 2 --only "$probed" > "$out/build_$sw.log" 2>&1 &
done
date -u
FLASHTRAIN_EXTRA_DEFINES=$all timeout 150 python -m pytest -q -m cuda tests/test_cuda_kernels.py \
    tests/test_attention_variants.py tests/test_block_sparse_cuda.py tests/test_deterministic_cuda.py \
    > "$out/tests.log" 2>&1
echo "tests (switches) rc $?: $(tail -1 "$out/tests.log")"
FLASHTRAIN_EXTRA_DEFINES=$all timeout 90 compute-sanitizer --tool memcheck --report-api-errors no \
    python tests/test_cuda_kernels.py > "$out/memcheck.log" 2>&1
echo "memcheck rc $?: $(tail -1 "$out/memcheck.log")"
wait
date -u
impls=(flashtrain)
for sw in "${fwd_switches[@]}"; do impls+=("flashtrain+$sw"); done
impls+=("flashtrain+${fwd_all//,/+}")
timeout 130 python benchmarks/probes/sm90_fwd_probe.py --no-check --rounds 4 --seqlens 512 1024 4096 \
    --impls "${impls[@]}" cudnn > "$out/fwd_ab.txt" 2>&1
echo "forward A/B rc $?"
date -u
impls=(flashtrain)
for sw in "${bwd_switches[@]}"; do impls+=("flashtrain+$sw"); done
impls+=("flashtrain+${bwd_all//,/+}")
timeout 130 python benchmarks/probes/sm90_bwd_probe.py --no-check --rounds 4 --seqlens 1024 4096 16384 \
    --impls "${impls[@]}" cudnn > "$out/bwd_ab.txt" 2>&1
echo "backward A/B rc $?"
date -u
