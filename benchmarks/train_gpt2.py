"""GPT-2 training throughput on one GPU: flashtrain's GPT2 (attn_impl=flash, optionally torch.compile'd) against
Hugging Face transformers' GPT2LMHeadModel with attn_implementation="eager" and "sdpa", or (--vs-sdpa) against the
same flashtrain GPT2 on PyTorch SDPA (its default backend choice, cuDNN forced, FA2 forced), in one process.

Every implementation runs the same training step on the same random tokens: bf16 autocast (fp32 on the CPU),
forward, float32 cross-entropy over the full vocabulary (--loss chunked: flashtrain's GPT2 computes it a chunk of
tokens at a time without the logits, model.chunked_loss), backward, grad-norm clipping at 1.0, fused AdamW, with the
same micro-batch (--batch-tokens / seq_len sequences). Dropout is off everywhere. The step time is the median of
--steps timed steps (CUDA events) after --warmup untimed ones; on a GPU the implementations' steps take turns
(time_interleaved: each preceded equally often by every other, all under the same clocks and power state), every
implementation's model staying in memory meanwhile (--timing windows: each one's steps back to back).

MFU = tokens/s x model FLOPs per token / the bf16 matmul rate MEASURED in the same run (an 8192^3 torch.matmul),
both reported. Model FLOPs per token = 6 N + 12 L T d: N = parameters without the position table (the tied lm_head
is a real matmul), L layers, T context, d width; the attention term counts the full T x T scores (causality not
subtracted, as in PaLM's MFU). A configuration that runs out of GPU memory is reported as OOM.

    python benchmarks/train_gpt2.py                 # small, medium x 1K, 4K -> results/train_gpt2-<gpu>.json/.png
    python benchmarks/train_gpt2.py --compile       # also flashtrain with torch.compile
    python benchmarks/train_gpt2.py --vs-sdpa --compile   # ours vs every SDPA backend, eager and compiled
    python benchmarks/train_gpt2.py --impls flashtrain flashtrain-compile flashtrain-reduce-overhead \
        flashtrain-max-autotune --models small --seq-lens 1024   # tokens/s of each trainer.compile_mode
    python benchmarks/train_gpt2.py --device cpu --tiny --out /tmp/t.json   # smoke test (2 layers x 64 wide)
    python benchmarks/train_gpt2.py --max-batch --vs-sdpa   # the largest micro-batch that fits, per implementation
    python benchmarks/train_gpt2.py --impls flashtrain --models small --batch-tokens 32768 --out /tmp/mem.json
                                                    # peak memory at a recipe's micro-batch (gpt2-small-*: 32K tokens)

Needs torch, transformers and matplotlib only (no hydra, datasets or wandb).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func
from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.gpt2 import GPT2, GPT2Config

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 50257
MODEL_SHAPES = {  # name -> (n_layer, n_embd, n_head)
    "small": (12, 768, 12),
    "medium": (24, 1024, 16),
    "tiny": (2, 64, 2),  # CPU smoke test
}
HF_IMPLS = {"hf-eager": "eager", "hf-sdpa": "sdpa"}
# flashtrain's GPT2: flashtrain[-sdpa[-BACKEND]][-MODE]. -sdpa: attn_impl=sdpa, PyTorch's default backend choice
# (cuDNN on Hopper: what a user gets without our kernel), -sdpa-cudnn / -sdpa-fa2 that backend forced; -MODE: under
# torch.compile with that mode (trainer.compile_mode; reduce-overhead replays CUDA graphs)
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
COMPILE_MODES = {"compile": "default", "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune"}
SDPA_IMPL = "flashtrain-sdpa"
VS_SDPA = ["flashtrain", SDPA_IMPL, *(f"{SDPA_IMPL}-{backend}" for backend in SDPA_BACKENDS)]


def parse_impl(impl: str) -> tuple[str, str | None, str | None]:
    """(attention: flash | sdpa | the HF name, forced SDPA backend or None, torch.compile mode or None)."""
    rest, mode = impl, None
    for suffix, compile_mode in COMPILE_MODES.items():
        if rest.endswith(f"-{suffix}"):
            rest, mode = rest.removesuffix(f"-{suffix}"), compile_mode
    if rest in HF_IMPLS:
        return rest, None, mode
    rest = rest.removeprefix("flashtrain")
    choices = {"": ("flash", None), "-sdpa": ("sdpa", None),
               **{f"-sdpa-{backend}": ("sdpa", backend) for backend in SDPA_BACKENDS}}
    if not impl.startswith("flashtrain") or rest not in choices:
        raise ValueError(f"unknown implementation {impl!r}: flashtrain[-sdpa[-{'|-'.join(SDPA_BACKENDS)}]]"
                         f"[-{'|-'.join(COMPILE_MODES)}] or {'|'.join(HF_IMPLS)}[-{'|-'.join(COMPILE_MODES)}]")
    return (*choices[rest], mode)


def measure_matmul_flops(device: torch.device, size: int, repeats: int = 20) -> float:
    """FLOP/s of a (size x size) @ (size x size) matmul: bf16 on CUDA, float32 on the CPU; median of repeats."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = time_calls(lambda: torch.matmul(a, b), device, warmup=5, repeats=repeats)
    return 2 * size**3 / statistics.median(seconds)


