"""Head dims 256 / 512 against every SDPA backend that runs them, in one process on one GPU (issue 20: head dims up
to 512). bf16, batch 4, 4 heads (the feature benchmark's hd512 row), causal and not, at the given lengths; the
implementations' calls interleaved (attention.time_passes_interleaved). "default" is SDPA with no backend chosen (what
a user gets). cuDNN and FA2 refuse head dims above 256 on torch 2.11; the memory-efficient backend and the math one
(naive: the scores materialised, bf16) run them.

    python benchmarks/probes/wide_head_dims.py --out $OUT/wide_head_dims.json    (+ .png beside it)
    python benchmarks/probes/wide_head_dims.py --plot benchmarks/results/wide_head_dims-h200.json   (no GPU)
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

IMPLS = ("flashtrain", "default", "cudnn", "fa2", "efficient", "naive")


def plot(data: dict, path: Path) -> None:
    """Bars of TFLOP/s per configuration, forward and forward+backward, one bar per implementation that ran."""
    import attention_features

    rows, env = data["rows"], data["env"]
    attention_features.plot_passes(
        rows, IMPLS, [f"hd{r['head_dim']} {r['seqlen'] // 1024}K\n{'causal' if r['causal'] else 'full'}" for r in rows],
        path, f"{env['gpu']}, torch {env['torch']}, {env['date'][:16]} UTC: bf16, batch 4, 4 heads (naive = SDPA's "
        "math path)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="JSON path (the PNG beside it)")
    parser.add_argument("--plot", type=Path, help="only redraw the PNG of this JSON (no GPU)")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    if args.out is None:
        parser.error("--out is required (or --plot)")
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
    plot({"env": env, "rows": rows}, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
