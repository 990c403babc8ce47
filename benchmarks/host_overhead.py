"""Host (CPU) time per attention call: flashtrain against PyTorch's SDPA with the FlashAttention-2 and cuDNN
backends forced, in one process on one GPU.

Host time is measured as in benchmarks/probes (its first version lived there): after warm-up calls and a
synchronisation, `--calls` calls are issued back to back and the wall time of issuing them, before the closing
synchronisation, divided by their number is the host time per call. The call is tiny (batch 1, 128 tokens, 4 heads,
head dim 64, bf16, causal), so the GPU finishes each kernel before the CPU has issued the next: what is measured is
the CPU's work. Each cell is the best of --rounds rounds (the implementations take turns).

Cells: {flashtrain, fa2, cudnn, one-op (q.sin(): one pointwise kernel each way, the floor of the path)} x layout {batch (B, S, H, D), varlen (packed rows + cu_seqlens; SDPA gets a nested
jagged tensor, which is how it runs variable lengths)} x {eager, torch.compile} x {forward (no_grad), forward +
backward (torch.autograd.grad)}. A backend that cannot run a cell is reported as n/a with its error.
Targets (host overhead): flashtrain forward <= 60 us, forward + backward <= 200 us in every layout and mode.

A second table times whole calls (issue + GPU, synchronised once per --calls calls) at the tiny shape and at GPT-2
small's attention shape (batch 16, 1K tokens, 12 heads, head dim 64, causal): the speed ratio flashtrain / FA2.

    python benchmarks/host_overhead.py                    # tables; benchmarks/results/host_overhead-<gpu>.json/.png
    python benchmarks/host_overhead.py --profile          # plus cProfile of flashtrain's eager calls
"""

import argparse
import cProfile
import datetime
import io
import json
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func

RESULTS = Path(__file__).resolve().parent / "results"
TINY = (1, 128, 4, 64)  # batch, seqlen, heads, head dim
GPT2_SMALL = (16, 1024, 12, 64)
# one-op: q.sin(), a single pointwise kernel forward and backward -- what any one-kernel op pays through the same path
# (the floor under torch.compile, whose per-call wrappers alone exceed the targets)
IMPLS = ("flashtrain", "fa2", "cudnn", "one-op")
SDPA_BACKENDS = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
TARGET_US = {"fwd": 60.0, "fwd+bwd": 200.0}


def host_us(fn, calls: int) -> float:
    """CPU time to issue one call: `calls` calls back to back, timed before the closing synchronisation."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / calls


def call_us(fn, calls: int) -> float:
    """Time of one call, issue and GPU work together: `calls` calls, synchronised once at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def attention(impl: str, layout: str, shape, compiled: bool):
    """(q, k, v) -> out for one implementation and layout; batch q (B, S, H, D); varlen q (B * S, H, D) packed."""
    batch, seqlen = shape[:2]
    if impl == "one-op":
        def fn(q, k, v):
            return q.sin()
    elif impl == "flashtrain" and layout == "batch":
        def fn(q, k, v):
            return flash_attn_func(q, k, v, causal=True, impl="cuda")
    elif impl == "flashtrain":
        cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seqlen

        def fn(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, seqlen, seqlen, causal=True, impl="cuda")
    elif layout == "batch":
        def fn(q, k, v):
            with sdpa_kernel(SDPA_BACKENDS[impl]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True).transpose(1, 2)
    else:
        offsets = torch.arange(batch + 1, dtype=torch.int64, device="cuda") * seqlen

        def fn(q, k, v):  # packed (total, H, D) -> nested (B, j, H, D) -> SDPA on (B, H, j, D)
            nested = [torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v)]
            with sdpa_kernel(SDPA_BACKENDS[impl]):
                out = F.scaled_dot_product_attention(*nested, is_causal=True)
            return out.transpose(1, 2).values()
    return torch.compile(fn) if compiled else fn


