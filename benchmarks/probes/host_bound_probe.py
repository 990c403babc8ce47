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
from attention_timing import host_seconds  # noqa: E402
from train_gpt2 import balanced_order, calls_per_name, hold_gpu  # noqa: E402

CELLS = [A.Workload("GPT-2 small 1K causal", 16, 1024, 12, 12, 64, True),
         A.Workload("hd128 causal 512", 32, 512, 16, 16, 128, True),
         A.Workload("hd64 causal 512", 32, 512, 32, 32, 64, True),
         A.Workload("hd64 full 512", 32, 512, 32, 32, 64, False)]
PAD_S = float(os.environ.get("PAD_SECONDS", "0.00075"))  # the sleep before each call's start event (padded runs)


def run(cases: dict, repeats: int, pad: bool) -> dict:
    """The interleaved timing (balanced order, CUDA events, no host sync), with a sleep queued before each call when
    pad: per implementation the median and least ms, and the median per predecessor implementation."""
    names = list(cases)
    circuits = calls_per_name(len(names), repeats) // (len(names) - 1)
    records, prev = [], None
    torch.cuda.synchronize()
    for index in balanced_order(len(names)) * circuits:
        if pad:
            hold_gpu(PAD_S)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        cases[names[index]]()
        end.record()
        records.append((names[index], prev, start, end))
        prev = names[index]
    torch.cuda.synchronize()
    result = {}
    for name in names:
        times = [start.elapsed_time(end) for who, _, start, end in records if who == name]
        by_prev = {}
        for who, before, start, end in records:
            if who == name and before is not None:
                by_prev.setdefault(before, []).append(start.elapsed_time(end))
        result[name] = {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4),
                        "by_prev_median_ms": {p: round(statistics.median(v), 4) for p, v in by_prev.items()}}
    return result


def host_us(call, calls: int = 50) -> float:
    """Mean host microseconds per call while the GPU is held busy (launches queue and never wait)."""
    hold_gpu(0.1)
    total = sum(host_seconds(call) for _ in range(calls))
    torch.cuda.synchronize()
    return round(total / calls * 1e6, 1)


def cases_of(w, kind: str) -> dict:
    """{impl: call} of every implementation that runs workload w's pass (fwd under no_grad, fb by autograd.grad)."""
    cases = {}
    for impl in A.WORKLOAD_IMPLS:
        try:
            fn, inputs, dout = A.workload_case(impl, w)
            if kind == "fwd":
                def call(fn=fn, inputs=inputs):
                    with torch.no_grad():
                        return fn(*inputs)
            else:
                def call(fn=fn, inputs=inputs, dout=dout):
                    return torch.autograd.grad(fn(*inputs), inputs, dout)
            for _ in range(3):
                call()
            cases[impl] = call
        except Exception as error:  # noqa: BLE001 -- a backend that refuses the shape is left out
            print(impl, w.name, kind, type(error).__name__)
    return cases


def main() -> None:
    out = {}
    for w in CELLS:
        row = {}
        for kind in ("fwd", "fb"):
            cases = cases_of(w, kind)
            row[kind] = {"host_us": {name: host_us(call) for name, call in cases.items()},
                         "interleaved": [run(cases, 40, False) for _ in range(2)],
                         "padded": [run(cases, 40, True) for _ in range(2)]}
            print(w.name, kind, "host us", row[kind]["host_us"])
            for label in ("interleaved", "padded"):
                for r in row[kind][label]:
                    print(f"  {label:11s}", {n: r[n]["median_ms"] for n in r}, " flashtrain by predecessor:",
                          r.get("flashtrain", {}).get("by_prev_median_ms"))
        out[w.name] = row
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pad_seconds": PAD_S, "cells": out}
    with open(os.path.join(os.environ.get("OUT", "."), "host_probe.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
