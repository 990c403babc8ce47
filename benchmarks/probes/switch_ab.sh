#!/bin/bash
# Probe: correctness, racecheck and same-process speed of the kernels' A/B switches (FT_* macros) on one GPU, in one
# call: the GPU suite and compute-sanitizer with the switches on, then forward / backward A/Bs (default vs each switch,
# cuDNN in the same process, the order reversed every other round). Writes logs under ${OUT:-/tmp/switch_ab}.
#
#   bash benchmarks/probes/switch_ab.sh [FT_A=1,FT_B=1 ...]   (default: the switches prepared 2026-11-25)
set -u
out=${OUT:-/tmp/switch_ab}
mkdir -p "$out"
fwd_switches=(FT_FWD_MASK_SHARED=1 FT_DESC_ADD=1 FT_FWD_TILE_RECORD=1)
bwd_switches=(FT_DESC_ADD=1 FT_BWD_WALK_INC=1 FT_BWD_NAMED_HANDOFF=1)
all=${1:-FT_DESC_ADD=1,FT_FWD_MASK_SHARED=1,FT_FWD_TILE_RECORD=1,FT_BWD_WALK_INC=1,FT_BWD_NAMED_HANDOFF=1}
date -u
python -m flashtrain.kernels.build -j 16 > "$out/build.log" 2>&1; echo "build rc $?"
FLASHTRAIN_EXTRA_DEFINES=$all python -m flashtrain.kernels.build -j 16 > "$out/build_switches.log" 2>&1
echo "build (switches) rc $?"
# each switch alone (the A/B variants), compiled in the background while the tests run
for sw in $(printf '%s\n' "${fwd_switches[@]}" "${bwd_switches[@]}" | sort -u); do
    FLASHTRAIN_EXTRA_DEFINES=$sw python -m flashtrain.kernels.build -j 3 > "$out/build_$sw.log" 2>&1 &
done
FLASHTRAIN_EXTRA_DEFINES=$all timeout 200 python -m pytest -q -m cuda tests/test_cuda_kernels.py \
    tests/test_attention_variants.py tests/test_block_sparse_cuda.py tests/test_deterministic_cuda.py \
    > "$out/tests.log" 2>&1
echo "tests (switches) rc $?: $(tail -1 "$out/tests.log")"
FLASHTRAIN_EXTRA_DEFINES=$all timeout 100 compute-sanitizer --tool memcheck --report-api-errors no \
    python tests/test_cuda_kernels.py > "$out/memcheck.log" 2>&1
echo "memcheck rc $?: $(tail -1 "$out/memcheck.log")"
FLASHTRAIN_EXTRA_DEFINES=$all timeout 150 compute-sanitizer --tool racecheck --report-api-errors no \
    python tests/test_cuda_kernels.py > "$out/racecheck.log" 2>&1
echo "racecheck rc $?: $(tail -1 "$out/racecheck.log")"
wait
date -u
impls=(flashtrain)
for sw in "${fwd_switches[@]}"; do impls+=("flashtrain+$sw"); done
timeout 200 python benchmarks/probes/sm90_fwd_probe.py --no-check --rounds 4 --seqlens 512 1024 4096 16384 \
    --impls "${impls[@]}" cudnn > "$out/fwd_ab.txt" 2>&1
echo "forward A/B rc $?"
impls=(flashtrain)
for sw in "${bwd_switches[@]}"; do impls+=("flashtrain+$sw"); done
timeout 200 python benchmarks/probes/sm90_bwd_probe.py --no-check --rounds 4 --seqlens 1024 4096 16384 \
    --impls "${impls[@]}" cudnn > "$out/bwd_ab.txt" 2>&1
echo "backward A/B rc $?"
date -u
