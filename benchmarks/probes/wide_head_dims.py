"""Head dims 256 / 512 against every SDPA backend that runs them, in one process on one GPU (issue 20: head dims up
to 512). bf16, batch 4, 4 heads (the feature benchmark's hd512 row), causal and not, at the given lengths; the
implementations' calls interleaved (attention.time_passes_interleaved). cuDNN and FA2 refuse head dims above 256 on
torch 2.11; the memory-efficient backend and the math one (naive) run them.

    python benchmarks/probes/wide_head_dims.py --out $OUT/wide_head_dims.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention  # noqa: E402  (the sibling benchmark's inputs, functions and timers)

IMPLS = ("flashtrain", "cudnn", "fa2", "efficient", "naive")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for head_dim in args.head_dims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                flops = 4 * 4 * 4 * seqlen * seqlen * head_dim / (2 if causal else 1)
                cases = {}
                for impl in IMPLS:
                    q, k, v, dout = attention.make_inputs(impl, 4, seqlen, 4, head_dim, requires_grad=True)
                    cases[impl] = (attention.attention_fn(impl, causal), (q, k, v), dout)
                label = f"hd{head_dim} S{seqlen} causal={causal}"
                row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal}
                for impl, times in attention.time_passes_interleaved(cases, args.repeats, label).items():
                    attention.keep_best(row, impl, times, flops)
                rows.append(row)
                print(label, "  ".join(f"{impl} " + "/".join(str(row.get(f"{impl}_{k}") or "-") for k in
                                                             ("fwd", "bwd", "fb")) for impl in IMPLS), flush=True)
                del cases
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
