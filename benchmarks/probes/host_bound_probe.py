"""Whether the benchmarks' interleaved timing (train_gpt2.time_interleaved) is host-bound for short calls: per call, the
host time (perf_counter, the GPU kept busy by a sleep so that launches never wait) and the event time grouped by the
implementation that ran before it; then the same timing with a GPU sleep queued before each call's start event (the GPU
never idle when the start event runs). Writes $OUT/host_probe.json (benchmarks/results/timing_host_bound-h200.json).
Run from the repository root on a GPU machine: python benchmarks/probes/host_bound_probe.py"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
import attention as A  # noqa: E402
from train_gpt2 import balanced_order  # noqa: E402

out = {}
cells = [A.Workload("GPT-2 small 1K causal", 16, 1024, 12, 12, 64, True),
         A.Workload("hd128 causal 512", 32, 512, 16, 16, 128, True),
         A.Workload("hd64 causal 512", 32, 512, 32, 32, 64, True),
         A.Workload("hd64 full 512", 32, 512, 32, 32, 64, False)]
impls = list(A.WORKLOAD_IMPLS)
SLEEP = int(os.environ.get("SLEEP_CYCLES", "1500000"))  # ~0.8 ms at 1.98 GHz

def run(cases, kind, repeats, pad):
    names = list(cases); order = balanced_order(len(names))
    circuits = -(-repeats // (len(names) - 1))
    rec = []
    torch.cuda.synchronize()
    prev = None
    for i in order * circuits:
        if pad:
            torch.cuda._sleep(SLEEP)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); cases[names[i]](); e.record()
        rec.append((names[i], prev, s, e)); prev = names[i]
    torch.cuda.synchronize()
    res = {}
    for n in names:
        ts = [s.elapsed_time(e) for m, p, s, e in rec if m == n]
        by = {}
        for m, p, s, e in rec:
            if m == n and p is not None:
                by.setdefault(p, []).append(s.elapsed_time(e))
        res[n] = {"median_ms": round(statistics.median(ts), 4), "min_ms": round(min(ts), 4),
                  "by_prev_median_ms": {p: round(statistics.median(v), 4) for p, v in by.items()}}
    return res

def host_us(fn, calls=50):
    torch.cuda._sleep(200_000_000)  # ~0.1 s busy: launches queue, never block
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    h = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return round(h, 1)

for w in cells:
    row = {}
    fns = {}
    for impl in impls:
        try:
            fn, inputs, dout = A.workload_case(impl, w)
            fns[impl] = (fn, inputs, dout)
        except Exception as err:
            print(impl, w.name, err)
    for kind in ("fwd", "fb"):
        cases = {}
        for impl, (fn, inputs, dout) in fns.items():
            if kind == "fwd":
                def c(fn=fn, inputs=inputs):
                    with torch.no_grad():
                        return fn(*inputs)
            else:
                def c(fn=fn, inputs=inputs, dout=dout):
                    return torch.autograd.grad(fn(*inputs), inputs, dout)
            try:
                for _ in range(3): c()
                cases[impl] = c
            except Exception as err:
                print(impl, w.name, kind, type(err).__name__)
        row[kind] = {"host_us": {n: host_us(c) for n, c in cases.items()},
                     "interleaved": [run(cases, kind, 40, False) for _ in range(2)],
                     "padded": [run(cases, kind, 40, True) for _ in range(2)]}
        h = row[kind]["host_us"]
        print(w.name, kind, "host us", h)
        for label in ("interleaved", "padded"):
            for r in row[kind][label]:
                print(f"  {label:11s}", {n: r[n]["median_ms"] for n in r}, " ft by prev:", r.get("flashtrain", {}).get("by_prev_median_ms"))
    out[w.name] = row
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "sleep_cycles": SLEEP, "cells": out}, open(os.path.join(os.environ.get("OUT", "."), "host_probe.json"), "w"), indent=1)
