"""Where a GPU waits in a torch.profiler trace (trainer.profile_steps writes one per process): the time the GPU runs
no kernel, split into gaps the host caused (the next kernel was launched after the gap began: the host was behind)
and gaps where the kernel was queued in time (a stream waiting on another: collectives, events), each host-late gap
charged to the host operations that were running when the late kernel was launched.

    python benchmarks/probes/trace_gaps.py runs/*/profile/*.json [--json out.json]
"""

import argparse
import bisect
import collections
import json
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def union(intervals):
    """Sorted, merged (start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def host_stack(cpu_by_tid, tid, ts, depth=3):
    """Names of the outermost `depth` CPU events open at `ts` on thread `tid` (outermost first)."""
    events = cpu_by_tid.get(tid, [])
    i = bisect.bisect_right(events, (ts, float("inf"))) - 1
    open_events = []
    # events are sorted by start; walk back over those that may still be open (bounded look-back)
    for j in range(i, max(-1, i - 4000), -1):
        start, end, name = events[j]
        if start <= ts <= end:
            open_events.append((start, -end, name))
    open_events.sort()
    return [name for _, _, name in open_events[:depth]]


def analyse(path: Path, min_gap_us: float = 10.0) -> dict:
    trace = json.loads(Path(path).read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in GPU_CATS]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    cpu_by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            cpu_by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for lst in cpu_by_tid.values():
        lst.sort()
    if not kernels:
        return {"file": str(path), "error": "no GPU kernels in the trace"}
    busy = union([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    nccl = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" in k["name"].lower()]
    compute = union([(k["ts"], k["ts"] + k["dur"]) for k in kernels if "nccl" not in k["name"].lower()])
    compute_us = sum(end - start for start, end in compute)
    starts = sorted(((k["ts"], i, k) for i, k in enumerate(kernels)), key=lambda x: x[:2])
    start_ts = [s for s, _, _ in starts]
    host_late = collections.Counter()
    host_late_us = queued_us = 0.0
    gaps = []
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        gap = gap_end - gap_start
        if gap < min_gap_us:
            queued_us += gap  # small gaps: launch latency between dependent kernels
            continue
        kernel = starts[bisect.bisect_left(start_ts, gap_end)][2]
        launch = launches.get(kernel["args"].get("correlation"))
        if launch is not None and launch["ts"] > gap_start:
            late = min(gap, launch["ts"] - gap_start)
            host_late_us += late
            queued_us += gap - late
            stack = " > ".join(host_stack(cpu_by_tid, launch["tid"], launch["ts"]))
            host_late[stack] += late
            gaps.append((gap, late, stack, kernel["name"][:60]))
        else:
            queued_us += gap
            gaps.append((gap, 0.0, "(queued: waits on another stream or event)", kernel["name"][:60]))
    gaps.sort(reverse=True)
    return {
        "file": str(path),
        "span_ms": span / 1e3, "gpu_busy_ms": busy_us / 1e3, "compute_busy_ms": compute_us / 1e3,
        "nccl_ms": sum(end - start for start, end in union(nccl)) / 1e3,
        "idle_ms": (span - busy_us) / 1e3, "idle_host_late_ms": host_late_us / 1e3,
        "idle_queued_ms": queued_us / 1e3,
        "host_late_by_op_ms": {k: round(v / 1e3, 3) for k, v in host_late.most_common(15)},
        "largest_gaps_us": [(round(g), round(late), stack, name) for g, late, stack, name in gaps[:15]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write every trace's summary here too")
    args = parser.parse_args()
    results = []
    for path in args.traces:
        r = analyse(path)
        results.append(r)
        if "error" in r:
            print(f"{path}: {r['error']}")
            continue
        print(f"\n{path}\n  span {r['span_ms']:.1f} ms: GPU busy {r['gpu_busy_ms']:.1f} (compute {r['compute_busy_ms']:.1f}, "
              f"NCCL {r['nccl_ms']:.1f}), idle {r['idle_ms']:.1f} = host late {r['idle_host_late_ms']:.1f} + "
              f"queued {r['idle_queued_ms']:.1f}")
        for stack, ms in r["host_late_by_op_ms"].items():
            print(f"    {ms:8.3f} ms  {stack}")
        for gap, late, stack, name in r["largest_gaps_us"][:8]:
            print(f"    gap {gap} us (host late {late}): {stack} -> {name}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
