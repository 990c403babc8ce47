"""Probe: one attention call per implementation between cudaProfilerStart / Stop, for Nsight Compute to profile side by
side (flashtrain's kernels against FlashAttention-4's and cuDNN's on the same shape, in one process). Each call is
warmed up first (kernels built, FA4 compiled), so only the measured call's kernels are profiled; ncu locks the clocks
(base clock by default), so its durations compare the kernels per clock, apart from power: clock_probe.py measures
that.

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --csv --page details --log-file $OUT/ncu.csv \\
        python3 benchmarks/probes/ncu_probe.py --impls flashtrain fa4 cudnn --config 128:16384:full --pass fwd

Configurations as ab_probe.py's (`head_dim:seqlen:full|causal[:heads/kv_heads[:batch]]`); implementations
flashtrain and its variants (ab_probe.py's `+MACRO=v` / `@ENV=v` syntax, active for their calls), fa4 (where
installed), cudnn, fa2. Writes nothing itself; ncu's log has one block per kernel, in the order of --impls (each
implementation's kernels, e.g. the backward's preprocess, main kernel and converts).
"""
import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_probe import Config, attention_call, variant, variant_spec  # noqa: E402
import fa4_baseline  # noqa: E402 -- (benchmarks/ is on sys.path once ab_probe is imported)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "cudnn"])
    parser.add_argument("--config", default="128:16384:full")
    parser.add_argument("--pass", dest="kind", choices=("fwd", "fb"), default="fwd")
    args = parser.parse_args()
    fa4_baseline.require_if_named(args.impls)
    config = Config.parse(args.config)
    for name in args.impls:
        spec = variant_spec(name)
        call, _ = attention_call(spec, config, args.kind)
        # (a flashtrain variant, e.g. flashtrain@build.NAME=v or flashtrain+FT_MACRO=v: active for its calls, as in
        # ab_probe.py)
        active = variant(spec) if spec.startswith("flashtrain") else contextlib.nullcontext()
        with active, torch.set_grad_enabled(args.kind == "fb"):
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
