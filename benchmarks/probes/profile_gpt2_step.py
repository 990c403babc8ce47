"""Probe: where the time of a GPT-2 training step goes (torch.profiler), by kind of kernel: our attention kernels,
matmuls, Triton / Inductor fusions, other elementwise and reduction kernels, the optimizer, copies; plus how much
of the step the GPU idles (host work, syncs). The step is benchmarks/train_gpt2.py's (bf16 autocast, fused AdamW,
clipping), eager or compiled. Writes the table as text and JSON under --out, the Chrome trace too (traces stay out
of git: summarize them in docs/).

    PYTHONPATH=$PWD python benchmarks/probes/profile_gpt2_step.py --model small --seq-len 1024 --compile --out $OUT/prof
    PYTHONPATH=$PWD python benchmarks/probes/profile_gpt2_step.py --device cpu --model tiny --seq-len 64   # smoke
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_gpt2 import MODEL_SHAPES, VOCAB, prepare  # noqa: E402

# (category, substrings of a kernel's name), the first match wins
CATEGORIES = (
    ("attention (flashtrain)", ("flash_fwd", "flash_bwd", "bwd_convert", "bwd_dot_do_o", "flash_aux")),
    ("attention (SDPA)", ("fmha", "flash_fprop", "flash_bprop", "attention", "sdpa")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam", "foreach")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "ampere_", "wgmma", "mm_")),
    ("cross-entropy / softmax", ("ft_cross_entropy", "softmax", "nll", "cross_entropy", "log_softmax", "logsumexp")),
    ("Triton / Inductor fusion", ("triton_",)),
    ("copies", ("copy", "memcpy", "memset", "cat", "fill")),
    ("reductions / norms", ("reduce", "norm", "layer_norm")),
)


def category(name: str) -> str:
    lowered = name.lower()
    return next((label for label, keys in CATEGORIES if any(key in lowered for key in keys)), "other elementwise")


def summarize(events, steps: int, wall_s: float) -> dict:
    """Per category: milliseconds of device time per step and share of the device's busy time."""
    per_kernel: dict[str, float] = {}
    kernels = [event for event in events if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA]
    for event in kernels or events:  # the kernels only: an op's row counts its kernels' time again
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us > 0:
            per_kernel[event.key] = per_kernel.get(event.key, 0.0) + device_us
    busy_ms = sum(per_kernel.values()) / 1000 / steps
    by_category: dict[str, float] = {}
    for name, us in per_kernel.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + us / 1000 / steps
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:15]
    return {
        "step_ms": 1000 * wall_s / steps,
        "device_busy_ms": busy_ms,
        "device_idle_share": max(0.0, 1 - busy_ms / (1000 * wall_s / steps)) if wall_s > 0 else None,
        "categories": {k: {"ms": v, "share": v / busy_ms if busy_ms else 0.0}
                       for k, v in sorted(by_category.items(), key=lambda item: -item[1])},
        "top_kernels": [{"name": name[:120], "ms_per_step": us / 1000 / steps} for name, us in top],
    }


def format_summary(summary: dict) -> str:
    lines = [f"step {summary['step_ms']:.2f} ms, device busy {summary['device_busy_ms']:.2f} ms per step"
             + (f" (idle {100 * summary['device_idle_share']:.1f}%)" if summary["device_idle_share"] is not None
                else "")]
    lines += [f"  {name:<28} {c['ms']:8.2f} ms  {100 * c['share']:5.1f}%" for name, c in summary["categories"].items()]
    lines += ["  top kernels:"] + [f"    {k['ms_per_step']:8.3f} ms  {k['name']}" for k in summary["top_kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="small", choices=list(MODEL_SHAPES))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--impl", default="flashtrain", help="a train_gpt2.py implementation name")
    parser.add_argument("--compile", action="store_true", help="the -compile variant of --impl")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (after the warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="directory for summary.txt / .json and trace.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    impl = f"{args.impl}-compile" if args.compile else args.impl
    vocab = 512 if args.model == "tiny" else VOCAB
    step, _ = prepare(impl, MODEL_SHAPES[args.model], args.seq_len, args.batch_tokens // args.seq_len, vocab, device,
                      warmup=3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    summary = summarize(prof.key_averages(), args.steps, wall_s) if device.type == "cuda" else {
        "step_ms": 1000 * wall_s / args.steps, "device_busy_ms": 0.0, "device_idle_share": None, "categories": {},
        "top_kernels": []}
    summary.update(impl=impl, model=args.model, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   torch=torch.__version__)
    text = format_summary(summary)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.txt").write_text(text + "\n")
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        prof.export_chrome_trace(str(args.out / "trace.json"))
    return summary


if __name__ == "__main__":
    main()
