"""Attention speed and memory: flashtrain's CUDA kernels against FlashAttention-4 (the flash-attn-4 package, where
installed: benchmarks/fa4_baseline.py), PyTorch's scaled_dot_product_attention with each backend forced
(FLASH_ATTENTION = PyTorch's vendored FlashAttention-2, CUDNN_ATTENTION, EFFICIENT_ATTENTION) and naive PyTorch
attention, in one process on one GPU. Where FA4 is not installed its columns say "not installed".

Setting of the FlashAttention-2/3 papers: bf16, head dim 64 and 128, hidden 2048 (nheads = 2048 / head_dim), seqlen
512 ... 16K with batch * seqlen = 16K tokens, causal and not. FLOPs: forward 4 * batch * nheads * seqlen^2 * head_dim
(halved when causal), backward 2.5x forward. Each time is the median of timed repeats (CUDA events, after warm-up);
the implementations' calls are interleaved (--timing interleaved, the default since 2026-11-26: the implementations
take turns, each preceded equally often by every other, so all run under the same clocks and power state; the GPU
held by a sleep while the host queues a pass's calls, so that they run back to back and each interval is its call's
GPU time, not a short call's host path after a predecessor that left the GPU idle; each implementation's host time per
call is kept beside it, {impl}_{pass}_host_us), in --rounds rounds with fresh inputs, and each keeps its best round
(the grid and the workloads take their rounds outer: every row's first round, then every row's second,
attention_timing.rounds_over_cells). (--timing windows: each implementation's repeats back to back, implementations
in turn, the order reversed every other round; on an H200 at its 700 W cap the same kernels measured 0.88-1.13x of
cuDNN from run to run that way, interleaved within 0.3%. Interleaving measures the ratios; absolute TFLOP/s run
higher than in sustained use of one implementation, as the slower backends' calls between them cool the GPU:
benchmarks/probes/clock_probe.py measures sustained speed.)
Sustained speed (--sustained SECONDS, default 5 with --all): training runs one implementation back to back at the
clocks its own power draw settles at, which interleaving does not show. For the head dim 128 grid rows at S >= 4K,
flashtrain, FA4 and cuDNN each run forward, then forward+backward, alone for SECONDS (the host keeps 16 calls queued,
never draining the GPU); TFLOP/s from the median call of the second half, reported beside the interleaved numbers.
Memory: peak extra memory of one forward + backward (beyond inputs and gradients) at batch 16, 8 heads, head dim 64,
seqlen 1K ... 64K.

    python benchmarks/attention.py                      # full run: table, benchmarks/results/attention-<gpu>.json/.png
    python benchmarks/attention.py --quick              # 2 seqlens, few repeats
    python benchmarks/attention.py --seqlens 512 1024   # the grid's rows at these lengths only
    python benchmarks/attention.py --block-sparse --out DIR   # block-sparse scaling: DIR/block_sparse.json/.png
    python benchmarks/attention.py --workloads          # workloads table: results/attention_workloads-<gpu>.json/.png
    python benchmarks/attention.py --all                # the grid (+ memory, + sustained hd128 rows), then workloads
    python benchmarks/attention.py --all --resume       # ... continuing the records a cut --all run left
    python benchmarks/attention.py --sustained-only     # the sustained hd128 rows only (S 4K, 8K, 16K)
    python benchmarks/attention.py --selftest           # tables and plots on synthetic numbers (CPU, no GPU)

Every run records GPU, torch, CUDA and cuDNN versions, the UTC date and the bf16 matmul rate (8192^3, the ceiling of
the 75% target) in its JSON. The JSON is written as soon as the grid (with the memory sweep) or the workloads rows are
measured, again after each sustained row and after the feature rows, and its `complete` field is true once the run
has finished: a run cut short keeps what it measured, and --resume continues it (the same GPU, source commit, FA4,
torch and settings, else it stops): the parts a record holds are kept, the rest measured, and env.resumed lists each
continuation's start. That is how one --all run (about 700 s with FA4) spans two time-limited device calls. The
grid prints flashtrain / FA2 and / cuDNN per pass, a summary (worst ratios, hd128 full S>=4K forward as a share of the
matmul rate) and a markdown table.

Workloads mode: rows outside the grid, bf16, each against every SDPA backend that runs it (a backend that
refuses a pass shows "-"): head dims 64, 80, 96, 128, 192, 256 at 4K causal (batch 4, nheads = 2048 / head_dim
rounded down to a power of two); GQA 32/8 heads at 8K and 16/2 at 4K, causal, hd128 (SDPA: enable_gqa=True);
dropout 0.1 at batch 32 x 512, 16 heads, hd64 (BERT-large); varlen, 64 seeded lengths in [128, 512], 16 heads,
hd64 (flashtrain: flash_attn_varlen_func on packed tensors; SDPA: padded to the longest with a key-padding bool
attn_mask, which FA2 refuses); GPT-2 small (16 x 1K, 12 heads, hd64, causal). FLOPs as in the grid, varlen summed
over sequences (useful work only, never padding). Each cell: best-round median ms and TFLOP/s; per pass the ratio
flashtrain / fastest SDPA backend that ran it. Markdown table last; the PNG shows the fwd and fwd+bwd ratios.

The workloads mode also runs the feature rows (benchmarks/attention_features.py: a window of 1024 at 16K, softcap 30
and ALiBi at 4K, head dim 512 at 4K, a document mask at 16K) against compiled FlexAttention and plain attention.

Block-sparse mode: forward+backward time of flashtrain's block-sparse kernels against the density s of the
block mask, s in {1, 1/2, 1/4, 1/8, 1/16}, at 16K and 64K tokens (batch 1, 16 heads, head dim 64, bf16, not causal),
against dense flashtrain and the FA2 backend (dense). The masks (block_sparse.random_blocks, a new draw per head) hold
exactly s * n_kblocks blocks in every row, so s * (dense time) is the ideal; reported: time / (s * dense time) and
the speedup over dense flashtrain. The timed call includes building the mask's index lists.
"""

