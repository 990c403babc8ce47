#!/usr/bin/env bash
# The Hopper kernels' tail split (build.BWD_TAIL_SPLIT / FWD_TAIL_SPLIT, off by default) on a GPU in one device call
# (about 7 minutes on an H200 with an empty kernel cache): every kernel built, the split's cuda tests, the sanitizer
# grid (which forces both passes' splits), then interleaved CUDA-graph A/Bs of the backward's split against the
# whole-tile kernels at the rows it splits (with the cost model's piece count, and capped at 4 and 8 pieces, which
# is what fitting ops.TAIL_PIECE_STEPS / TAIL_MERGE_STEPS needs), the backward alone and forward + backward.
# Each step's output goes to its own log under OUT (default out/tail_split_check), the A/Bs' records as JSON beside
# them; a failed step does not stop the later ones, and the last lines say which failed.
#
#     bash benchmarks/probes/tail_split_check.sh            # on the device: OUT=$OUT bash benchmarks/probes/...
#
# Needs pytest-xdist and compute-sanitizer (both on the device machine); FA4 is not needed (not an implementation
# here: the A/B is the split against our own whole tiles).
set -u
out=${OUT:-out/tail_split_check}
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
step tests python -m pytest -q -m cuda -n 8 -k "tail_split" tests/test_cuda_kernels.py tests/test_host_layer_cuda.py
step memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    python tests/test_cuda_kernels.py

bwd_rows=(64:16384:full 64:8192:full 64:4096:full 64:2048:full 128:16384:full 128:8192:full 128:4096:full)
split=flashtrain@build.BWD_TAIL_SPLIT=1
for kind in bwd fb; do
    step "ab_$kind" python benchmarks/probes/ab_probe.py --impls flashtrain "$split" "$split@ops.TAIL_MAX_PIECES=4" \
        "$split@ops.TAIL_MAX_PIECES=8" flashtrain#2 --configs "${bwd_rows[@]}" --pass "$kind" --repeats 30 \
        --json "$out/ab_$kind.json"
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
