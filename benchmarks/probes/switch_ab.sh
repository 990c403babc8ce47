#!/bin/bash
# Probe: correctness and same-process speed of the kernels' A/B switches (FT_* macros) on one GPU, in one call of at
# most ~570 s: the GPU suite and memcheck with every switch on, then forward / backward A/Bs (default vs each switch,
# cuDNN in the same process, the order reversed every other round). Writes logs under ${OUT:-/tmp/switch_ab}.
# racecheck is left to the validation call of the chosen defaults (it takes ~150 s).
#
#   FWD_SWITCHES="FT_A=1 FT_B=0" BWD_SWITCHES="FT_C=1" bash benchmarks/probes/switch_ab.sh [FT_A=1,FT_B=0,FT_C=1]
#   (the argument: the GPU suite's macros, default every switch not set to 0; default switches: two of 2026-11-25's
#   defaults turned off. An empty FWD_SWITCHES / BWD_SWITCHES runs no variant on that side.)
set -u
out=${OUT:-/tmp/switch_ab}
mkdir -p "$out"
read -r -a fwd_switches <<< "${FWD_SWITCHES-FT_FWD_HALF_FIRST=0}"
read -r -a bwd_switches <<< "${BWD_SWITCHES-FT_BWD_SKIP_HIDDEN=0}"
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
# ab PROBE SEQLENS ALL SWITCH...: default, each switch alone and all of them together, then cuDNN
ab() {
    local probe=$1 seqlens=$2 all=$3 impls=(flashtrain)
    shift 3
    for sw in "$@"; do impls+=("flashtrain+$sw"); done
    [ $# -gt 1 ] && impls+=("flashtrain+${all//,/+}")
    # shellcheck disable=SC2086
    timeout 130 python "benchmarks/probes/sm90_${probe}_probe.py" --no-check --rounds 4 --seqlens $seqlens \
        --impls "${impls[@]}" cudnn > "$out/${probe}_ab.txt" 2>&1
    echo "$probe A/B rc $?"
}
ab fwd "512 1024 4096" "$fwd_all" "${fwd_switches[@]}"
date -u
ab bwd "1024 4096 16384" "$bwd_all" "${bwd_switches[@]}"
date -u
