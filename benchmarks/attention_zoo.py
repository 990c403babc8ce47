"""Attention zoo: forward, backward and forward+backward runtime and peak memory of exact, sparse and approximate
attention against sequence length, as the FlashAttention paper's Figure 3 and Tables 8-21, on this GPU.

Setting (the paper's): batch 16, 8 heads, head dim 64, bf16, non-causal self-attention, N = 128, 256, ..., 65536.
Settings of the inputs (--settings):
    plain            no dropout, no mask
    dropout+padding  dropout 0.1 on the attention probabilities and a key-padding mask, each sequence's length drawn
                     uniformly in [N - 20, N] (seeded), as the paper's "with dropout and masking"
    dropout, padding each alone (--settings all runs the four)
Methods (--methods; families in brackets):
    flashtrain                      [exact] flash_attn_func; with padding flash_attn_varlen_func on the real tokens
    sdpa-flash, sdpa-cudnn, sdpa-efficient
                                    [exact] torch's scaled_dot_product_attention with one backend forced
                                    (FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION); padding: a bool mask
    naive                           [exact] q k^T materialised, masked, softmax, dropout, times v
    flashtrain-longformer, flashtrain-bigbird, flashtrain-butterfly
                                    [sparse] flashtrain's block-sparse kernel (block_mask, 128 x 128 blocks):
                                    longformer = a window of one block each side + 1 global block; bigbird = the
                                    same window + 2 global + 3 random blocks per row; butterfly = the flat block
                                    butterfly + 1 global block (the layouts of conf/model/attention/*.yaml)
    flex-longformer, flex-bigbird, flex-butterfly
                                    [sparse] torch.nn.attention.flex_attention, compiled, with the same block masks
                                    (BlockMask from the same layout; padding as a mask_mod on the boundary blocks).
                                    FlexAttention has no attention dropout (settings with dropout: unsupported) and
                                    no backward on the CPU
    linformer, linformer-n8         [approximate] Linformer with k = 256 / k = N / 8 (its softmax on flashtrain)
    performer                       [approximate] FAVOR+, 256 positive orthogonal random features (no attention
                                    matrix, so dropout does not apply)
    local                           [approximate] sliding window, |i - j| <= 128 at token granularity
    lsh                             [approximate] Reformer's LSH attention: 2 rounds, 64 buckets, chunks of 64
The approximate methods are the LRA encoder's variants (flashtrain/models/attention_variants/), run here alone.

Each cell (setting, method, N): forward (no grad), backward (of one saved forward) and forward+backward, each the
median of --repeats timed calls after --warmup (CUDA events; fewer repeats when one call is long); peak memory of one
forward and of one forward+backward beyond the inputs (torch.cuda.max_memory_allocated; the gradients count). A
method runs at increasing N until it runs out of memory: torch.OutOfMemoryError gives the cell status "OOM" and the
method's longer lengths are not tried ("skipped: ..."), as they are not once a forward+backward takes longer than
--max-call-seconds. Another error (a backend refusing the inputs) is recorded in the cell and the next N is tried.

    python benchmarks/attention_zoo.py                  # the full run: benchmarks/results/attention_zoo-<gpu>.json,
                                                        #   attention_zoo-<gpu>-runtime.png, -memory.png
    python benchmarks/attention_zoo.py --quick          # N = 256, 1K, 4K, 16K, 64K, 3 repeats, one flex mask
    python benchmarks/attention_zoo.py --max-len 8192   # any run, shorter
    python benchmarks/attention_zoo.py --settings plain --methods flex-bigbird,flex-butterfly --out /tmp/b
    python benchmarks/attention_zoo.py --merge /tmp/a/attention_zoo-h200.json /tmp/b/attention_zoo-h200.json
                                                        # a run split over several invocations, merged
    python benchmarks/attention_zoo.py --device cpu --max-len 512 --out /tmp/zoo   # smoke test: GPU-only methods
                                                        #   are recorded as skipped, with the reason
Needs torch (and matplotlib for the plots); not hydra. <gpu> is the GPU's short name (h200, h100, a100, ...).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import re
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch._functorch.config  # noqa: F401 -- (set in run(); `import torch` does not load it)
import torch.nn.functional as F

# this checkout's flashtrain, installed or not, and the sibling benchmark's timer
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from train_gpt2 import time_calls  # noqa: E402  (CUDA events on a GPU, perf_counter on the CPU)

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE  # noqa: E402
from flashtrain.models.attention_variants import (  # noqa: E402
    BlockSparseConfig, LinformerConfig, LocalAttentionConfig, LSHAttentionConfig, PerformerConfig)

RESULTS = Path(__file__).resolve().parent / "results"
PASSES = ("fwd", "bwd", "fb")
FAMILIES = ("exact", "sparse", "approximate")


@dataclass(frozen=True)
class Setting:
    name: str
    dropout_p: float
    padding: bool  # a key-padding mask, lengths uniform in [N - PADDING_SPREAD, N]


SETTINGS = {s.name: s for s in (Setting("plain", 0.0, False), Setting("dropout+padding", 0.1, True),
                                Setting("dropout", 0.1, False), Setting("padding", 0.0, True))}
PADDING_SPREAD = 20

# block layouts of the sparse methods, one bit per 128 x 128 block: the presets of conf/model/attention/
LAYOUTS = {
    "longformer": BlockSparseConfig("local_global", local_blocks=1, global_blocks=1),
    "bigbird": BlockSparseConfig("bigbird", local_blocks=1, global_blocks=2, random_blocks=3, seed=0),
    "butterfly": BlockSparseConfig("butterfly", global_blocks=1),
}


@dataclass
class Case:
    """One cell's inputs: the shape, the setting, the device."""
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    setting: Setting

    @property
    def lengths(self) -> list[int] | None:
        """Each sequence's length (seeded by N), or None without padding."""
        if not self.setting.padding:
            return None
        g = torch.Generator().manual_seed(self.seqlen)
        low = max(1, self.seqlen - PADDING_SPREAD)
        return torch.randint(low, self.seqlen + 1, (self.batch,), generator=g).tolist()

    def key_padding_mask(self) -> torch.Tensor | None:
        """(batch, N) bool, True at real tokens, or None."""
        lengths = self.lengths
        if lengths is None:
            return None
        return torch.arange(self.seqlen, device=self.device) < torch.tensor(lengths, device=self.device)[:, None]

    def randn(self, *shape: int, requires_grad: bool = False) -> torch.Tensor:
        return torch.randn(shape, device=self.device, dtype=self.dtype, requires_grad=requires_grad)

    def qkv_dout(self, layout: str):
        """q, k, v (leaves with grad) and dout in layout "bnhd" (batch, N, heads, dim) or "bhnd"."""
        B, N, H, D = self.batch, self.seqlen, self.heads, self.head_dim
        shape = (B, N, H, D) if layout == "bnhd" else (B, H, N, D)
        return (*(self.randn(*shape, requires_grad=True) for _ in range(3)), self.randn(*shape))