def make_call(impl: str, layout: str, shape, compiled: bool, backward: bool):
    generator = torch.Generator("cuda").manual_seed(0)
    full = (shape[0] * shape[1], *shape[2:]) if layout == "varlen" else shape
    q, k, v, dout = (torch.randn(full, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in range(4))
    q, k, v = (x.requires_grad_(backward) for x in (q, k, v))
    fn = attention(impl, layout, shape, compiled)
    if backward:
        inputs = (q,) if impl == "one-op" else (q, k, v)  # (one-op uses q only)
        return lambda: torch.autograd.grad(fn(q, k, v), inputs, dout)

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    return forward


def host_table(calls: int, rounds: int) -> list[dict]:
    cells = [(impl, layout, mode, kind) for mode in ("eager", "compile") for layout in ("batch", "varlen")
             for kind in ("fwd", "fwd+bwd") for impl in IMPLS]
    runs, rows = {}, {}
    for cell in cells:
        impl, layout, mode, kind = cell
        try:
            run = make_call(impl, layout, TINY, mode == "compile", kind == "fwd+bwd")
            for _ in range(20):  # compiles (first use, torch.compile) and warms the allocator
                run()
            torch.cuda.synchronize()
            runs[cell] = run
        except Exception as error:  # a backend that cannot run this cell: reported, not hidden
            rows[cell] = {"host_us": None, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    for _ in range(rounds):
        for cell, run in runs.items():
            us = host_us(run, calls)
            best = rows.get(cell, {}).get("host_us")
            rows[cell] = {"host_us": us if best is None else min(best, us)}
    return [{"impl": c[0], "layout": c[1], "mode": c[2], "kind": c[3], **rows[c]} for c in cells]


def speed_table(calls: int, rounds: int) -> list[dict]:
    rows = []
    for name, shape, n in (("tiny", TINY, calls), ("gpt2-small", GPT2_SMALL, max(10, calls // 30))):
        for kind in ("fwd", "fwd+bwd"):
            runs = {impl: make_call(impl, "batch", shape, False, kind == "fwd+bwd") for impl in ("flashtrain", "fa2")}
            best = {}
            for run in runs.values():
                for _ in range(10):
                    run()
            for _ in range(rounds):
                for impl, run in runs.items():
                    best[impl] = min(best.get(impl, float("inf")), call_us(run, n))
            rows.append({"shape": name, "dims": list(shape), "kind": kind, "flashtrain_us": best["flashtrain"],
                         "fa2_us": best["fa2"], "speed_vs_fa2": best["fa2"] / best["flashtrain"]})
    return rows


def print_tables(host_rows: list[dict], speed_rows: list[dict]) -> None:
    print(f"host us per call, {TINY} bf16 causal (targets: flashtrain fwd <= {TARGET_US['fwd']:.0f}, "
          f"fwd+bwd <= {TARGET_US['fwd+bwd']:.0f})")
    print(f"{'mode':8s} {'layout':7s} {'pass':8s} " + " ".join(f"{impl:>10s}" for impl in IMPLS) + "  target")
    index = {(r["impl"], r["layout"], r["mode"], r["kind"]): r for r in host_rows}
    for mode in ("eager", "compile"):
        for layout in ("batch", "varlen"):
            for kind in ("fwd", "fwd+bwd"):
                cells = [index[(impl, layout, mode, kind)] for impl in IMPLS]
                text = " ".join(f"{c['host_us']:10.1f}" if c["host_us"] is not None else f"{'n/a':>10s}"
                                for c in cells)
                ours = cells[0]["host_us"]
                verdict = "-" if ours is None else "met" if ours <= TARGET_US[kind] else "MISSED"
                print(f"{mode:8s} {layout:7s} {kind:8s} {text}  {verdict}")
    for row in host_rows:
        if row.get("error"):
            print(f"  n/a {row['impl']} {row['layout']} {row['mode']} {row['kind']}: {row['error']}")
    print("\ncall time (issue + GPU), batch layout, bf16 causal")
    for row in speed_rows:
        print(f"{row['shape']:11s} {row['kind']:8s} flashtrain {row['flashtrain_us']:9.1f} us   fa2 "
              f"{row['fa2_us']:9.1f} us   speed vs fa2 {row['speed_vs_fa2']:.2f}x")


def plot(host_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    groups = [(mode, layout) for mode in ("eager", "compile") for layout in ("batch", "varlen")]
    for ax, kind in zip(axes, ("fwd", "fwd+bwd")):
        for offset, impl in enumerate(IMPLS):
            values = [next(r["host_us"] for r in host_rows if (r["impl"], r["mode"], r["layout"], r["kind"])
                           == (impl, mode, layout, kind)) or 0.0 for mode, layout in groups]
            width = 0.8 / len(IMPLS)
            ax.bar([g + width * (offset - (len(IMPLS) - 1) / 2) for g in range(len(groups))], values, width=width,
                   label=impl)
        ax.axhline(TARGET_US[kind], color="black", linestyle="--", linewidth=1, label="target")
        ax.set_xticks(range(len(groups)), [f"{mode}\n{layout}" for mode, layout in groups])
        ax.set_title(f"{kind}: host us per call, {TINY} bf16 causal (n/a: 0)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("host time per call (us)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def profile(calls: int) -> None:
    for kind in ("fwd", "fwd+bwd"):
        run = make_call("flashtrain", "batch", TINY, False, kind == "fwd+bwd")
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            run()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(f"==== flashtrain {kind}, eager ({calls} calls)\n" + "\n".join(text.getvalue().splitlines()[:45]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="calls per timed window")
    parser.add_argument("--rounds", type=int, default=3, help="timed windows per cell (best kept)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    parser.add_argument("--profile", action="store_true", help="also print cProfile of flashtrain's eager calls")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "calls": args.calls,
           "rounds": args.rounds}
    print(json.dumps(env))
    host_rows = host_table(args.calls, args.rounds)
    speed_rows = speed_table(args.calls, args.rounds)
    print_tables(host_rows, speed_rows)
    out = args.out or RESULTS / f"host_overhead-{gpu.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "host": host_rows, "speed": speed_rows}, indent=1))
    plot(host_rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    if args.profile:
        profile(200)


if __name__ == "__main__":
    main()
