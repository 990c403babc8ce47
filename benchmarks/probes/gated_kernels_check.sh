#!/usr/bin/env bash
# The Hopper kernels behind switches, checked in one device call (about 8 minutes on an H200 with an empty kernel
# cache), again after a change to them:
#   - the dense kernels' tail split (build.BWD_TAIL_SPLIT, on by default; FWD_TAIL_SPLIT, off): the last, partial wave
#     of a launch's tiles in pieces;
#   - the hd64 forward in 2-CTA clusters (build.FWD_SM90_CLUSTER_HD64, off): K / V tiles shared by TMA multicast.
# Steps: every kernel built; their cuda tests; the sanitizer grid (which runs both); interleaved CUDA-graph A/Bs of
# the backward's split against the whole-tile kernels at the rows it splits (with the cost model's piece count, and
# capped at 4 and 8 pieces, which is what fitting ops.TAIL_PIECE_STEPS / TAIL_MERGE_STEPS needs), backward alone and
# forward + backward; the hd64 clusters against one CTA per tile at 16K (and 4K, their threshold lowered),
# interleaved, and at 16K sustained with clocks.
# Each step's output goes to its own log under OUT (default out/gated_kernels_check), the A/Bs' records as JSON
# beside them; a failed step does not stop the later ones, and the last lines say which failed.
#
#     OUT=$OUT bash benchmarks/probes/gated_kernels_check.sh
#
# Needs pytest-xdist and compute-sanitizer (both on the device machine); not FA4 (the A/Bs compare our own variants).
set -u
out=${OUT:-out/gated_kernels_check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=()

step() {  # step NAME COMMAND...: run, log to $out/NAME.log, note a failure
    local name=$1
    shift
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc, $((SECONDS - start)) s"
    tail -n 3 "$out/$name.log" | sed 's/^/    /'
    [ "$rc" -eq 0 ] || failed+=("$name")
}

step build python -m flashtrain.kernels.build -j "$(nproc)"
step tests python -m pytest -q -m cuda -n 8 -k "tail_split or hd64_cluster" tests/test_cuda_kernels.py \
    tests/test_host_layer_cuda.py
step memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    python tests/test_cuda_kernels.py

bwd_rows=(64:16384:full 64:8192:full 64:4096:full 64:2048:full 128:16384:full 128:8192:full 128:4096:full)
split=flashtrain@build.BWD_TAIL_SPLIT=1
for kind in bwd fb; do
    step "ab_tail_$kind" python benchmarks/probes/ab_probe.py --impls flashtrain@build.BWD_TAIL_SPLIT=0 "$split" \
        "$split@ops.TAIL_MAX_PIECES=4" "$split@ops.TAIL_MAX_PIECES=8" flashtrain#2 --configs "${bwd_rows[@]}" \
        --pass "$kind" --repeats 30 --json "$out/ab_tail_$kind.json"
done

clusters=flashtrain@build.FWD_SM90_CLUSTER_HD64=1
# (from 4K keys too: 22 query tiles per head at 4K; 8K's 43 stay on one CTA per tile)
step ab_hd64_clusters python benchmarks/probes/ab_probe.py --impls flashtrain "$clusters" \
    "$clusters@build.FWD_SM90_CLUSTER_SEQLEN=4096" flashtrain#2 --configs 64:16384:full 64:16384:full:16:2 \
    64:4096:full --pass fwd --repeats 30 --json "$out/ab_hd64_clusters.json"
step ab_hd64_clusters_sustained python benchmarks/probes/ab_probe.py --impls flashtrain "$clusters" \
    --configs 64:16384:full --pass fwd --sustained 3 --rounds 2 --clocks \
    --json "$out/ab_hd64_clusters_sustained.json"

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
