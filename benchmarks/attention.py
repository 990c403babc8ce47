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
    python benchmarks/attention.py --block-sparse --out DIR   # block-sparse scaling: DIR/block_sparse.json/.png

Block-sparse mode (issue #4): forward+backward time of flashtrain's block-sparse kernels against the density s of the
block mask, s in {1, 1/2, 1/4, 1/8, 1/16}, at 16K and 64K tokens (batch 1, 16 heads, head dim 64, bf16, not causal),
against dense flashtrain and the FA2 backend (dense). The masks (block_sparse.random_blocks, a new draw per head) hold
exactly s * n_kblocks blocks in every row, so s * (dense time) is the ideal; reported: time / (s * dense time) and
the speedup over dense flashtrain. The timed call includes building the mask's index lists.
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

from flashtrain.kernels import block_sparse, flash_attn_func
from train_gpt2 import time_calls  # the sibling benchmark's timer (this script's folder is on sys.path)

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
    """Median milliseconds of one call of fn on the GPU (CUDA events, train_gpt2.time_calls)."""
    return 1000 * statistics.median(time_calls(fn, torch.device("cuda"), warmup, repeats))


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


SPARSE_SEQLENS, SPARSE_HEADS, SPARSE_HEAD_DIM = (16384, 65536), 16, 64
DENSITIES = (1, 1 / 2, 1 / 4, 1 / 8, 1 / 16)


def block_sparse_speed(repeats: int, rounds: int) -> list[dict]:
    """One row per seqlen: fwd+bwd ms of dense flashtrain, FA2 (dense) and flashtrain at each density (best round)."""
    rows = []
    for seqlen in SPARSE_SEQLENS:
        row = {"S": seqlen, "B": 1, "H": SPARSE_HEADS, "hd": SPARSE_HEAD_DIM, "causal": False}
        masks = {s: block_sparse.random_blocks(seqlen, density=s, nheads=SPARSE_HEADS, seed=0).cuda()
                 for s in DENSITIES}
        ft_q, ft_k, ft_v, ft_dout = make_inputs("flashtrain", 1, seqlen, SPARSE_HEADS, SPARSE_HEAD_DIM, True)
        fa_q, fa_k, fa_v, fa_dout = make_inputs("fa2", 1, seqlen, SPARSE_HEADS, SPARSE_HEAD_DIM, True)
        cases = {"flashtrain_dense": (attention_fn("flashtrain", False), (ft_q, ft_k, ft_v, ft_dout)),
                 "fa2_dense": (attention_fn("fa2", False), (fa_q, fa_k, fa_v, fa_dout))}
        for s, mask in masks.items():
            fn = (lambda mask: lambda q, k, v: flash_attn_func(q, k, v, block_mask=mask, impl="cuda"))(mask)
            cases[f"flashtrain_s{s:g}"] = (fn, (ft_q, ft_k, ft_v, ft_dout))
        for _ in range(rounds):
            for name, (fn, (q, k, v, dout)) in cases.items():
                ms = median_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), 2, repeats)
                row[name] = round(min(row.get(name, math.inf), ms), 3)
        # peak memory of one forward + backward beyond inputs and gradients (MiB): the mask, its index lists and the
        # kernel's O(N) buffers (lse, D, the fp32 dQ accumulator) -- nothing grows as N x N
        for name in ("flashtrain_dense", "flashtrain_s0.125"):
            fn, (q, k, v, dout) = cases[name]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            got = torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base - sum(x.nbytes for x in got)
            row[f"{name}_peak_mib"] = round(extra / 2**20, 1)
            del got
        dense = row["flashtrain_dense"]
        row["density"] = {f"{s:g}": masks[s].float().mean().item() for s in DENSITIES}
        row["time_over_ideal"] = {f"{s:g}": round(row[f"flashtrain_s{s:g}"] / (s * dense), 3) for s in DENSITIES}
        row["speedup_vs_dense"] = {f"{s:g}": round(dense / row[f"flashtrain_s{s:g}"], 2) for s in DENSITIES}
        rows.append(row)
        print(f"S={seqlen}: fwd+bwd ms dense flashtrain {dense:.2f}, FA2 {row['fa2_dense']:.2f}; " + ", ".join(
            f"s={s:g}: {row[f'flashtrain_s{s:g}']:.2f} ms (x{row['time_over_ideal'][f'{s:g}']:.2f} of s*dense, "
            f"{row['speedup_vs_dense'][f'{s:g}']:.1f}x faster)" for s in DENSITIES)
              + f"; peak MiB beyond inputs/grads: dense {row['flashtrain_dense_peak_mib']}, "
                f"s=1/8 {row['flashtrain_s0.125_peak_mib']}", flush=True)
        del cases, ft_q, ft_k, ft_v, ft_dout, fa_q, fa_k, fa_v, fa_dout
        torch.cuda.empty_cache()
    return rows


def plot_block_sparse(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5))
    for ax, row in zip(axes if len(rows) > 1 else [axes], rows):
        dense = row["flashtrain_dense"]
        ax.plot(DENSITIES, [row[f"flashtrain_s{s:g}"] for s in DENSITIES], marker="o", label="flashtrain block-sparse")
        ax.plot(DENSITIES, [s * dense for s in DENSITIES], linestyle="--", color="gray", label="s x dense (ideal)")
        ax.axhline(dense, color="C1", label="flashtrain dense")
        ax.axhline(row["fa2_dense"], color="C2", linestyle=":", label="FA2 dense")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("block-mask density s")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(f"S={row['S']}, {row['H']} heads, hd{row['hd']}, bf16")
        ax.grid(alpha=0.3, which="both")
    axes_list = axes if len(rows) > 1 else [axes]
    axes_list[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seqlens 1K and 4K, 5 repeats, no memory sweep")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (PNG beside it); with --block-sparse a directory (default benchmarks/results)")
    parser.add_argument("--block-sparse", action="store_true", help="block-sparse scaling against density only")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    print(json.dumps(env))
    if args.block_sparse:
        out_dir = args.out or RESULTS
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = block_sparse_speed(5 if args.quick else 10, 1 if args.quick else 2)
        (out_dir / "block_sparse.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        plot_block_sparse(rows, out_dir / "block_sparse.png")
        print(f"wrote {out_dir / 'block_sparse.json'} and .png")
        return
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
