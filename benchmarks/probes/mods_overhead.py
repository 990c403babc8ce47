"""Probe (issue 20): what the score-modification kernels cost per computed block, apart from the window's shape.

Per (head dim, sequence length), causal bf16, batch * seqlen = 16K tokens, 2048 hidden, interleaved in one process:
  plain     flash_attn_func(causal=True): the plain kernels
  mods      window_size=(seqlen, 0): the `_mods` kernels doing exactly plain causal's work (every mask a no-op)
  softcap   softcap=30 (the mods kernels with tanh on every score and its derivative in the backward)
  alibi     ALiBi slopes (a bias per score)
  window    window_size=(1024, 0) (fewer blocks; TFLOP/s counted over the pairs it computes)
TFLOP/s over the pairs each computes (forward 4 * pairs * head_dim per head, backward 2.5x).
--noncausal: the same without causal masking (mods = window_size (seqlen, seqlen); no window row).

    python benchmarks/probes/mods_overhead.py --out $OUT/mods_overhead.json [--family mma_sync] [--noncausal]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention  # noqa: E402
from attention_features import FeatureRow, alibi_slopes  # noqa: E402

from flashtrain.kernels import flash_attn_func  # noqa: E402


def variants(seqlen: int, nheads: int, causal: bool = True):
    if not causal:
        return {"plain": ({}, -1), "mods": ({"window_size": (seqlen, seqlen)}, -1), "softcap": ({"softcap": 30.0}, -1),
                "alibi": ({"alibi_slopes": alibi_slopes(nheads, "cuda")}, -1)}
    return {"plain": ({}, -1), "mods": ({"window_size": (seqlen, 0)}, -1), "softcap": ({"softcap": 30.0}, -1),
            "alibi": ({"alibi_slopes": alibi_slopes(nheads, "cuda")}, -1),
            "window": ({"window_size": (1024, 0)}, 1024)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--family", choices=("default", "mma_sync"), default="default")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--noncausal", action="store_true", help="without causal masking")
    args = parser.parse_args()
    if args.family == "mma_sync":
        os.environ["FLASHTRAIN_SM90"] = "0"
    rows = []
    for head_dim in args.head_dims:
        nheads = 2048 // head_dim
        for seqlen in args.seqlens:
            batch = 16384 // seqlen
            cases, flops = {}, {}
            causal = not args.noncausal
            for name, (options, window) in variants(seqlen, nheads, causal).items():
                q, k, v, dout = attention.make_inputs("flashtrain", batch, seqlen, nheads, head_dim, True)
                cases[name] = ((lambda q, k, v, options=options: flash_attn_func(q, k, v, causal=causal, impl="cuda",
                                                                                  **options)), (q, k, v), dout)
                flops[name] = (FeatureRow(name, batch, seqlen, nheads, head_dim, window=window).fwd_flops() if causal
                               else 4.0 * batch * nheads * seqlen * seqlen * head_dim)
            times = attention.time_passes_interleaved(cases, args.repeats, f"hd{head_dim} S{seqlen}")
            row = {"hd": head_dim, "S": seqlen, "B": batch, "H": nheads, "causal": causal}
            for name, passes in times.items():
                for kind, factor in attention.PASSES:
                    if kind in passes:
                        row[f"{name}_{kind}"] = round(factor * flops[name] / passes[kind] / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "family": args.family,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
