"""Probe: one attention call per implementation between cudaProfilerStart / Stop, for Nsight Compute to profile side by
side (flashtrain's kernels against FlashAttention-4's and cuDNN's on the same shape, in one process). Each call is
warmed up first (kernels built, FA4 compiled), so only the measured call's kernels are profiled; ncu locks the clocks
(base clock by default), so its durations compare the kernels per clock, apart from power: clock_probe.py measures
that.

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --csv --page details --log-file $OUT/ncu.csv \\
        python3 benchmarks/probes/ncu_probe.py --impls flashtrain fa4 cudnn --config 128:16384:full --pass fwd

Configurations as ab_probe.py's (`head_dim:seqlen:full|causal[:heads/kv_heads[:batch]]`); implementations
flashtrain, fa4 (where installed), cudnn, fa2. Writes nothing itself; ncu's log has one block per kernel, in the order
of --impls (each implementation's kernels, e.g. the backward's preprocess, main kernel and converts).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa4_baseline  # noqa: E402
from ab_probe import BACKENDS, Config  # noqa: E402


def call_of(name: str, c: Config, kind: str):
    """A no-argument callable running `name`'s forward (kind fwd) or forward + backward (fb) on fresh inputs."""
    flashtrain_layout = name in ("flashtrain", "fa4")

    def tensor(heads):
        shape = (c.batch, c.seqlen, heads, c.head_dim) if flashtrain_layout else (c.batch, heads, c.seqlen, c.head_dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=kind == "fb")

    q, k, v, dout = tensor(c.nheads), tensor(c.nheads_kv), tensor(c.nheads_kv), tensor(c.nheads)
    if name == "flashtrain":
        attend = lambda: flash_attn_func(q, k, v, causal=c.causal, impl="cuda")  # noqa: E731
    elif name == "fa4":
        fa4 = fa4_baseline.attention(c.causal)
        attend = lambda: fa4(q, k, v)  # noqa: E731
    elif name in BACKENDS:
        gqa = {"enable_gqa": True} if c.nheads != c.nheads_kv else {}

        def attend():
            with sdpa_kernel(BACKENDS[name]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=c.causal, **gqa)
    else:
        raise SystemExit(f"--impls: unknown implementation {name!r} (flashtrain, fa4, {', '.join(BACKENDS)})")

    def call():
        with torch.set_grad_enabled(kind == "fb"):
            out = attend()
            if kind == "fb":
                torch.autograd.grad(out, (q, k, v), dout)
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "cudnn"])
    parser.add_argument("--config", default="128:16384:full")
    parser.add_argument("--pass", dest="kind", choices=("fwd", "fb"), default="fwd")
    args = parser.parse_args()
    config = Config.parse(args.config)
    for name in args.impls:
        call = call_of(name, config, args.kind)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled {name} {config.label()} {args.kind}", flush=True)


if __name__ == "__main__":
    main()