# A method: build(case) -> (fn, inputs, dout), fn(*inputs) -> out shaped as dout; unsupported(case) -> reason or None
Built = tuple[Callable, tuple, torch.Tensor]


@dataclass(frozen=True)
class Method:
    family: str
    build: Callable[[Case], Built]
    unsupported: Callable[[Case], str | None] = lambda case: None


def flashtrain_method(layout: BlockSparseConfig | None) -> Method:
    """flashtrain's kernel on CUDA (impl="cuda": never a fallback), its reference on the CPU; packed when padded."""
    def build(case: Case) -> Built:
        mask = None if layout is None else layout.block_mask(case.seqlen).to(case.device)
        impl = "cuda" if case.device.type == "cuda" else "reference"
        p, lengths = case.setting.dropout_p, case.lengths
        if lengths is None:
            q, k, v, dout = case.qkv_dout("bnhd")
            return (lambda q, k, v: flash_attn_func(q, k, v, p, block_mask=mask, impl=impl)), (q, k, v), dout
        total, N = sum(lengths), case.seqlen
        cu_seqlens = F.pad(torch.tensor(lengths, device=case.device).cumsum(0), (1, 0)).to(torch.int32)
        q, k, v = (case.randn(total, case.heads, case.head_dim, requires_grad=True) for _ in range(3))

        def fn(q, k, v):
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, N, N, p, block_mask=mask, impl=impl)
        return fn, (q, k, v), case.randn(total, case.heads, case.head_dim)
    return Method("sparse" if layout is not None else "exact", build)


def sdpa_method(backend) -> Method:
    from torch.nn.attention import sdpa_kernel

    def build(case: Case) -> Built:
        q, k, v, dout = case.qkv_dout("bhnd")
        kpm = case.key_padding_mask()
        mask = None if kpm is None else kpm[:, None, None, :]  # (B, 1, 1, N): keys

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case.setting.dropout_p)
        return fn, (q, k, v), dout
    return Method("exact", build)