def datasheet_peak_tflops(device: torch.device) -> float | None:
    """The peak bf16 TFLOP/s the trainer's logged MFU divides by (flashtrain.train.mfu: the data sheet's, or measured
    and cached for an unknown GPU); None on a CPU or without the trainer's dependencies (Hydra)."""
    try:
        from flashtrain.train.mfu import peak_bf16_tflops
    except ImportError:
        return None
    return (peak_bf16_tflops(device) or (None,))[0]


def time_calls(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn after `warmup` calls (CUDA events on a GPU: no host sync in between)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        return seconds
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1000 for start, end in events]


def balanced_order(n: int) -> list[int]:
    """An order of n items (0..n-1) in which every ordered pair of distinct items follows each other exactly once,
    closing on itself (an Eulerian circuit of the complete directed graph, Hierholzer's algorithm): repeated, every
    item is preceded by every other equally often. n = 4: [0, 3, 2, 3, 1, 3, 0, 2, 1, 2, 0, 1]."""
    if n < 2:
        return list(range(n))
    unused = {a: [b for b in range(n) if b != a] for a in range(n)}  # edges a -> b not walked yet
    stack, circuit = [0], []
    while stack:
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1][:-1]  # (the circuit ends where it began)


def hold_gpu(seconds: float, clock_hz: float = 2.0e9) -> None:
    """Queue a kernel that keeps the current stream busy for at least `seconds` (torch.cuda._sleep spins for a number
    of cycles; counted at clock_hz, at least the GPU's highest clock, so that it lasts no less)."""
    torch.cuda._sleep(int(seconds * clock_hz))


def calls_per_name(n_names: int, repeats: int) -> int:
    """How many calls of each name time_interleaved makes: whole circuits of balanced_order (n_names - 1 calls of
    each per circuit), at least `repeats`."""
    per_circuit = max(n_names - 1, 1)
    return -(-repeats // per_circuit) * per_circuit


def time_interleaved(calls: dict, repeats: int, hold_s: float = 0.0) -> dict[str, list[float]]:
    """Seconds of each call of each of `calls` ({name: fn}, already warmed up) when they take turns, each call between
    CUDA events, no host sync in between: every name then runs under the same clocks and power state (H200 at its
    700 W cap: windows of one implementation's calls back to back measured the same kernel 0.88-1.13x of cuDNN from
    run to run, interleaved within 0.3%). The turns follow balanced_order, so that every name is preceded equally
    often by every other (what ran before a call, its L2 contents and its power draw, is part of that call's
    conditions; a rotation of the names put each one after the same predecessor 3 times in 4). At least `repeats`
    calls per name (whole circuits of the order).

    hold_s > 0: the GPU first runs a sleep of that long (hold_gpu) while the host queues the calls, so that they run
    back to back and each interval is its call's GPU time. Without it a call whose predecessor left the GPU idle (a
    host path longer than that call's kernels) is timed from its start event through its own host path: short calls
    then measure the host's speed and their predecessor (benchmarks/results/timing_host_bound-h200.json). Whole
    training steps (this file's use) count their host time and take no hold."""
    names, events = list(calls), {name: [] for name in calls}
    order = balanced_order(len(names))
    circuits = calls_per_name(len(names), repeats) // max(len(names) - 1, 1)
    torch.cuda.synchronize()
    if hold_s > 0:
        hold_gpu(hold_s)
    for index in order * circuits if names else []:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[names[index]]()
        end.record()
        events[names[index]].append((start, end))
    torch.cuda.synchronize()
    return {name: [start.elapsed_time(end) / 1000 for start, end in pairs] for name, pairs in events.items()}


def build_loss_fn(impl: str, shape: tuple[int, int, int], seq_len: int, vocab_size: int, device: torch.device,
                  chunked_loss: bool = False):
    """(model, loss_fn(x, y) -> mean cross-entropy) for one implementation, parameters in float32 on `device`.
    chunked_loss: flashtrain's GPT2 computes its loss without the logits (model.chunked_loss,
    flashtrain.models.losses); False: from the full float32 logits, as the HF models do."""
    n_layer, n_embd, n_head = shape
    attn, backend, mode = parse_impl(impl)
    if impl.startswith("flashtrain"):
        config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                            n_head=n_head, attn_impl=attn, chunked_loss=chunked_loss)
        with device:
            model = GPT2(config)
        step_model = torch.compile(model, mode=mode) if mode is not None else model

        def loss_fn(x, y):  # (a forced backend also while torch.compile traces)
            with sdpa_kernel(SDPA_BACKENDS[backend]) if backend else contextlib.nullcontext():
                return step_model(x, y)[1]
        return model, loss_fn

    import transformers  # only the comparison needs it

    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)  # GPT-2's: 50256
    with device:
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation=HF_IMPLS[attn])
    return model, hf_loss_fn(model, HF_IMPLS[attn], mode)