import argparse
import contextlib
import datetime
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import block_sparse, flash_attn_func, flash_attn_varlen_func
import fa4_baseline  # FlashAttention-4 where installed
import gpu_clocks  # SM clock and power beside the sustained rows
# (shared with attention_features.py)
from attention_timing import PASSES, keep_best, rounds_over_cells, time_passes_interleaved
from train_gpt2 import time_calls  # the sibling benchmark's timers

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS, HIDDEN = 16 * 1024, 2048
SDPA_BACKENDS = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
IMPLS = ("flashtrain", "fa4", "fa2", "cudnn", "efficient", "naive")
FLASH_LAYOUT = ("flashtrain", "fa4")  # (batch, seqlen, nheads, head_dim); SDPA and naive: (batch, nheads, ...)


def naive_attention(q, k, v, causal):
    """(batch, nheads, seqlen, head_dim) in bf16, the seqlen x seqlen matrix materialised."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        seqlen = q.shape[-2]
        mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def attention_fn(impl: str, causal: bool, dropout_p: float = 0.0, enable_gqa: bool = False, attn_mask=None):
    """fn(q, k, v) -> out. flashtrain takes (batch, seqlen, nheads, head_dim); the others (batch, nheads, ...).

    attn_mask: SDPA only, bool, True = attend (broadcast to (batch, nheads, seqlen_q, seqlen_k)). enable_gqa: SDPA's
    flag for k/v with fewer heads than q (flashtrain reads GQA from the shapes)."""
    if impl == "flashtrain":
        return lambda q, k, v: flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, impl="cuda")
    if impl == "fa4":
        return fa4_baseline.attention(causal, dropout_p)
    if impl == "naive":
        return lambda q, k, v: naive_attention(q, k, v, causal)
    backend = None if impl == "default" else SDPA_BACKENDS[impl]  # default: what a user gets with no backend chosen
    extra = {"enable_gqa": True} if enable_gqa else {}  # only when needed: not every backend takes the flag

    def sdpa(q, k, v):
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=causal, **extra)
    return sdpa


def make_inputs(impl, batch, seqlen, nheads, head_dim, requires_grad, nheads_kv=None):
    """q, k, v, dout in bf16; k and v carry nheads_kv heads (default nheads), q and dout nheads."""
    def shape(heads):
        return (batch, seqlen, heads, head_dim) if impl in FLASH_LAYOUT else (batch, heads, seqlen, head_dim)
    heads = (nheads, nheads_kv or nheads, nheads_kv or nheads, nheads)
    return [torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad) for h in heads]


def median_ms(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of one call of fn on the GPU (CUDA events, train_gpt2.time_calls)."""
    return 1000 * statistics.median(time_calls(fn, torch.device("cuda"), warmup, repeats))


def time_passes(fn, inputs, dout, repeats: int, label: str, warmup: int = 3) -> dict:
    """Forward, backward and forward+backward ms of fn(*inputs) (keys fwd, bwd, fb; a pass that cannot run is
    missing, its error printed with label: a backend that refuses the shape, or no memory)."""
    times = {}
    try:
        with torch.no_grad():
            times["fwd"] = median_ms(lambda: fn(*inputs), warmup, repeats)
        out = fn(*inputs)
        times["bwd"] = median_ms(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True), warmup, repeats)
        del out
        times["fb"] = median_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, dout), warmup, repeats)
    except (RuntimeError, ValueError, NotImplementedError) as error:  # torch.cuda.OutOfMemoryError included
        print(f"  {label}: {type(error).__name__}: {str(error)[:120]}")
    torch.cuda.empty_cache()
    return times


def time_impl(impl, batch, seqlen, nheads, head_dim, causal, repeats):
    """Forward, backward and forward+backward times in ms (None where the implementation cannot run)."""
    q, k, v, dout = make_inputs(impl, batch, seqlen, nheads, head_dim, requires_grad=True)
    if impl == "naive":  # seconds per call at 16K; a few repeats say enough
        repeats = min(repeats, 5)
    return time_passes(attention_fn(impl, causal), (q, k, v), dout, repeats, f"{impl} hd{head_dim} S{seqlen} "
                       f"causal={causal}")


def unpack_inputs(tensors) -> tuple:
    """make_inputs' q, k, v, dout as (inputs, dout)."""
    q, k, v, dout = tensors
    return (q, k, v), dout


def round_order(impls, round_index: int) -> list:
    """The implementations of one round, reversed every other round: the first of a round measured up to 5% faster
    than the same kernel measured later (H200 probes, 2026-11-25), a bias that would otherwise always favour one."""
    return list(impls) if round_index % 2 == 0 else list(reversed(impls))


