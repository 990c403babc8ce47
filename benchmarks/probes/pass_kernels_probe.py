"""Probe: the kernels of each pass, their device times and the gaps between them, per implementation: why a forward +
backward call can take longer than its forward and its backward timed apart. Each (implementation, pass) is captured
as a CUDA graph (ab_probe.capture), the graphs replayed in turn under torch.profiler (CUPTI); per replay, the kernels in
launch order with their durations and the idle time from one kernel's end to the next one's start. Medians over the
replays. --eager: the calls run eagerly instead (each launch from the host, as a training step without CUDA graphs),
so that a gap also shows host work between two launches (an allocation, a synchronization, autograd's bookkeeping).

    PYTHONPATH=$PWD python3 benchmarks/probes/pass_kernels_probe.py --impls flashtrain fa4 \
        --configs 64:16384:causal 128:16384:causal [--replays 10] [--eager] [--json OUT.json]
"""
import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_probe import Config, attention_call, capture, variant_spec  # noqa: E402
import fa4_baseline  # noqa: E402 -- (benchmarks/ is on sys.path once ab_probe is imported)

PASSES = ("fwd", "bwd", "fb")


def replay_kernels(graphs: dict, replays: int) -> dict:
    """{key: [[(kernel name, start us, end us), ...] per replay]} of calls {key: no-argument callable} (a CUDA graph's
    replay, or an eager call), run in turn."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            for key, graph in graphs.items():
                torch.cuda.synchronize()
                time.sleep(0.02)  # a gap that separates the replays in the trace (split_replays' 10 ms)
                graph()
                torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()]
    return split_replays(kernels, list(graphs), expected=replays)


def split_replays(kernels: list, keys: list, gap_us: float = 10_000.0, expected: int | None = None) -> dict:
    """{key: [replay, ...]} from kernels [(name, start us, end us), ...] of replays run in turn over `keys`, one after
    another with host sleeps between them: a new replay starts where the GPU was idle for more than gap_us. expected:
    replays per key; a different count of pieces (an idle gap that long inside a call) raises instead of handing the
    pieces to the wrong keys."""
    groups, current = [], []
    for item in sorted(kernels, key=lambda x: x[1]):
        if current and item[1] - current[-1][2] > gap_us:
            groups.append(current)
            current = []
        current.append(item)
    if current:
        groups.append(current)
    if expected is not None and len(groups) != expected * len(keys):
        raise RuntimeError(f"{len(groups)} pieces of the trace for {expected} replays of {len(keys)} calls: some call "
                           f"left the GPU idle for more than {gap_us / 1000:g} ms inside it")
    out = {key: [] for key in keys}
    for i, group in enumerate(groups):
        out[keys[i % len(keys)]].append(group)
    return out


def summarize(replays: list) -> dict:
    """Medians over replays (lists of (name, start us, end us)): per kernel its duration and the idle time before it,
    over the replays that launched the most common sequence of kernels; the span over all replays, and the sum."""
    sequences = Counter(tuple(k[0] for k in replay) for replay in replays)
    names, _ = sequences.most_common(1)[0]
    same = [replay for replay in replays if tuple(k[0] for k in replay) == names]
    rows = []
    for j, name in enumerate(names):
        durs = [g[j][2] - g[j][1] for g in same]
        gaps = [g[j][1] - g[j - 1][2] for g in same] if j else [0.0]
        rows.append({"kernel": name[:90], "us": round(statistics.median(durs), 1),
                     "gap_before_us": round(statistics.median(gaps), 1)})
    spans = [g[-1][2] - g[0][1] for g in replays]
    return {"kernels": rows, "span_us": round(statistics.median(spans), 1),
            "sum_us": round(sum(r["us"] for r in rows), 1), "replays": len(replays), "same_sequence": len(same)}


def eager_call(name: str, config: Config, kind: str):
    """`name`'s call of `kind` run eagerly (no CUDA graph: each launch from the host, as a training step without
    graphs), warmed up; plain implementation names only."""
    spec = variant_spec(name)
    if spec.split("+")[0].split("@")[0] != spec:  # (variant() drops the launch plans on entry and exit)
        raise SystemExit(f"--eager: {name}: plain implementations only (a variant's settings would rebuild its plans "
                         "at each call, which the gaps would then show)")
    call, inputs = attention_call(spec, config, kind)

    def run():
        with torch.no_grad() if kind == "fwd" else contextlib.nullcontext():
            call()
    for _ in range(3):
        run()
    run.inputs = inputs  # (kept alive with the call)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", default=["flashtrain"])
    parser.add_argument("--configs", nargs="+", default=["64:16384:causal"])
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--eager", action="store_true",
                        help="eager calls instead of CUDA-graph replays: gaps then include the host's launch path")
    args = parser.parse_args()
    fa4_baseline.require_if_named(args.impls)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for text in args.configs:
        config = Config.parse(text)
        graphs = {(impl, kind): eager_call(impl, config, kind) if args.eager else capture(impl, config, kind).replay
                  for impl in args.impls for kind in PASSES}
        per = replay_kernels(graphs, args.replays)
        for (impl, kind), replays in per.items():
            summary = summarize(replays)
            result[f"{config.label()} {impl} {kind}{' eager' if args.eager else ''}"] = summary
            print(f"{config.label()} {impl:<12} {kind:<3} span {summary['span_us']:9.1f} us  sum {summary['sum_us']:9.1f}")
            for row in summary["kernels"]:
                print(f"    {row['us']:9.1f} us  (gap {row['gap_before_us']:6.1f})  {row['kernel']}")
        del graphs
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