def hf_loss_fn(model, attn_implementation: str, mode: str | None):
    """loss_fn(x, y) of a transformers causal LM (torch.compile'd with `mode` unless None): the same float32
    cross-entropy over the full logits as flashtrain's models compute."""
    if model.config._attn_implementation != attn_implementation:
        raise RuntimeError(f"transformers picked attn_implementation={model.config._attn_implementation!r}, "
                           f"not {attn_implementation!r}")
    step_model = torch.compile(model, mode=mode) if mode is not None else model

    def loss_fn(x, y):
        logits = step_model(input_ids=x).logits  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return loss_fn


def check_flash_kernel(shape: tuple[int, int, int], seq_len: int, device: torch.device) -> str:
    """Which attention flashtrain's GPT2 runs here; on CUDA, insist on the CUDA kernel (never the slow reference)."""
    if device.type != "cuda":
        return "reference (CPU)"
    n_embd, n_head = shape[1], shape[2]
    q, k, v = (torch.randn(1, seq_len, n_head, n_embd // n_head, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    flash_attn_func(q, k, v, causal=True, impl="cuda").sum().backward()  # raises with the reason if it cannot run
    return "cuda kernel"


def gpt2_flops_per_token(model, shape, seq_len: int) -> float:
    """The position table is a lookup (the same name in both libraries); the tied LM head a matmul."""
    return training_flops_per_token(model, [model.transformer.wpe], shape[0], shape[1], seq_len)


def prepare(impl: str, shape, seq_len: int, micro_batch: int, vocab_size: int, device: torch.device,
            warmup: int, chunked_loss: bool = False, build=None, flops=gpt2_flops_per_token) -> tuple:
    """One implementation's training step, warmed up: (train_step, its row's fields so far). The peak memory is what
    its warm-up steps allocated beyond what was allocated before it was built (other implementations' models stay
    in memory while the steps are interleaved). build (default build_loss_fn) and flops(model, shape, seq_len): the
    model family's (benchmarks/train_llama.py passes its own)."""
    torch.manual_seed(0)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn = (build or build_loss_fn)(impl, shape, seq_len, vocab_size, device, chunked_loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def train_step():
        with autocast:
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # returns a tensor: no host sync
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warmup + (3 if parse_impl(impl)[2] else 0)):  # compiling: 3 more
            train_step()
    n_params = sum(p.numel() for p in model.parameters())  # each tensor once (tied weights too)
    return train_step, {
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None,
        "n_params": n_params,
        "flops_per_token": flops(model, shape, seq_len),
        "warnings": sorted({str(w.message) for w in caught}),
    }


def time_steps(steps_of: dict, device: torch.device, steps: int, interleave: bool) -> dict[str, float]:
    """Median seconds of `steps` calls of each of steps_of ({name: warmed-up step}): on a GPU interleaved
    (time_interleaved) unless interleave is False, then each one's calls back to back."""
    if device.type == "cuda" and interleave:
        seconds = time_interleaved(steps_of, steps)
    else:
        seconds = {name: time_calls(step, device, warmup=0, repeats=steps) for name, step in steps_of.items()}
    return {name: statistics.median(values) for name, values in seconds.items()}


def run_config(impls, model_name, seq_len, micro_batch, vocab_size, device, warmup, steps, interleave,
               chunked_loss: bool = False, shapes=None, **family) -> list:
    """Rows of every implementation for one (model, context): each built and warmed up (its failure, an
    out-of-memory too, reported in its row), then the timed steps, on a GPU interleaved (train_gpt2.time_interleaved:
    every implementation under the same clocks) unless interleave is False (each one's steps back to back).
    shapes (default MODEL_SHAPES) and family (prepare's build / flops): another model family's."""
    rows, steps_of = {}, {}
    shape = (shapes or MODEL_SHAPES)[model_name]
    for impl in impls:
        row = rows[impl] = {"model": model_name, "seq_len": seq_len, "micro_batch": micro_batch, "impl": impl}
        try:
            if impl.startswith("flashtrain") and parse_impl(impl)[0] == "flash":
                row["attention"] = check_flash_kernel(shape, seq_len, device)
            steps_of[impl], fields = prepare(impl, shape, seq_len, micro_batch, vocab_size, device, warmup,
                                             chunked_loss, **family)
            row.update(status="ok", **fields)
        except torch.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as error:  # noqa: BLE001 -- reported in the table, the other implementations still run
            row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        gc.collect()  # a failed step's tensors are freed only once the exception is gone
    for impl, step_s in time_steps(steps_of, device, steps, interleave).items():
        rows[impl].update(step_ms=1000 * step_s, tokens_per_s=micro_batch * seq_len / step_s)
    del steps_of
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def largest_fitting(fits, limit: int) -> int:
    """The largest n in [1, limit] for which fits(n) holds, fits being monotone (true up to some n, false above):
    doubling from 1, then bisection; 0 when not even 1 fits."""
    if not fits(1):
        return 0
    good, n = 1, 2
    while n <= limit and fits(n):
        good, n = n, 2 * n
    bad = min(n, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def max_batch_rows(impls, configs, vocab_size, device, limit: int, chunked_loss: bool) -> list[dict]:
    """--max-batch: per (model, context) of configs and implementation, the largest micro-batch (sequences, at most
    `limit`) whose training step (two of them: the optimizer's state exists after the first) fits in GPU memory."""
    rows = []
    for (model_name, seq_len), impl in ((config, impl) for config in configs for impl in impls):
        def fits(micro_batch: int) -> bool:
            try:
                prepare(impl, MODEL_SHAPES[model_name], seq_len, micro_batch, vocab_size, device, 2, chunked_loss)
                return True
            except torch.OutOfMemoryError:
                return False
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        largest = largest_fitting(fits, limit)
        rows.append({"model": model_name, "seq_len": seq_len, "impl": impl, "max_micro_batch": largest,
                     "max_micro_batch_tokens": largest * seq_len, "limit": limit})
        print(f"{model_name:<7} {seq_len:>5} {impl:<29} max micro-batch {largest:>4} sequences "
              f"({largest * seq_len:,} tokens){' (the --max-batch-limit)' if largest == limit else ''}", flush=True)
    return rows


def plot_max_batch(rows: list[dict], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']} {r['seq_len']}\n{r['impl']}" for r in rows]
    ax.bar(range(len(rows)), [r["max_micro_batch_tokens"] for r in rows], color="C0")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("largest micro-batch (tokens)")
    ax.set_title(f"GPT-2 training step, {env['device_name']}, torch {env['torch']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'model':<7} {'T':>5} {'B':>3} {'impl':<29} {'tokens/s':>10} {'step ms':>8} {'MFU':>6} "
             f"{'peak GiB':>8}  speedup of flashtrain"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['model']:<7} {row['seq_len']:>5} {row['micro_batch']:>3} {row['impl']:<29} "
                         f"{row['status']}")
            continue
        peak = f"{row['peak_mem_gib']:.1f}" if row["peak_mem_gib"] is not None else "-"
        speedup = ", ".join(f"{k.removeprefix('speedup_vs_')} {v:.2f}x" for k, v in row.items()
                            if k.startswith("speedup_vs_") and v is not None)
        lines.append(f"{row['model']:<7} {row['seq_len']:>5} {row['micro_batch']:>3} {row['impl']:<29} "
                     f"{row['tokens_per_s']:>10,.0f} {row['step_ms']:>8.1f} {100 * row['mfu']:>5.1f}% {peak:>8}  "
                     f"{speedup}")
    return "\n".join(lines)


def add_speedups(rows: list[dict]) -> None:
    """flashtrain rows with our kernel get tokens/s ratios against each HF implementation and against flashtrain's
    model on each SDPA variant compiled the same way (eager against eager), for the same (model, seq_len)."""
    for row in rows:
        attn, _, mode = parse_impl(row["impl"])
        if attn != "flash" or row["status"] != "ok":
            continue
        for other in rows:
            same_config = (other["model"], other["seq_len"]) == (row["model"], row["seq_len"])
            other_attn, _, other_mode = parse_impl(other["impl"])
            if same_config and (other_attn in HF_IMPLS or (other_attn == "sdpa" and other_mode == mode)):
                ok = other["status"] == "ok"
                row[f"speedup_vs_{other['impl']}"] = row["tokens_per_s"] / other["tokens_per_s"] if ok else None


def plot(rows: list[dict], env: dict, path: Path, model_order=None, title: str = "GPT-2") -> None:
    """tokens/s and MFU per (model, context), a bar per implementation; model_order (default MODEL_SHAPES') and the
    title's model family for benchmarks/train_llama.py."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model_order = list(model_order or MODEL_SHAPES)
    configs = sorted({(r["model"], r["seq_len"]) for r in rows}, key=lambda c: (model_order.index(c[0]), c[1]))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    panels = ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "mfu", "MFU (of the measured matmul rate)"))
    for ax, key, label in panels:
        for i, impl in enumerate(impls):
            for c, config in enumerate(configs):
                row = next((r for r in rows if (r["model"], r["seq_len"]) == config and r["impl"] == impl), None)
                xpos = c + (i - (len(impls) - 1) / 2) * width
                if row is None:
                    continue
                if row["status"] == "ok":
                    ax.bar(xpos, row[key], width, color=f"C{i}", label=impl if c == 0 else None)
                else:
                    ax.text(xpos, 0, "OOM" if row["status"] == "OOM" else "err", rotation=90, ha="center",
                            va="bottom", color=f"C{i}", fontsize=8)
        ax.set_xticks(range(len(configs)), [f"{m} {t // 1024}K" if t >= 1024 else f"{m} {t}" for m, t in configs])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{title} training step, {env['device_name']}, torch {env['torch']}, {env['precision']}, "
                 f"{env['date'][:10]} (matmul {env['matmul_tflops']:.3g} TFLOP/s measured)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) | cpu (with --tiny: smoke test)")
    parser.add_argument("--tiny", action="store_true", help="2 layers x 64 wide, context 64 and 128, vocab 512")
    parser.add_argument("--models", nargs="+", default=None, help="small medium (default) | tiny")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=None, help="default 1024 4096 (tiny: 64 128)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="MODEL:CONTEXT",
                        help="these (model, context) pairs instead of every --models x --seq-lens one, e.g. "
                             "small:1024 small:4096 medium:4096")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tokens per micro-batch, the same for every implementation (default 16384; tiny 256)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the flashtrain implementations under torch.compile (their -compile names)")
    parser.add_argument("--vs-sdpa", action="store_true",
                        help="flashtrain's GPT2 with our kernel against the same model on SDPA: PyTorch's choice, "
                             "cuDNN forced, FA2 forced (instead of the HF models)")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="flashtrain[-sdpa[-cudnn|-fa2]][-compile|-reduce-overhead|-max-autotune], hf-eager, "
                             "hf-sdpa (default: flashtrain and hf-*)")
    parser.add_argument("--loss", choices=("full", "chunked"), default="full",
                        help="flashtrain's GPT2: its loss from the full float32 logits (as the HF models) or a chunk "
                             "of tokens at a time without the logits (model.chunked_loss)")
    parser.add_argument("--max-batch", action="store_true",
                        help="instead of timing: the largest micro-batch (sequences) whose training step fits in GPU "
                             "memory, per model, context and (eager) implementation")
    parser.add_argument("--max-batch-limit", type=int, default=256, help="--max-batch: the largest size tried")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="--max-batch as on a GPU of this many GiB: the caching allocator is capped there "
                             "(torch.cuda.set_per_process_memory_fraction), e.g. 80 for an H100 on an H200")
    parser.add_argument("--timing", choices=("interleaved", "windows"), default="interleaved",
                        help="interleaved: the implementations' steps take turns (same clocks for all; every model "
                             "stays in GPU memory); windows: each one's steps back to back")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile: 3 more)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; use --device cpu --tiny for the smoke test")
    models = args.models or (["tiny"] if args.tiny else ["small", "medium"])
    seq_lens = args.seq_lens or ([64, 128] if args.tiny else [1024, 4096])
    batch_tokens = args.batch_tokens or (256 if args.tiny else 16384)
    vocab_size = 512 if args.tiny else VOCAB
    configs = [(name, seq_len) for name in models for seq_len in seq_lens]
    if args.configs:
        try:
            configs = [(name, int(seq_len)) for name, seq_len in (c.split(":") for c in args.configs)]
        except ValueError:
            raise SystemExit(f"--configs: MODEL:CONTEXT pairs such as small:1024, got {args.configs}") from None
    for name, seq_len in configs:
        if name not in MODEL_SHAPES:
            raise SystemExit(f"--models / --configs: unknown model {name!r}; choose from {list(MODEL_SHAPES)}")
        if batch_tokens % seq_len:
            raise SystemExit(f"--batch-tokens={batch_tokens} must be a multiple of every context ({seq_len})")
    impls = args.impls or (VS_SDPA if args.vs_sdpa else ["flashtrain", *HF_IMPLS])
    if args.compile:
        impls = impls + [f"{impl}-compile" for impl in impls if impl.startswith("flashtrain")
                         and parse_impl(impl)[2] is None]
    for impl in impls:
        try:
            parse_impl(impl)
        except ValueError as error:
            raise SystemExit(f"--impls: {error}") from None

    import transformers

    matmul_size = 256 if device.type == "cpu" else 8192
    env = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "matmul_size": matmul_size,
        "matmul_tflops": measure_matmul_flops(device, matmul_size) / 1e12,
        "peak_bf16_tflops": datasheet_peak_tflops(device),
        "batch_tokens": batch_tokens,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "timing": args.timing,
        "loss": args.loss,
    }
    print(json.dumps(env), flush=True)

    if args.max_batch:
        if any(parse_impl(impl)[2] for impl in impls):
            raise SystemExit("--max-batch measures eager steps: drop --compile and the compiled --impls")
        if args.memory_gib is not None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), index)
        env["memory_gib"] = args.memory_gib
        rows = max_batch_rows(impls, configs, vocab_size, device, args.max_batch_limit, args.loss == "chunked")
        return save_results("train_gpt2_max_batch", args.out, env, rows, plot_max_batch)
    rows = []
    for model_name, seq_len in configs:
        for row in run_config(impls, model_name, seq_len, batch_tokens // seq_len, vocab_size, device,
                              args.warmup, args.steps, args.timing == "interleaved", args.loss == "chunked"):
            if row["status"] == "ok":
                row["model_tflops"] = row["tokens_per_s"] * row["flops_per_token"] / 1e12
                row["mfu"] = row["model_tflops"] / env["matmul_tflops"]
                if env["peak_bf16_tflops"]:
                    row["mfu_datasheet"] = row["model_tflops"] / env["peak_bf16_tflops"]
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
    add_speedups(rows)
    print(format_table(rows))

    return save_results("train_gpt2", args.out, env, rows, plot)


def save_results(name: str, out: Path | None, env: dict, rows: list[dict], plot_fn) -> dict:
    """{"env", "rows"} as JSON at `out` (default benchmarks/results/<name>-<device>.json) and plot_fn's PNG beside it."""
    slug = "cpu-tiny" if env["device_name"] == "cpu" else env["device_name"].replace(" ", "_")
    out = out or RESULTS / f"{name}-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"env": env, "rows": rows}
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot_fn(rows, env, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