def naive_build(case: Case) -> Built:
    """Standard attention as plain PyTorch writes it: the (B, H, N, N) scores and probabilities materialised."""
    q, k, v, dout = case.qkv_dout("bhnd")
    kpm = case.key_padding_mask()

    def fn(q, k, v):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, N, N)
        if kpm is not None:
            scores = scores.masked_fill(~kpm[:, None, None, :], -math.inf)
        probs = F.dropout(torch.softmax(scores, dim=-1), case.setting.dropout_p)
        return probs @ v
    return fn, (q, k, v), dout


def flex_block_mask(layout: torch.Tensor, case: Case):
    """flex_attention's BlockMask of a (n, n) block layout (128-token blocks, as FlexAttention's default) and the
    case's padding: key blocks wholly inside a sequence are "full" (no mask_mod), the block holding a sequence's end
    is partial (mask_mod: key index < length), blocks past the end are left out."""
    from torch.nn.attention.flex_attention import BlockMask

    n, N = layout.shape[0], case.seqlen
    starts = torch.arange(n, device=case.device) * BLOCK_SPARSE_SIZE
    layout = layout.to(case.device)[None]  # (1, n, n): every sequence alike
    mask_mod = None
    if case.lengths is None:
        full, partial = layout, torch.zeros_like(layout)
    else:
        lengths = torch.tensor(case.lengths, device=case.device)
        inside = starts + BLOCK_SPARSE_SIZE <= lengths[:, None]  # (B, n): key block wholly real
        boundary = (starts < lengths[:, None]) & ~inside
        full, partial = layout & inside[:, None, :], layout & boundary[:, None, :]  # (B, n, n)

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]

    def counts_and_indices(blocks: torch.Tensor):  # (B', n, n) bool -> (B', 1, n) int32, (B', 1, n, n) int32
        indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)  # kept blocks first, in order
        return blocks.sum(-1, dtype=torch.int32)[:, None], indices.to(torch.int32)[:, None]

    return BlockMask.from_kv_blocks(*counts_and_indices(partial), *counts_and_indices(full),
                                    BLOCK_SIZE=BLOCK_SPARSE_SIZE, mask_mod=mask_mod, seq_lengths=(N, N))


_compiled_flex = None


def flex_method(layout: BlockSparseConfig) -> Method:
    def build(case: Case) -> Built:
        global _compiled_flex
        if _compiled_flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        block_mask = flex_block_mask(layout.block_mask(case.seqlen), case)
        q, k, v, dout = case.qkv_dout("bhnd")
        return (lambda q, k, v: _compiled_flex(q, k, v, block_mask=block_mask)), (q, k, v), dout

    def unsupported(case: Case) -> str | None:
        if case.device.type != "cuda":
            return "FlexAttention has no backward on the CPU (torch raises NotImplementedError): GPU only"
        if case.setting.dropout_p > 0:
            return "FlexAttention has no dropout of attention probabilities"
        return None
    return Method("sparse", build, unsupported)


def variant_method(config_of: Callable[[int], object]) -> Method:
    """An LRA attention variant's inner module (config_of(N) -> its config), fed q, k, v (B, N, H, D) and the
    key-padding mask as the model feeds it."""
    def build(case: Case) -> Built:
        config = config_of(case.seqlen)
        module = config.build(d_model=case.heads * case.head_dim, n_head=case.heads, max_len=case.seqlen,
                              attn_impl="flash").to(case.device)  # float32 parameters and buffers, as in training
        q, k, v, dout = case.qkv_dout("bnhd")
        kpm, p = case.key_padding_mask(), case.setting.dropout_p

        def fn(q, k, v):
            return module(q, k, v, dropout_p=p, cu_seqlens=None, max_seqlen=None, key_padding_mask=kpm,
                          block_mask=None)
        return fn, (q, k, v), dout
    return Method("approximate", build)


