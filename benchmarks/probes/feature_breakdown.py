"""Per-kernel device time of issue 20's feature rows (benchmarks/attention_features.py), forward + backward, from
torch.profiler: where a row's time goes besides its attention kernels (the backward's preprocess and dq conversion
are per token, so they weigh more on a sliding window's few tiles than on plain causal attention's many).

Also per call: the device's span and its idle time under the profiler (which slows the host: an upper bound on the
host-bound gaps), and the time of back-to-back calls between two CUDA events (no profiler).

    python benchmarks/probes/feature_breakdown.py --only window --out /tmp/breakdown.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention_features as af  # noqa: E402


def breakdown(fn, args, dout, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        torch.autograd.grad(fn(*args), args, dout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(fn(*args), args, dout)  # (no .grad accumulation: the benchmark's pass)
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] += ev.device_time / iters
            spans.append((ev.time_range.start, ev.time_range.end))
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    # the device's span over the profiled calls against its busy time: idle gaps between kernels (host-bound stretches)
    spans.sort()
    busy, end = 0.0, None
    for a, b in spans:
        busy += max(0.0, b - max(a, end)) if end is not None else b - a
        end = b if end is None else max(end, b)
    per["(span per call, us)"] = (spans[-1][1] - spans[0][0]) / iters if spans else 0.0
    per["(idle inside the span per call, us)"] = per["(span per call, us)"] - busy / iters
    # back to back with CUDA events, nothing else in between (the benchmark interleaves implementations)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.autograd.grad(fn(*args), args, dout)
    stop.record()
    torch.cuda.synchronize()
    per["(events, back to back, per call, us)"] = 1000 * start.elapsed_time(stop) / iters
    return per


def copy_references(row, device, iters: int) -> dict:
    """Device time of plain memory traffic the size of the backward's per-token work for the row (us): zeroing the
    fp32 dq accumulator, converting it to bf16, reading out and dout (what the preprocess and the conversion move)."""
    rows = row.batch * row.seqlen * row.nheads
    acc = torch.empty(rows, row.head_dim, device=device, dtype=torch.float32)
    o, do = (torch.randn(rows, row.head_dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    dq = torch.empty_like(o)
    work = {"zero fp32 dq_accum (memset)": lambda: acc.zero_(),
            "fp32 -> bf16 copy (the conversion's bytes)": lambda: dq.copy_(acc),
            "read out + dout, row dot (torch)": lambda: torch.linalg.vecdot(o.float(), do.float())}
    result = {}
    for name, fn in work.items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        result[name] = 1000 * start.elapsed_time(end) / iters
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {}
    for row in af.feature_rows():
        if args.only and args.only not in row.name:
            continue
        for impl in ("flashtrain", "plain"):
            fn, qkv, dout = af.case(impl, row, device)
            per = breakdown(fn, qkv, dout, args.iters)
            result[f"{row.name} / {impl}"] = per
            total = sum(us for name, us in per.items() if not name.startswith("("))
            print(f"== {row.name} / {impl}: {total:.1f} us per fwd+bwd")
            for name, us in per.items():
                print(f"   {us:9.1f} us {100 * us / total:5.1f}%  {name}" if not name.startswith("(") else
                      f"   {us:9.1f} us         {name}")
        refs = copy_references(row, device, args.iters)
        result[f"{row.name} / memory references"] = refs
        for name, us in refs.items():
            print(f"   reference {us:9.1f} us  {name}")
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