def speed(seqlens, repeats, rounds, interleave=True):
    """The grid's rows, the best of `rounds` rounds each (rounds_over_cells: rounds outer); a row is printed once its
    last round is in."""
    rows = [{"hd": head_dim, "S": seqlen, "B": TOKENS // seqlen, "H": HIDDEN // head_dim, "causal": causal}
            for head_dim in (64, 128) for seqlen in seqlens for causal in (False, True)]

    def measure(row, round_index):
        head_dim, seqlen, batch, nheads, causal = (row[key] for key in ("hd", "S", "B", "H", "causal"))
        fwd_flops = 4 * batch * nheads * seqlen**2 * head_dim / (2 if causal else 1)
        if interleave:  # naive (seconds per call at 16K) alone in round 0, the others interleaved
            if round_index == 0:
                keep_best(row, "naive", time_impl("naive", batch, seqlen, nheads, head_dim, causal, repeats),
                          fwd_flops)
            cases = {impl: (attention_fn(impl, causal), *unpack_inputs(
                make_inputs(impl, batch, seqlen, nheads, head_dim, requires_grad=True))) for impl in IMPLS[:-1]}
            for impl, times in time_passes_interleaved(
                    cases, repeats, f"hd{head_dim} S{seqlen} causal={causal}").items():
                keep_best(row, impl, times, fwd_flops)
            del cases
        else:
            for impl in round_order(IMPLS if round_index == 0 else IMPLS[:-1], round_index):
                keep_best(row, impl, time_impl(impl, batch, seqlen, nheads, head_dim, causal, repeats), fwd_flops)
        if round_index == rounds - 1:
            print(format_row(row), flush=True)

    rounds_over_cells(rows, rounds, measure)
    return rows


def ratio(row, impl, other, kind):
    a, b = row.get(f"{impl}_{kind}"), row.get(f"{other}_{kind}")
    return None if not a or not b else a / b


GRID_SHOWN = ("flashtrain", "fa4", "fa2", "cudnn")  # the columns of the progress lines and the markdown table
GRID_HEADER = ("TFLOP/s            | fwd: flashtrain fa4 fa2 cudnn | ft/fa4 ft/fa2 ft/cudnn | bwd: ... | ... | "
               "fwd+bwd: ... | ...")


def format_row(row) -> str:
    def cell(x, width=6, digits=0):
        return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"
    parts = [f"hd{row['hd']:<4}{'causal' if row['causal'] else 'full':<7}S{row['S']:<6}"]
    for kind, _ in PASSES:
        parts.append(" ".join(cell(row[f"{impl}_{kind}"]) for impl in GRID_SHOWN))
        parts.append("".join(cell(ratio(row, "flashtrain", other, kind), 6, 2) for other in GRID_SHOWN[1:]))
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


def grid_markdown(rows, fa4: str = fa4_baseline.NOT_INSTALLED) -> str:
    """The grid as a markdown table: TFLOP/s of flashtrain, FA4, FA2 and cuDNN and flashtrain / FA4 and / cuDNN, per
    pass; fa4: FA4's version ("not installed": its cells say so)."""
    def cell(x, digits=0, impl=""):
        if x is None and impl == "fa4" and fa4 == fa4_baseline.NOT_INSTALLED:
            return fa4
        return "-" if x is None else f"{x:.{digits}f}"
    head = "| hd | mask | S | B x H |" + "".join(f" {k}: flashtrain | FA4 | FA2 | cuDNN | ft/FA4 | ft/cuDNN |"
                                                for k, _ in PASSES)
    lines = [head, "|" + "---|" * (4 + 6 * len(PASSES))]
    for row in rows:
        cells = [str(row["hd"]), "causal" if row["causal"] else "full", str(row["S"]), f"{row['B']} x {row['H']}"]
        for kind, _ in PASSES:
            cells += [cell(row[f"{impl}_{kind}"], impl=impl) for impl in GRID_SHOWN]
            cells += [cell(ratio(row, "flashtrain", other, kind), 2, other) for other in ("fa4", "cudnn")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matmul_tflops(n: int = 8192, repeats: int = 30) -> float:
    """bf16 (n, n) @ (n, n) rate in TFLOP/s: the ceiling the 75% target is measured against, in the same run."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return round(2 * n**3 / median_ms(lambda: a @ b, 10, repeats) / 1e9, 1)


def grid_summary(rows, matmul: float) -> str:
    """The bar's numbers: worst flashtrain / cuDNN and / FA2 per pass; best hd128 full S>=4K forward / matmul rate."""
    parts = []
    for other in ("cudnn", "fa4", "fa2"):
        if not any(ratio(row, "flashtrain", other, kind) for row in rows for kind, _ in PASSES):
            continue  # (FA4 not installed)
        worst = {kind: min((ratio(row, "flashtrain", other, kind) or 0) for row in rows) for kind, _ in PASSES}
        parts.append(f"worst flashtrain/{other}: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    hd128 = [row["flashtrain_fwd"] or 0 for row in rows if row["hd"] == 128 and not row["causal"] and row["S"] >= 4096]
    if hd128:
        parts.append(f"hd128 full S>=4K forward {max(hd128):.0f} TFLOP/s = {max(hd128) / matmul:.0%} of bf16 matmul "
                     f"({matmul:.0f})")
    return "; ".join(parts)


# ---- sustained speed: one implementation back to back ---------------------------------------------------------

SUSTAINED_IMPLS = ("flashtrain", "fa4", "cudnn")
SUSTAINED_QUEUE = 16  # calls the host keeps queued ahead of the GPU


def sustained_ms(call, seconds: float) -> float:
    """Median ms of the second half of `call`'s calls, run back to back for `seconds` (at least 20 calls) after 3
    warm-up calls: each between CUDA events; the host waits only for the call SUSTAINED_QUEUE before the newest, so
    the GPU never idles and its clocks settle where this implementation's own power draw puts them."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    events = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(events) < 20:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        events.append((begin, end))
        if len(events) > SUSTAINED_QUEUE:
            events[-SUSTAINED_QUEUE - 1][1].synchronize()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(end) for begin, end in events[len(events) // 2:])


def sustained_ms_clocks(call, seconds: float) -> tuple[float, tuple]:
    """sustained_ms(call, seconds) and the (SM clock MHz, board power W) of its steady state (gpu_clocks); (None, None)
    where nvidia-smi is missing or gives no samples (said each time), so that the speed is still recorded."""
    with contextlib.ExitStack() as stack:
        try:
            samples = stack.enter_context(gpu_clocks.smi_samples())
        except FileNotFoundError as error:
            samples = None
            print(f"  sustained: no SM clock / power: {error}")
        ms = sustained_ms(call, seconds)
    if not samples:
        if samples is not None:
            print("  sustained: no SM clock / power: nvidia-smi gave no samples")
        return ms, (None, None)
    mhz, watts, _ = gpu_clocks.steady_state(samples)
    return ms, (round(mhz), round(watts))


def sustained_rounds(measure, rounds: int, impls=SUSTAINED_IMPLS) -> dict:
    """{(impl, kind): [TFLOP/s of each round]} from measure(impl) -> {kind: TFLOP/s or None} over `rounds` rounds of
    impls, the order reversed every other round (round_order): each implementation runs alone for a few seconds and
    the board's temperature carries over from whatever ran before it, so no implementation always goes first."""
    results = {}
    for round_index in range(rounds):
        for impl in round_order(impls, round_index):
            for kind, tflops in measure(impl).items():
                results.setdefault((impl, kind), []).append(tflops)
    return results


def sustained_fields(results: dict) -> dict:
    """A sustained row's fields from sustained_rounds' results: {impl}_{kind}_sustained (the mean of the rounds; None
    if a round could not run), {impl}_{kind}_sustained_rounds and the ratios ft_over_{impl}_{kind}."""
    row = {}
    for (impl, kind), values in results.items():
        row[f"{impl}_{kind}_sustained"] = (None if not values or None in values
                                           else round(statistics.fmean(values), 1))
        row[f"{impl}_{kind}_sustained_rounds"] = values
    for other in SUSTAINED_IMPLS[1:]:
        for kind in ("fwd", "fb"):
            ft, them = row["flashtrain_" + kind + "_sustained"], row[f"{other}_{kind}_sustained"]
            row[f"ft_over_{other}_{kind}"] = round(ft / them, 3) if ft and them else None
    return row


def sustained(seqlens, seconds: float, rounds: int = 1, on_row=None, done=()) -> list[dict]:
    """Head dim 128 rows of the grid (full and causal at each seqlen): TFLOP/s of each SUSTAINED_IMPLS, forward and
    forward+backward, each alone for `seconds`, in `rounds` rounds (sustained_rounds); sustained_fields' keys.
    on_row(rows): called with the rows so far each time one is measured (the callers write their record then).
    done: the rows a cut run measured with the same seconds and rounds (--resume): kept first, not measured again."""
    rows = [dict(row) for row in done]
    for seqlen in seqlens:
        batch, nheads = TOKENS // seqlen, HIDDEN // 128
        for causal in (False, True):
            if any(row["S"] == seqlen and row["causal"] == causal for row in rows):
                continue
            fwd_flops = 4 * batch * nheads * seqlen**2 * 128 / (2 if causal else 1)
            row = {"hd": 128, "S": seqlen, "B": batch, "H": nheads, "causal": causal, "seconds": seconds,
                   "rounds": rounds}

            def measure(impl):
                fn = attention_fn(impl, causal)
                q, k, v, dout = make_inputs(impl, batch, seqlen, nheads, 128, requires_grad=True)
                tflops = {}
                for kind, factor in (("fwd", 1.0), ("fb", 3.5)):
                    try:
                        if kind == "fwd":
                            with torch.no_grad():
                                ms, clocks = sustained_ms_clocks(lambda: fn(q, k, v), seconds)
                        else:
                            ms, clocks = sustained_ms_clocks(
                                lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), seconds)
                        tflops[kind] = round(factor * fwd_flops / ms / 1e9, 1)
                    except (RuntimeError, ValueError, NotImplementedError) as error:
                        print(f"  sustained {impl} S{seqlen} causal={causal} {kind}: {type(error).__name__}: "
                              f"{str(error)[:120]}")
                        tflops[kind], clocks = None, (None, None)
                    tflops[kind + "_mhz"], tflops[kind + "_watts"] = clocks
                del q, k, v, dout
                torch.cuda.empty_cache()
                return tflops

            row.update(sustained_fields(sustained_rounds(measure, rounds)))
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            print(f"sustained hd128 {'causal' if causal else 'full'} S{seqlen}: " + "; ".join(
                f"{kind} " + " ".join(f"{impl} {row[f'{impl}_{kind}_sustained'] or '-'}" for impl in SUSTAINED_IMPLS)
                for kind in ("fwd", "fb")) + " TFLOP/s; SM MHz / W: " + "; ".join(
                f"{kind} " + " ".join(f"{impl} {row.get(f'{impl}_{kind}_mhz_sustained') or '-'} / "
                                      f"{row.get(f'{impl}_{kind}_watts_sustained') or '-'}" for impl in SUSTAINED_IMPLS)
                for kind in ("fwd", "fb")), flush=True)
    return rows


def sustained_markdown(rows, fa4: str = fa4_baseline.NOT_INSTALLED) -> str:
    """TFLOP/s of each implementation alone for the row's seconds (the mean of its rounds), and flashtrain / FA4 and /
    cuDNN."""
    def cell(x, impl="", digits=0):
        if x is None:
            return fa4 if impl == "fa4" and fa4 == fa4_baseline.NOT_INSTALLED else "-"
        return f"{x:.{digits}f}"
    head = "| hd | mask | S | seconds x rounds |" + "".join(f" {k}: flashtrain | FA4 | cuDNN | ft/FA4 | ft/cuDNN |"
                                                  for k in ("fwd", "fwd+bwd"))
    lines = [head, "|" + "---|" * 14]
    for row in rows:
        cells = [str(row["hd"]), "causal" if row["causal"] else "full", str(row["S"]),
                 f"{row['seconds']:g} x {row.get('rounds', 1)}"]
        for kind in ("fwd", "fb"):
            cells += [cell(row[f"{impl}_{kind}_sustained"], impl) for impl in SUSTAINED_IMPLS]
            cells += [cell(row[f"ft_over_{other}_{kind}"], other, 2) for other in SUSTAINED_IMPLS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    if any(row.get(f"{impl}_{kind}_mhz_sustained") for row in rows for impl in SUSTAINED_IMPLS
           for kind in ("fwd", "fb")):
        # the clocks the power cap left each implementation, and TFLOP/s per GHz (the work per clock)
        names = " / ".join(IMPL_NAMES[impl] for impl in SUSTAINED_IMPLS)
        lines += ["", "| hd | mask | S |" + "".join(f" {k}: SM MHz ({names}) | W | TFLOP/s per GHz |"
                                                 for k in ("fwd", "fwd+bwd")), "|" + "---|" * 9]
        for row in rows:
            cells = [str(row["hd"]), "causal" if row["causal"] else "full", str(row["S"])]
            for kind in ("fwd", "fb"):
                mhz = [row.get(f"{impl}_{kind}_mhz_sustained") for impl in SUSTAINED_IMPLS]
                watts = [row.get(f"{impl}_{kind}_watts_sustained") for impl in SUSTAINED_IMPLS]
                per_ghz = [row[f"{impl}_{kind}_sustained"] / m * 1e3 if m and row[f"{impl}_{kind}_sustained"] else None
                           for impl, m in zip(SUSTAINED_IMPLS, mhz)]
                cells += [" / ".join(cell(x, impl) for impl, x in zip(SUSTAINED_IMPLS, values))
                          for values in (mhz, watts, per_ghz)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- workloads outside the grid: head dims, GQA, dropout, varlen, GPT-2 small ------------------------------------

WORKLOAD_IMPLS = ("flashtrain", "fa4", "fa2", "cudnn", "efficient")
IMPL_NAMES = {"flashtrain": "flashtrain", "fa4": "FA4", "fa2": "FA2", "cudnn": "cuDNN", "efficient": "efficient"}


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    seqlen: int  # varlen: the longest sequence (SDPA's padded length)
    nheads: int  # query heads
    nheads_kv: int  # k/v heads (GQA when fewer than nheads)
    head_dim: int
    causal: bool
    dropout_p: float = 0.0
    lengths: tuple[int, ...] | None = None  # varlen: one length per sequence (batch of them)

    def fwd_flops(self) -> float:
        """4 * nheads * L^2 * head_dim per sequence (halved when causal): useful work only, never padding."""
        lengths = self.lengths or (self.seqlen,) * self.batch
        return sum(4 * self.nheads * L * L * self.head_dim for L in lengths) / (2 if self.causal else 1)

    def shape(self) -> str:
        heads = f"H{self.nheads}" + (f"/{self.nheads_kv}kv" if self.nheads_kv != self.nheads else "")
        if self.lengths:
            tokens = f"{self.batch} seqs L {min(self.lengths)}-{max(self.lengths)} ({sum(self.lengths)} tokens)"
        else:
            tokens = f"B{self.batch} S{self.seqlen}"
        mask = "causal" if self.causal else "full"
        return f"{tokens} {heads} d{self.head_dim} {mask}" + (f" p={self.dropout_p}" if self.dropout_p else "")


def hidden_heads(head_dim: int) -> int:
    """HIDDEN / head_dim rounded down to a power of two: 64 -> 32, 80 and 96 -> 16, 128 -> 16, 192 and 256 -> 8."""
    return 1 << ((HIDDEN // head_dim).bit_length() - 1)


def varlen_lengths(count: int = 64, low: int = 128, high: int = 512, seed: int = 0) -> tuple[int, ...]:
    """count lengths uniform in [low, high], the same on every machine (Python's seeded Mersenne Twister)."""
    draw = random.Random(seed)
    return tuple(draw.randint(low, high) for _ in range(count))


def workloads() -> list[Workload]:
    rows = [Workload(f"hd{d} 4K causal", TOKENS // 4096, 4096, hidden_heads(d), hidden_heads(d), d, True)
            for d in (64, 80, 96, 128, 192, 256)]
    lengths = varlen_lengths()
    rows += [
        Workload("GQA 32/8 8K causal", 2, 8192, 32, 8, 128, True),
        Workload("GQA 16/2 4K causal", 4, 4096, 16, 2, 128, True),
        Workload("dropout 0.1 BERT-large 512", 32, 512, 16, 16, 64, False, dropout_p=0.1),
        Workload("varlen 64 x [128, 512]", len(lengths), max(lengths), 16, 16, 64, False, lengths=lengths),
        Workload("GPT-2 small 1K causal", 16, 1024, 12, 12, 64, True),
    ]
    return rows


def workload_case(impl: str, w: Workload):
    """(fn, (q, k, v), dout) of one implementation on workload w."""
    if w.lengths is not None:
        return varlen_case(impl, w)
    q, k, v, dout = make_inputs(impl, w.batch, w.seqlen, w.nheads, w.head_dim, True, nheads_kv=w.nheads_kv)
    fn = attention_fn(impl, w.causal, dropout_p=w.dropout_p, enable_gqa=w.nheads_kv != w.nheads)
    return fn, (q, k, v), dout


def varlen_case(impl: str, w: Workload):
    """flashtrain: packed (total, nheads, head_dim) with cu_seqlens. SDPA: padded (batch, nheads, max_len, head_dim)
    and a key-padding mask (padded queries still attend to the real keys: the work SDPA would do in a model)."""
    lengths = torch.tensor(w.lengths, device="cuda")
    if impl in FLASH_LAYOUT:
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # (batch + 1,), starts at 0
        q, k, v, dout = (torch.randn(sum(w.lengths), w.nheads, w.head_dim, device="cuda", dtype=torch.bfloat16,
                                     requires_grad=True) for _ in range(4))

        def fn(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, w.seqlen, w.seqlen,
                                          dropout_p=w.dropout_p, causal=w.causal, impl="cuda")
        if impl == "fa4":
            fn = fa4_baseline.varlen_attention(cu_seqlens, w.seqlen, w.causal, w.dropout_p)
        return fn, (q, k, v), dout
    key_padding = torch.arange(w.seqlen, device="cuda") < lengths[:, None]  # (batch, max_len), True = a real key
    fn = attention_fn(impl, w.causal, dropout_p=w.dropout_p, attn_mask=key_padding[:, None, None, :])
    q, k, v, dout = make_inputs(impl, w.batch, w.seqlen, w.nheads, w.head_dim, True)
    return fn, (q, k, v), dout


def add_ratios(row: dict) -> None:
    """Per pass: the fastest SDPA backend that ran it (sdpa_best_{pass}) and flashtrain / it (ratio_{pass});
    flashtrain / FA4 (ratio_fa4_{pass}, None where FA4 did not run)."""
    for kind, _ in PASSES:
        ft, fa4 = row.get(f"flashtrain_{kind}"), row.get(f"fa4_{kind}")
        row[f"ratio_fa4_{kind}"] = round(ft / fa4, 3) if ft and fa4 else None
        ran = [(row[f"{impl}_{kind}"], impl) for impl in SDPA_BACKENDS if row.get(f"{impl}_{kind}")]
        best_tflops, best = max(ran) if ran else (None, None)
        flashtrain = row.get(f"flashtrain_{kind}")
        row[f"sdpa_best_{kind}"] = best
        row[f"ratio_{kind}"] = round(flashtrain / best_tflops, 3) if flashtrain and best_tflops else None


def workload_speed(repeats: int, rounds: int, interleave: bool = True) -> list[dict]:
    """One row per workload: best-round ms and TFLOP/s of each implementation per pass, and the ratios (rounds outer,
    rounds_over_cells)."""
    cells = [(w, {"name": w.name, "shape": w.shape(), **asdict(w), "fwd_gflop": round(w.fwd_flops() / 1e9, 2)})
             for w in workloads()]

    def measure(cell, round_index):
        w, row = cell
        if interleave:
            # (a backend that refused every pass in round 0 would again)
            cases = {impl: workload_case(impl, w) for impl in WORKLOAD_IMPLS
                     if not round_index or any(row[f"{impl}_{kind}"] is not None for kind, _ in PASSES)}
            for impl, times in time_passes_interleaved(cases, repeats, w.name).items():
                keep_best(row, impl, times, w.fwd_flops())
            del cases
        else:
            for impl in round_order(WORKLOAD_IMPLS, round_index):
                if round_index and all(row[f"{impl}_{kind}"] is None for kind, _ in PASSES):
                    continue  # refused every pass in round 0: it will again
                fn, inputs, dout = workload_case(impl, w)
                keep_best(row, impl, time_passes(fn, inputs, dout, repeats, f"{impl} {w.name}"), w.fwd_flops())
                del fn, inputs, dout
        if round_index == rounds - 1:
            add_ratios(row)
            print(format_workload(row), flush=True)

    rounds_over_cells(cells, rounds, measure)
    return [row for _, row in cells]


def format_workload(row) -> str:
    """One progress line: fwd and fwd+bwd ms of each implementation, then the ratios."""
    def ms(impl, kind):
        x = row[f"{impl}_{kind}_ms"]
        return f"{IMPL_NAMES[impl]} " + ("-" if x is None else f"{x:.3f}")
    parts = [f"{row['name']:<28}"]
    for kind in ("fwd", "fb"):
        ratio_text = "-" if row[f"ratio_{kind}"] is None else f"{row[f'ratio_{kind}']:.2f}"
        fa4_text = "-" if row[f"ratio_fa4_{kind}"] is None else f"{row[f'ratio_fa4_{kind}']:.2f}"
        parts.append(f"{kind} ms " + ", ".join(ms(impl, kind) for impl in WORKLOAD_IMPLS)
                     + f"; ft/best SDPA {ratio_text} ({row[f'sdpa_best_{kind}'] or '-'}); ft/FA4 {fa4_text}")
    return " | ".join(parts)


def workloads_markdown(rows, fa4: str = fa4_baseline.NOT_INSTALLED) -> str:
    """Three lines per workload (fwd, bwd, fwd+bwd); each cell 'ms / TFLOP/s'; fa4: FA4's version ("not
    installed": its cells say so)."""
    head = ("| workload | shape | pass | " + " | ".join(IMPL_NAMES[impl] for impl in WORKLOAD_IMPLS)
            + " | flashtrain / fastest SDPA | flashtrain / FA4 |")
    lines = [head, "|" + "---|" * (5 + len(WORKLOAD_IMPLS))]
    missing = fa4 == fa4_baseline.NOT_INSTALLED
    for row in rows:
        for index, (kind, _) in enumerate(PASSES):
            cells = [row["name"], row["shape"]] if index == 0 else ["", ""]
            cells.append({"fwd": "fwd", "bwd": "bwd", "fb": "fwd+bwd"}[kind])
            for impl in WORKLOAD_IMPLS:
                ms, tflops = row[f"{impl}_{kind}_ms"], row[f"{impl}_{kind}"]
                cells.append((fa4 if impl == "fa4" and missing else "-") if ms is None else f"{ms:.3f} / {tflops:.0f}")
            best = row[f"ratio_{kind}"]
            cells.append("-" if best is None else f"{best:.2f} ({IMPL_NAMES[row[f'sdpa_best_{kind}']]})")
            vs_fa4 = row[f"ratio_fa4_{kind}"]
            cells.append((fa4 if missing else "-") if vs_fa4 is None else f"{vs_fa4:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_workloads(rows, path: Path, gpu: str) -> None:
    """Bars: flashtrain / fastest SDPA backend per workload, forward and forward+backward; the line at 1 is parity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 5))
    x = range(len(rows))
    for offset, kind, label in ((-0.2, "fwd", "forward"), (0.2, "fb", "forward + backward")):
        heights = [row[f"ratio_{kind}"] or math.nan for row in rows]
        bars = ax.bar([i + offset for i in x], heights, width=0.4, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    top = max([row[f"ratio_{kind}"] or 0 for row in rows for kind in ("fwd", "fb")] + [1.0])
    ax.set_ylim(0, 1.3 * top)  # headroom for the legend and the labels
    ax.set_xticks(list(x), [row["name"] for row in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("flashtrain / fastest SDPA backend")
    ax.set_title(f"Attention workloads, bf16, {gpu}")
    ax.legend(loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
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


def selftest() -> None:
    """The CPU-side parts on synthetic times (no GPU): FLOPs and shapes, best-round folding, ratios, tables, plots."""
    import tempfile

    fake = random.Random(1)
    assert [hidden_heads(d) for d in (64, 80, 96, 128, 192, 256)] == [32, 16, 16, 16, 8, 8]
    lengths = varlen_lengths()
    assert lengths == varlen_lengths() and len(lengths) == 64 and 128 <= min(lengths) <= max(lengths) <= 512
    rows = workloads()
    assert rows[0].fwd_flops() == 4 * 4 * 32 * 4096**2 * 64 / 2
    assert rows[9].fwd_flops() == sum(4 * 16 * L * L * 64 for L in lengths)
    refused = {("fa2", "varlen"), ("efficient", "GQA"), ("cudnn", "dropout"), ("fa4", "dropout")}  # (impl, prefix)
    workload_rows = []
    for w in rows:
        row = {"name": w.name, "shape": w.shape(), **asdict(w), "fwd_gflop": round(w.fwd_flops() / 1e9, 2)}
        for _ in range(2):
            for impl in WORKLOAD_IMPLS:
                no = any(impl == i and w.name.startswith(p) for i, p in refused)
                times = {} if no else {k: f * w.fwd_flops() / 4e11 * fake.uniform(0.8, 1.2) for k, f in PASSES}
                keep_best(row, impl, times, w.fwd_flops())
        add_ratios(row)
        workload_rows.append(row)
        print(format_workload(row))
    assert workload_rows[9]["fa2_fwd"] is None and workload_rows[9]["sdpa_best_fwd"] in ("cudnn", "efficient")
    assert workload_rows[8]["ratio_fa4_fwd"] is None and workload_rows[0]["ratio_fa4_fwd"] > 0
    steady = []
    for seqlen, causal in ((4096, False), (16384, True)):
        row = {"hd": 128, "S": seqlen, "B": TOKENS // seqlen, "H": 16, "causal": causal, "seconds": 5.0, "rounds": 2}
        row.update(sustained_fields(sustained_rounds(
            lambda impl: {kind: None if impl == "fa4" and causal else fake.uniform(*span)
                          for kind, span in (("fwd", (400, 600)), ("fb", (400, 600)), ("fwd_mhz", (1500, 1700)),
                                             ("fwd_watts", (650, 700)), ("fb_mhz", (1600, 1800)),
                                             ("fb_watts", (650, 700)))},
            2)))
        steady.append(row)
    grid_rows = []
    for head_dim, seqlen, causal in ((64, 1024, False), (128, 4096, False), (128, 8192, True)):
        batch, nheads = TOKENS // seqlen, HIDDEN // head_dim
        fwd_flops = 4 * batch * nheads * seqlen**2 * head_dim / (2 if causal else 1)
        row = {"hd": head_dim, "S": seqlen, "B": batch, "H": nheads, "causal": causal}
        for impl in IMPLS:
            keep_best(row, impl, {} if impl == "naive" and seqlen > 4096 else
                      {k: f * fwd_flops / 5e11 * fake.uniform(0.8, 1.2) for k, f in PASSES}, fwd_flops)
        grid_rows.append(row)
        print(format_row(row))
    with tempfile.TemporaryDirectory() as folder:
        plot(grid_rows, Path(folder) / "grid.png")
        plot_workloads(workload_rows, Path(folder) / "workloads.png", "CPU selftest")
        json.dumps({"rows": grid_rows, "workloads": workload_rows})
    print(grid_summary(grid_rows, 800.0))
    no_fa4 = [{key: None if key.startswith("fa4_") else value for key, value in row.items()} for row in grid_rows]
    assert "not installed" in grid_markdown(no_fa4) and "not installed" not in grid_markdown(grid_rows, "4.0")
    print(grid_markdown(grid_rows, "4.0") + "\n\n" + workloads_markdown(workload_rows, "4.0") + "\n\n"
          + sustained_markdown(steady, "4.0") + "\n\n" + sustained_markdown(steady))


def write_record(out: Path, record: dict) -> None:
    """The record's JSON at out, replaced whole (written beside it, then renamed over it): a reader never finds half of
    one."""
    part = out.with_name(out.name + ".part")
    part.write_text(json.dumps(record, indent=1))
    part.replace(out)


def resumable(out: Path, env: dict, settings: dict) -> dict | None:
    """--resume: the record at out that a cut run of the same measurement left (None: there is none; a finished one
    is returned too, complete). It must come from the same GPU, source commit, FA4 version and settings, else the
    run stops: a resumed record mixes two processes' numbers only when nothing that could change them differs."""
    if not out.exists():
        return None
    record = json.loads(out.read_text())
    old = record.get("env", {})
    for key in ("gpu", "commit", "fa4", "torch"):
        if old.get(key) != env.get(key):
            raise SystemExit(f"--resume: {out} was measured with {key} {old.get(key)!r}, this run has "
                             f"{env.get(key)!r}; move it away to measure anew")
    if record.get("settings") != settings:
        raise SystemExit(f"--resume: {out} was measured with settings {record.get('settings')}, this run has "
                         f"{settings}; move it away to measure anew")
    return record


def resumed_env(record: dict) -> dict:
    """A resumed record's env: the first run's, plus the UTC start of each continuation (env["resumed"])."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {**record["env"], "resumed": [*record["env"].get("resumed", []), now]}


def run_grid(args, env: dict, out: Path) -> str:
    """The 24-configuration grid (+ memory sweep): JSON and PNG at out; returns its markdown table. args.resume: a
    cut run's record at out is continued (its grid rows and memory kept, the sustained rows it lacks measured); a
    complete one is reported as it is."""
    seqlens = args.seqlens or ([1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    settings = {"seqlens": seqlens, "repeats": 5 if args.quick else args.repeats,
                "rounds": 1 if args.quick else args.rounds, "timing": args.timing, "sustained": args.sustained,
                "sustained_rounds": args.sustained_rounds}
    record = resumable(out, env, settings) if args.resume else None
    if record is not None and record.get("complete"):
        print(f"--resume: {out} is complete; not measured again")
        steady = record.get("sustained") or []
        return "\n\n".join([grid_markdown(record["rows"], env["fa4"])]
                             + ([sustained_markdown(steady, env["fa4"])] if steady else []))
    out.parent.mkdir(parents=True, exist_ok=True)
    if record is not None:  # the grid rows and memory are written together: only sustained rows can be missing
        print(f"--resume: {out} has the grid and {len(record.get('sustained') or [])} sustained rows; continuing")
        record = {**record, "env": resumed_env(record)}
        rows = record["rows"]
    else:
        print(GRID_HEADER)
        rows = speed(seqlens, settings["repeats"], settings["rounds"], interleave=args.timing == "interleaved")
        mem = [] if args.quick or args.seqlens else memory([1024, 2048, 4096, 8192, 16384, 32768, 65536])
        # The record is written before the sustained rows and again after each, "complete" once all are in: a run
        # cut short (a time limit, a lost machine) keeps what it measured, and --resume continues it.
        record = {"env": env, "settings": settings, "rows": rows, "memory": mem, "sustained": [], "complete": False}
        write_record(out, record)
    plot(rows, out.with_suffix(".png"))
    if args.sustained > 0:
        record["sustained"] = sustained([S for S in seqlens if S >= 4096], args.sustained, args.sustained_rounds,
                                        on_row=lambda done: write_record(out, {**record, "sustained": done}),
                                        done=record.get("sustained") or [])
    record["complete"] = True
    write_record(out, record)
    steady = record["sustained"]
    print(f"wrote {out}; {grid_summary(rows, env['bf16_matmul_tflops'])}")
    tables = [grid_markdown(rows, env["fa4"])]
    return "\n\n".join(tables + ([sustained_markdown(steady, env["fa4"])] if steady else []))


def run_workloads(args, env: dict, out: Path) -> str:
    """The workloads table: JSON and PNG at out; returns its markdown table. args.resume: as run_grid's (a cut run's
    workload rows kept, the feature rows measured)."""
    # the feature rows: the features against FlexAttention and plain attention (benchmarks/attention_features.py)
    import attention_features

    repeats, rounds = 5 if args.quick else args.repeats, 1 if args.quick else args.rounds
    settings = {"repeats": repeats, "rounds": rounds, "timing": args.timing}
    record = resumable(out, env, settings) if args.resume else None
    if record is not None and record.get("complete"):
        print(f"--resume: {out} is complete; not measured again")
        rows, features = record["rows"], record["features"]
        return workloads_markdown(rows, env["fa4"]) + "\n\n" + attention_features.markdown(features, env["fa4"])
    out.parent.mkdir(parents=True, exist_ok=True)
    if record is not None:
        print(f"--resume: {out} has the workload rows; measuring the feature rows")
        rows, env = record["rows"], resumed_env(record)
    else:
        rows = workload_speed(repeats, rounds, interleave=args.timing == "interleaved")
        write_record(out, {"env": env, "settings": settings, "rows": rows, "features": [],
                           "complete": False})  # (kept if the rest is cut)
    features = attention_features.run(repeats, rounds)
    write_record(out, {"env": env, "settings": settings, "rows": rows, "features": features, "complete": True})
    plot_workloads(rows, out.with_suffix(".png"), env["gpu"])
    below = [row["name"] for row in rows if (row["ratio_fwd"] or 0) < 1.0]
    print(f"wrote {out}; forward below the fastest SDPA backend in {len(below)} of {len(rows)} rows: {below}")
    return workloads_markdown(rows, env["fa4"]) + "\n\n" + attention_features.markdown(features, env["fa4"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seqlens 1K and 4K, 5 repeats, 1 round, no memory sweep")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None,
                        help="the grid at these sequence lengths only (batch x seqlen = 16K tokens), no memory sweep "
                             "(a check of some rows, not a record of the grid)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timing", choices=("interleaved", "windows"), default="interleaved",
                        help="interleaved: each repeat calls every implementation once (same clocks for all); "
                             "windows: each implementation's repeats back to back, implementations in turn (the "
                             "method of the records before 2026-11-26)")
    parser.add_argument("--sustained", type=float, default=None,
                        help="seconds each implementation runs alone per sustained hd128 row (default: 5 with "
                             "--all and --sustained-only, else 0 = none)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (PNG beside it): of the grid, or with --workloads of the workloads table "
                             "(with --all the workloads file goes beside the grid's); with --block-sparse a directory")
    parser.add_argument("--sustained-rounds", type=int, default=2,
                        help="rounds of the sustained rows, the implementations' order reversed every other round; "
                             "each row reports the mean of its rounds")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--block-sparse", action="store_true", help="block-sparse scaling against density only")
    mode.add_argument("--workloads", action="store_true", help="the workloads table only")
    mode.add_argument("--all", action="store_true", help="the grid (+ memory), then the workloads table")
    parser.add_argument("--resume", action="store_true",
                        help="continue the records at the output paths that a cut run left (same GPU, commit, FA4, "
                             "torch and settings, else stop): the grid and workload rows they hold are kept, the rest "
                             "measured; complete ones are reported as they are (--all across two time-limited calls)")
    mode.add_argument("--sustained-only", action="store_true", help="the sustained hd128 rows only (S 4K, 8K, 16K)")
    mode.add_argument("--selftest", action="store_true", help="tables and plots on synthetic numbers, CPU only")
    parser.add_argument("--require-fa4", action="store_true",
                        help="stop at once, naming the import error, where flash-attn-4 cannot be imported (a run "
                             "meant to compare with FA4 then measures nothing instead of leaving its columns empty)")
    args = parser.parse_args()
    if args.require_fa4 and not args.selftest:
        fa4_baseline.require()
    if args.sustained is None:
        args.sustained = 5.0 if args.all or args.sustained_only else 0.0
    if args.sustained < 0 or args.sustained_rounds < 1 or args.rounds < 1:
        parser.error("--sustained must be >= 0, --sustained-rounds >= 1 and --rounds >= 1")
    if args.resume and (args.block_sparse or args.sustained_only or args.selftest):
        parser.error("--resume continues the grid and workloads records (the default, --workloads, --all)")
    if args.seqlens and any(s < 1 or TOKENS % s for s in args.seqlens):
        parser.error(f"--seqlens: each must divide the grid's {TOKENS} tokens per batch (got {args.seqlens})")
    if args.selftest:
        selftest()
        return
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count, "bf16_matmul_tflops": matmul_tflops(),
           "timing": args.timing + (", GPU held while the host queues each pass's calls" if args.timing == "interleaved"
                                     else ""), "fa4": fa4_baseline.version(),
           **gpu_clocks.board(), **gpu_clocks.memory_system(torch.cuda.get_device_properties(0).L2_cache_size),
           "commit": gpu_clocks.source_commit(Path(__file__).resolve().parent)}
    print(json.dumps(env))
    if args.block_sparse:
        out_dir = args.out or RESULTS
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = block_sparse_speed(5 if args.quick else 10, 1 if args.quick else 2)
        (out_dir / "block_sparse.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        plot_block_sparse(rows, out_dir / "block_sparse.png")
        print(f"wrote {out_dir / 'block_sparse.json'} and .png")
        return
    tag = gpu.replace(" ", "_")
    if args.sustained_only:
        out = args.out or RESULTS / f"attention_sustained-{tag}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        steady = sustained([4096, 8192, 16384], args.sustained, args.sustained_rounds,
                           on_row=lambda done: write_record(out, {"env": env, "sustained": done, "complete": False}))
        write_record(out, {"env": env, "sustained": steady, "complete": True})
        print(f"wrote {out}\n\n{sustained_markdown(steady, env['fa4'])}")
        return
    grid_out = (None if args.workloads else args.out) or RESULTS / f"attention-{tag}.json"
    workloads_out = (args.out if args.workloads else None) or grid_out.parent / f"attention_workloads-{tag}.json"
    tables = [] if args.workloads else [run_grid(args, env, grid_out)]
    if args.workloads or args.all:
        tables.append(run_workloads(args, env, workloads_out))
    print("\n\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