def build_methods() -> dict[str, Method]:
    from torch.nn.attention import SDPBackend

    methods = {"flashtrain": flashtrain_method(None),
               "sdpa-flash": sdpa_method(SDPBackend.FLASH_ATTENTION),
               "sdpa-cudnn": sdpa_method(SDPBackend.CUDNN_ATTENTION),
               "sdpa-efficient": sdpa_method(SDPBackend.EFFICIENT_ATTENTION),
               "naive": Method("exact", naive_build)}
    methods |= {f"flashtrain-{name}": flashtrain_method(layout) for name, layout in LAYOUTS.items()}
    methods |= {f"flex-{name}": flex_method(layout) for name, layout in LAYOUTS.items()}
    methods |= {"linformer": variant_method(lambda N: LinformerConfig(k=256)),
                "linformer-n8": variant_method(lambda N: LinformerConfig(k=None)),  # k = N // 8
                "performer": variant_method(lambda N: PerformerConfig(num_features=256)),
                "local": variant_method(lambda N: LocalAttentionConfig(window=128)),
                "lsh": variant_method(lambda N: LSHAttentionConfig(num_hashes=2, num_buckets=64, chunk_len=64))}
    return methods


# ---- measuring ----------------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
              budget_s: float) -> float:
    """Median ms of one fn() call: one untimed call (compilation), one timed to size the run (repeats cut so that
    they take about budget_s), the rest of the warm-up, then the timed calls (CUDA events on a GPU)."""
    fn()
    first_s = time_calls(fn, device, 0, 1)[0]
    repeats = max(1, min(repeats, int(budget_s / max(first_s, 1e-6))))
    return 1000 * statistics.median(time_calls(fn, device, max(0, warmup - 1), repeats))


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory allocated during fn() beyond what was allocated before it (MiB); None on the CPU."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    kept = fn()  # held until the peak is read: the gradients count
    synchronize(device)
    extra = torch.cuda.max_memory_allocated(device) - base
    del kept
    return round(extra / 2**20, 1)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def measure(method: Method, case: Case, args) -> dict:
    """One cell: {status: ok | OOM | error: ..., fwd_ms, bwd_ms, fb_ms, fwd_peak_mib, fb_peak_mib}; passes that did
    not run are None."""
    row = {f"{p}_ms": None for p in PASSES} | {"fwd_peak_mib": None, "fb_peak_mib": None, "status": "ok"}
    device, budget = case.device, args.budget_seconds
    try:
        torch.manual_seed(0)
        fn, inputs, dout = method.build(case)

        def grads(out):
            return torch.autograd.grad(out, inputs, dout, retain_graph=True, allow_unused=True)

        with torch.no_grad():
            row["fwd_ms"] = median_ms(lambda: fn(*inputs), device, args.warmup, args.repeats, budget)
            row["fwd_peak_mib"] = peak_mib(lambda: fn(*inputs), device)
        out = fn(*inputs)
        row["bwd_ms"] = median_ms(lambda: grads(out), device, args.warmup, args.repeats, budget)
        del out
        row["fb_ms"] = median_ms(lambda: grads(fn(*inputs)), device, args.warmup, args.repeats, budget)
        row["fb_peak_mib"] = peak_mib(lambda: grads(fn(*inputs)), device)
    except Exception as error:  # noqa: BLE001 -- every failure is a result of the cell, named in it
        row["status"] = "OOM" if is_oom(error) else f"error: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    finally:
        fn = inputs = dout = out = None  # noqa: F841 -- free the cell's tensors before the next one
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for key in row:
        if key.endswith("_ms") and row[key] is not None:
            row[key] = round(row[key], 4)
    return row


def lengths_of(args) -> list[int]:
    if args.quick:
        return [n for n in (256, 1024, 4096, 16384, 65536) if args.min_len <= n <= args.max_len]
    lengths, n = [], args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2
    return lengths


