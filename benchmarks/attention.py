"""Attention speed and memory: flashtrain's CUDA kernels against PyTorch's scaled_dot_product_attention with each
backend forced (FLASH_ATTENTION = PyTorch's vendored FlashAttention-2, CUDNN_ATTENTION, EFFICIENT_ATTENTION) and
naive PyTorch attention, in one process on one GPU.

Setting of the FlashAttention-2/3 papers: bf16, head dim 64 and 128, hidden 2048 (nheads = 2048 / head_dim), seqlen
512 ... 16K with batch * seqlen = 16K tokens, causal and not. FLOPs: forward 4 * batch * nheads * seqlen^2 * head_dim
(halved when causal), backward 2.5x forward. Each time is the median of timed repeats (CUDA events, after warm-up);
the implementations are measured in turn, in --rounds rounds, and each keeps its best round (a clock dip then costs
one window of one implementation, not its result). Memory: peak extra memory of one forward + backward (beyond inputs and gradients) at batch 16, 8 heads, head dim 64,
seqlen 1K ... 64K.

    python benchmarks/attention.py                      # full run: table, benchmarks/results/attention-<gpu>.json/.png
    python benchmarks/attention.py --quick              # 2 seqlens, few repeats
"""

import argparse
import datetime
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS, HIDDEN = 16 * 1024, 2048
SDPA_BACKENDS = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
IMPLS = ("flashtrain", "fa2", "cudnn", "efficient", "naive")


def naive_attention(q, k, v, causal):
    """(batch, nheads, seqlen, head_dim) in bf16, the seqlen x seqlen matrix materialised."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        seqlen = q.shape[-2]
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def attention_fn(impl: str, causal: bool):
    """fn(q, k, v) -> out. flashtrain takes (batch, seqlen, nheads, head_dim); the others (batch, nheads, ...)."""
    if impl == "flashtrain":
        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal, impl="cuda")
    if impl == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    backend = SDPA_BACKENDS[impl]

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def make_inputs(impl, batch, seqlen, nheads, head_dim, requires_grad):
    shape = (batch, seqlen, nheads, head_dim) if impl == "flashtrain" else (batch, nheads, seqlen, head_dim)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad) for _ in range(4)]


def median_ms(fn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_impl(impl, batch, seqlen, nheads, head_dim, causal, repeats):
    """Forward, backward and forward+backward times in ms (None where the implementation cannot run)."""
    fn = attention_fn(impl, causal)
    q, k, v, dout = make_inputs(impl, batch, seqlen, nheads, head_dim, requires_grad=True)
    warmup = 3
    if impl == "naive":  # seconds per call at 16K; a few repeats say enough
        repeats = min(repeats, 5)
    times = {}
    try:
        with torch.no_grad():
            times["fwd"] = median_ms(lambda: fn(q, k, v), warmup, repeats)
        out = fn(q, k, v)
        times["bwd"] = median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup,
                                 repeats)
        del out
        times["fb"] = median_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), warmup, repeats)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:  # backend refuses the shape, or no memory
        print(f"  {impl} hd{head_dim} S{seqlen} causal={causal}: {type(error).__name__}: {str(error)[:120]}")
    torch.cuda.empty_cache()
    return times


def speed(seqlens, repeats, rounds):
    rows = []
    for head_dim in (64, 128):
        nheads = HIDDEN // head_dim
        for seqlen in seqlens:
            batch = TOKENS // seqlen
            for causal in (False, True):
                fwd_flops = 4 * batch * nheads * seqlen**2 * head_dim / (2 if causal else 1)
                row = {"hd": head_dim, "S": seqlen, "B": batch, "H": nheads, "causal": causal}
                for round_index in range(rounds):
                    for impl in IMPLS if round_index == 0 else IMPLS[:-1]:  # naive: one round, it is slow
                        times = time_impl(impl, batch, seqlen, nheads, head_dim, causal, repeats)
                        for kind, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops), ("fb", 3.5 * fwd_flops)):
                            ms, best = times.get(kind), row.get(f"{impl}_{kind}")
                            tflops = None if ms is None else round(flops / ms / 1e9, 1)
                            row[f"{impl}_{kind}"] = tflops if best is None else max(best, tflops or 0)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def ratio(row, impl, other, kind):
    a, b = row.get(f"{impl}_{kind}"), row.get(f"{other}_{kind}")
    return None if not a or not b else a / b


def format_row(row) -> str:
    def cell(x, width=6, digits=0):
        return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"
    parts = [f"hd{row['hd']:<4}{'causal' if row['causal'] else 'full':<7}S{row['S']:<6}"]
    for kind in ("fwd", "fb"):
        parts.append(" ".join(cell(row[f"{impl}_{kind}"]) for impl in ("flashtrain", "fa2", "cudnn")))
        parts.append(cell(ratio(row, "flashtrain", "fa2", kind), 6, 2) + cell(ratio(row, "flashtrain", "cudnn", kind), 6, 2))
    return " | ".join(parts)


def memory(seqlens):
    """Peak memory of one causal forward + backward beyond inputs and gradients, MiB (None: out of memory)."""
    rows = []
    for seqlen in seqlens:
        row = {"S": seqlen, "B": 16, "H": 8, "hd": 64}
        for impl in ("flashtrain", "fa2", "naive"):
            fn = attention_fn(impl, causal=True)
            try:
                q, k, v, dout = make_inputs(impl, 16, seqlen, 8, 64, requires_grad=True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                got = torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
                torch.cuda.synchronize()
                grads_bytes = sum(x.nbytes for x in got)  # what any implementation must return
                row[impl] = round((torch.cuda.max_memory_allocated() - base - grads_bytes) / 2**20, 1)
                del q, k, v, dout, got
            except torch.cuda.OutOfMemoryError:
                row[impl] = None
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"memory S={seqlen:<6} " + " ".join(f"{impl}={row[impl]} MiB" for impl in ("flashtrain", "fa2", "naive")),
              flush=True)
    return rows


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 3, figsize=(15, 16), sharex=True)
    for r, (head_dim, causal) in enumerate([(64, False), (64, True), (128, False), (128, True)]):
        subset = [row for row in rows if row["hd"] == head_dim and row["causal"] == causal]
        for c, kind in enumerate(("fwd", "bwd", "fb")):
            ax = axes[r][c]
            for impl in IMPLS:
                points = [(row["S"], row[f"{impl}_{kind}"]) for row in subset if row[f"{impl}_{kind}"] is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"hd{head_dim} {'causal' if causal else 'non-causal'} {kind}")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    for ax in axes[-1]:
        ax.set_xlabel("seqlen (batch x seqlen = 16K)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seqlens 1K and 4K, 5 repeats, no memory sweep")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    print(json.dumps(env))
    seqlens = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    print("TFLOP/s            | fwd: flashtrain fa2 cudnn | ft/fa2 ft/cudnn | fwd+bwd: flashtrain fa2 cudnn | ratios")
    rows = speed(seqlens, 5 if args.quick else args.repeats, 1 if args.quick else args.rounds)
    mem = [] if args.quick else memory([1024, 2048, 4096, 8192, 16384, 32768, 65536])
    out = args.out or RESULTS / f"attention-{gpu.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows, "memory": mem}, indent=1))
    plot(rows, out.with_suffix(".png"))
    worst = {kind: min((ratio(row, "flashtrain", "fa2", kind) or 0) for row in rows) for kind in ("fwd", "bwd", "fb")}
    print(f"wrote {out}; worst flashtrain/fa2 ratio: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))


if __name__ == "__main__":
    main()
