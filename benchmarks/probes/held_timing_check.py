"""Does holding the GPU while the host queues the calls change what the interleaved timing measures? The benchmarks'
time_passes_interleaved as it is (held) and with the hold off (hold_seconds replaced by 0), taking turns, on short
cells that can be host-bound and on a long one; flashtrain / FA2 / cuDNN / efficient. Where the host keeps ahead both
give the same times; where it does not, only the unheld ones move (host_bound_probe.py shows why). Writes
$OUT/hold_check.json (held_timing_check in benchmarks/results/timing_host_bound-h200.json).
Run from the repository root on a GPU machine: PYTHONPATH=$PWD python benchmarks/probes/held_timing_check.py"""
import json
import os
import sys
import time

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
import attention as A  # noqa: E402
import attention_timing as T  # noqa: E402

CELLS = [A.Workload("GPT-2 small 1K causal", 16, 1024, 12, 12, 64, True),
         A.Workload("hd128 causal 512", 32, 512, 16, 16, 128, True),
         A.Workload("hd128 full 4K", 4, 4096, 16, 16, 128, False)]
IMPLS = ("flashtrain", "fa2", "cudnn", "efficient")


def main() -> None:
    utc = lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # noqa: E731
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "utc_start": utc(), "cells": {}}
    held = T.hold_seconds
    path = os.path.join(os.environ.get("OUT", "."), "hold_check.json")
    try:
        for w in CELLS:
            cases = {impl: A.workload_case(impl, w) for impl in IMPLS}
            runs = {}
            for label in ("held", "not held", "held", "not held"):
                T.hold_seconds = held if label == "held" else (lambda host_s, calls_each: 0.0)
                start = time.perf_counter()
                times = T.time_passes_interleaved(cases, 20, w.name)
                runs.setdefault(label, []).append({"seconds": round(time.perf_counter() - start, 2), **{
                    impl: {key: round(value, 4) for key, value in t.items()} for impl, t in times.items()}})
                print(w.name, label, {impl: (round(t["fwd"], 4), round(t["fb"], 4)) for impl, t in times.items()},
                      flush=True)
            out["cells"][w.name] = runs
            out["utc_end"] = utc()
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        T.hold_seconds = held


if __name__ == "__main__":
    main()