def run(args) -> dict:
    """Every (setting, method, N) cell in order; returns {"env", "config", "methods", "rows", "summary"}."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch._functorch.config.donated_buffer = False  # compiled backwards run again with retain_graph=True
        for name in ("recompile_limit", "cache_size_limit"):  # one compiled flex graph per shape
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
    # SDPA's reasons for refusing a forced backend: the cell records the error itself
    warnings.filterwarnings("ignore", message=r".*(kernel not used because|fused kernels do not support)")
    methods = build_methods()
    names = args.methods.split(",") if args.methods else [
        name for name in methods if not (args.quick and name.startswith("flex-") and name != "flex-bigbird")]
    unknown = [name for name in names if name not in methods]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; the methods: {', '.join(methods)}")
    settings = list(SETTINGS) if args.settings == "all" else args.settings.split(",")
    if any(s not in SETTINGS for s in settings):
        raise SystemExit(f"--settings: one of {', '.join(SETTINGS)} (comma-separated) or all, got {args.settings}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    lengths = lengths_of(args)
    rows = []
    for setting_name in settings:
        setting = SETTINGS[setting_name]
        for name in names:
            method, stopped = methods[name], None
            for seqlen in lengths:
                case = Case(args.batch, seqlen, args.heads, args.head_dim, dtype, device, setting)
                base = {"setting": setting.name, "method": name, "family": method.family, "seqlen": seqlen}
                reason = method.unsupported(case)
                if reason is not None or stopped is not None:
                    row = {f"{p}_ms": None for p in PASSES} | {"fwd_peak_mib": None, "fb_peak_mib": None,
                                                              "status": f"skipped: {reason or stopped}"}
                else:
                    row = measure(method, case, args)
                    if row["status"] == "OOM":
                        stopped = f"out of memory at N={seqlen}"
                    elif row["fb_ms"] is not None and row["fb_ms"] > 1000 * args.max_call_seconds:
                        stopped = f"forward+backward took {row['fb_ms'] / 1000:.1f} s at N={seqlen}"
                rows.append(base | row)
                print(format_row(rows[-1]), flush=True)
            if args.partial is not None:  # the cells so far survive a run stopped from outside
                args.partial.write_text(json.dumps({"env": environment(device), "rows": rows}) + "\n")
    config = {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
              "seqlens": lengths, "settings": settings, "padding_spread": PADDING_SPREAD, "warmup": args.warmup,
              "repeats": args.repeats, "budget_seconds": args.budget_seconds,
              "max_call_seconds": args.max_call_seconds, "quick": args.quick,
              "layouts": {name: vars(layout) for name, layout in LAYOUTS.items()}}
    return {"env": environment(device), "config": config,
            "methods": {name: methods[name].family for name in names}, "rows": rows, "summary": summary(rows)}


def format_row(row: dict) -> str:
    times = " ".join(f"{p} {row[f'{p}_ms']:.3f}" if row[f"{p}_ms"] is not None else f"{p} -" for p in PASSES)
    memory = f"peak {row['fb_peak_mib']} MiB" if row["fb_peak_mib"] is not None else ""
    status = "" if row["status"] == "ok" else row["status"]
    return f"{row['setting']:<16} {row['method']:<22} N={row['seqlen']:<6} {times} ms {memory} {status}".rstrip()


def summary(rows: list[dict]) -> list[str]:
    """Per setting and N: the fastest sparse or approximate method (forward+backward) and flashtrain block-sparse
    against FlexAttention on each mask."""
    lines = []
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for row in rows:
        if row["fb_ms"] is not None:
            cells.setdefault((row["setting"], row["seqlen"]), {})[row["method"]] = row["fb_ms"]
    families = {row["method"]: row["family"] for row in rows}
    for (setting, seqlen), times in cells.items():
        contenders = {m: t for m, t in times.items() if families[m] in ("sparse", "approximate")}
        if contenders:
            best = min(contenders, key=contenders.get)
            lines.append(f"{setting} N={seqlen}: fastest sparse/approximate fwd+bwd {best} {contenders[best]:.3f} ms")
        for layout in LAYOUTS:
            ours, flex = times.get(f"flashtrain-{layout}"), times.get(f"flex-{layout}")
            if ours is not None and flex is not None:
                lines.append(f"{setting} N={seqlen}: {layout} flashtrain {ours:.3f} ms, flex {flex:.3f} ms "
                             f"(flex / flashtrain {flex / ours:.2f})")
    return lines


def environment(device: torch.device) -> dict:
    env = {"device": device.type, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version()}
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def device_tag(env: dict) -> str:
    """The short name in the file names: "h200" for "NVIDIA H200", "a100" for "NVIDIA A100-SXM4-80GB", "cpu"."""
    if env["gpu"] is None:
        return "cpu"
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", env["gpu"])
    return model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "_", env["gpu"].lower()).strip("_")


# ---- plots and files ----------------------------------------------------------------------------------------------

STYLES = {"exact": "-", "sparse": "--", "approximate": ":"}


def plot(result: dict, key: str, ylabel: str, path: Path) -> None:
    """One panel per setting: key (fb_ms or fb_peak_mib) against N, log-log, a line per method; a method's legend
    entry says where it ran out of memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = result["config"]["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(7.5 * len(settings), 6), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for index, (name, family) in enumerate(result["methods"].items()):
            rows = [r for r in result["rows"] if r["setting"] == setting and r["method"] == name]
            points = [(r["seqlen"], r[key]) for r in rows if r[key] is not None]
            oom = next((r["seqlen"] for r in rows if r["status"] == "OOM"), None)
            if points:
                label = name + (f" (OOM at {oom})" if oom else "")
                ax.plot(*zip(*points), STYLES[family], marker="o", markersize=3, label=label,
                        color=plt.cm.tab20(index % 20))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.set_title(setting)
        ax.grid(alpha=0.3, which="both")
        if ax.has_data():
            ax.legend(fontsize=7, ncol=2)
        else:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", transform=ax.transAxes)
    env, config = result["env"], result["config"]
    fig.suptitle(f"{env['gpu'] or env['device']}, torch {env['torch']}, {env['date'][:10]}: batch {config['batch']}, "
                 f"{config['heads']} heads, head dim {config['head_dim']}, {config['dtype']} "
                 f"(solid exact, dashed sparse, dotted approximate)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save(result: dict, out_dir: Path) -> list[Path]:
    """JSON and the two plots in out_dir: attention_zoo-<tag>.json, -runtime.png, -memory.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"attention_zoo-{device_tag(result['env'])}"
    paths = [stem.with_suffix(".json"), Path(f"{stem}-runtime.png"), Path(f"{stem}-memory.png")]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    plot(result, "fb_ms", "forward + backward (ms)", paths[1])
    plot(result, "fb_peak_mib", "peak memory of forward + backward beyond the inputs (MiB)", paths[2])
    return paths


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="N = 256, 1K, 4K, 16K, 64K (within --min-len/--max-len), 3 repeats, flex on the BigBird "
                             "mask only: about 5 minutes on an H200")
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=65536)
    parser.add_argument("--settings", default="plain,dropout+padding", help=f"of {', '.join(SETTINGS)}, or all")
    parser.add_argument("--methods", default=None, help="comma-separated (default: all)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--repeats", type=int, default=None, help="default 10 (--quick: 3)")
    parser.add_argument("--budget-seconds", type=float, default=2.0,
                        help="fewer repeats where they would take longer than this per pass")
    parser.add_argument("--max-call-seconds", type=float, default=10.0,
                        help="a method whose forward+backward takes longer stops there")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder of the JSON and PNG files")
    parser.add_argument("--partial", type=Path, default=None,
                        help="rewrite this JSON file with the cells so far after each method (a run stopped by a "
                             "time limit keeps them)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="no measurement: merge these result files (runs split by --settings / --methods) into "
                             "one JSON and its plots in --out")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 10)
    return args


def merge(paths: list[Path]) -> dict:
    """One result from the JSON files of runs that split the work (--settings / --methods per run, e.g. to keep each
    under a machine's time limit): their rows, methods and settings in the order given, a cell measured twice taken
    from the later file; the environment and configuration of the first (the others must match in shape and dtype)."""
    results = [json.loads(Path(path).read_text()) for path in paths]
    first = results[0]
    keys = ("batch", "heads", "head_dim", "dtype")
    for path, other in zip(paths[1:], results[1:]):
        mismatch = [k for k in keys if other["config"][k] != first["config"][k]]
        if mismatch or other["env"].get("gpu") != first["env"].get("gpu"):
            raise SystemExit(f"--merge: {path} differs from {paths[0]} in {mismatch or ['gpu']}")
    cells: dict[tuple, dict] = {}
    methods: dict[str, str] = {}
    settings: list[str] = []
    for result in results:
        methods |= result["methods"]
        settings += [s for s in result["config"]["settings"] if s not in settings]
        for row in result["rows"]:
            cells[(row["setting"], row["method"], row["seqlen"])] = row
    order = {name: i for i, name in enumerate(methods)}
    rows = sorted(cells.values(), key=lambda r: (settings.index(r["setting"]), order[r["method"]], r["seqlen"]))
    config = dict(first["config"], settings=settings,
                  seqlens=sorted({n for result in results for n in result["config"]["seqlens"]}),
                  merged_from=[{"file": Path(p).name, "date": r["env"]["date"], "settings": r["config"]["settings"],
                                "methods": list(r["methods"])} for p, r in zip(paths, results)])
    return {"env": first["env"], "config": config, "methods": methods, "rows": rows, "summary": summary(rows)}


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    result = merge(args.merge) if args.merge else run(args)
    print("\n".join(result["summary"]))
    paths = save(result, args.out)
    print("wrote " + ", ".join(map(str, paths)))
    return paths


if __name__ == "__main__":
    main()
