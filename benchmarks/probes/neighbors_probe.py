"""Probe: how a benchmark cell's time depends on the call that ran just before it. Runs attention.py's own interleaved
passes (attention_timing.time_passes_interleaved: the implementations take turns, each call between CUDA events, the
GPU held while the host queues) under torch.profiler, one pass per profile, and splits the GPU timeline back into
calls by kernel name. Per implementation and pass: the benchmark's median, the median span of its calls (first
kernel's start to last kernel's end), the median busy time, the idle time before each call, its kernels (median
duration and the gap before each; pass_kernels_probe.summarize), and the median span by predecessor. What ran before
a call (its power draw, its L2 contents) is part of that call's conditions, so a cell's median moves with the mix of
implementations in the rotation; this says by how much, and whether a forward + backward that takes longer than its
parts has gaps (span > busy) or slower kernels.

    PYTHONPATH=$PWD python3 benchmarks/probes/neighbors_probe.py --impls flashtrain fa4 fa2 cudnn efficient \
        --configs 64:16384:causal 128:16384:full [--repeats 20] [--json OUT.json]

Writes: stdout (per cell, pass and implementation); with `--json`, the same as JSON."""
import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_probe import Config  # noqa: E402
from pass_kernels_probe import summarize  # noqa: E402
import attention  # noqa: E402 -- (benchmarks/ is on sys.path once ab_probe is imported)
import attention_timing  # noqa: E402
import fa4_baseline  # noqa: E402

# Kernel names of each implementation (lower case), tried in this order: the first match names the owner (FA2's and
# FA4's names contain "flash_fwd" too, so flashtrain's, which start with it, come after them). Kernels of none
# (memsets, torch's elementwise kernels of autograd) go to the call they sit in (owner_of_unnamed).
OWNERS = (("fa4", lambda n: "flash_attncute" in n), ("fa2", lambda n: "pytorch_flash" in n),
          ("flashtrain", lambda n: n.startswith(("flash_fwd", "flash_bwd", "flash_aux"))),
          ("cudnn", lambda n: "cudnn" in n),
          ("efficient", lambda n: any(p in n for p in ("fmha", "attentionkernel", "attentionbackwardkernel"))),
          ("hold", lambda n: "spin_kernel" in n))


def owner(name: str) -> str | None:
    """The implementation a GPU activity belongs to, by its name; None for one of no implementation."""
    lowered = name.lower()
    return next((impl for impl, matches in OWNERS if matches(lowered)), None)


def owner_of_unnamed(owners: list, starts: list, ends: list, i: int, near_us: float = 200.0) -> str:
    """An activity of no implementation (owners[i] is None): the next named activity's owner when it starts within
    near_us of this one's end (a memset or copy ahead of a call's first kernel), else the previous named one's."""
    after = next((j for j in range(i + 1, len(owners)) if owners[j] is not None), None)
    if after is not None and starts[after] - ends[i] < near_us:
        return owners[after]
    before = next((j for j in range(i - 1, -1, -1) if owners[j] is not None), None)
    return owners[before] if before is not None else "?"


def split_calls(activities: list) -> list[dict]:
    """Calls from GPU activities [(name, start us, end us)] of implementations taking turns: maximal runs of one
    owner's activities in time order. Each: {"impl", "prev" (the previous call's impl, None first), "lead_us" (idle
    time since the previous activity), "kernels": [(name, start, end), ...]}."""
    acts = sorted(activities, key=lambda a: a[1])
    owners = [owner(a[0]) for a in acts]
    starts, ends = [a[1] for a in acts], [a[2] for a in acts]
    resolved = [o if o is not None else owner_of_unnamed(owners, starts, ends, i) for i, o in enumerate(owners)]
    calls = []
    for i, (act, impl) in enumerate(zip(acts, resolved)):
        if calls and calls[-1]["impl"] == impl:
            calls[-1]["kernels"].append(act)
        else:
            calls.append({"impl": impl, "prev": calls[-1]["impl"] if calls else None,
                          "lead_us": act[1] - ends[i - 1] if i else None, "kernels": [act]})
    return calls


def per_impl(calls: list, impl: str) -> dict:
    """Medians over `impl`'s calls: span, busy (sum of durations), lead, kernels (summarize), span by predecessor
    (calls after the GPU hold, which starts each pass, are left out of that)."""
    mine = [c for c in calls if c["impl"] == impl]
    spans = [c["kernels"][-1][2] - c["kernels"][0][1] for c in mine]
    by_prev = defaultdict(list)
    for call, span in zip(mine, spans):
        if call["prev"] not in (None, "hold"):
            by_prev[call["prev"]].append(span)
    leads = [c["lead_us"] for c in mine if c["lead_us"] is not None]
    kernels = summarize([c["kernels"] for c in mine])
    return {"calls": len(mine), "span_us": round(statistics.median(spans), 1),
            "busy_us": round(statistics.median(sum(k[2] - k[1] for k in c["kernels"]) for c in mine), 1),
            "lead_us": round(statistics.median(leads), 1) if leads else None,
            "span_us_by_predecessor": {p: round(statistics.median(v), 1) for p, v in sorted(by_prev.items())},
            "kernels": kernels["kernels"]}


def profile_pass(cases: dict, one_pass: tuple, repeats: int, label: str) -> tuple[dict, list]:
    """One pass (a (kind, factor) pair of attention_timing.PASSES) of time_passes_interleaved over `cases` under
    torch.profiler: (its times, the calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        times = attention_timing.time_passes_interleaved(cases, repeats, label, passes=(one_pass,))
        torch.cuda.synchronize()
    activities = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
    return times, split_calls(activities)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "fa4", "fa2", "cudnn", "efficient"])
    parser.add_argument("--configs", nargs="+", default=["64:16384:causal"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    fa4_baseline.require_if_named(args.impls)
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "fa4": fa4_baseline.version(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "impls": args.impls, "cells": {}}
    for text in args.configs:
        c = Config.parse(text)
        cases = {}
        for impl in args.impls:
            q, k, v, dout = attention.make_inputs(impl, c.batch, c.seqlen, c.nheads, c.head_dim, requires_grad=True)
            cases[impl] = (attention.attention_fn(impl, c.causal), (q, k, v), dout)
        for one_pass in attention_timing.PASSES:
            kind = one_pass[0]
            times, calls = profile_pass(cases, one_pass, args.repeats, c.label())
            cell = {}
            for impl in args.impls:
                if kind not in times.get(impl, {}):
                    continue
                cell[impl] = {"bench_ms": round(times[impl][kind], 4), **per_impl(calls, impl)}
                s = cell[impl]
                print(f"{c.label()} {kind:<3} {impl:<10} bench {s['bench_ms']:8.4f} ms  span {s['span_us']:9.1f}  "
                      f"busy {s['busy_us']:9.1f}  by predecessor {s['span_us_by_predecessor']}", flush=True)
            record["cells"][f"{c.label()} {kind}"] = cell
        del cases
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
