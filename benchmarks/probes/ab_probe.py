"""Probe: A/B of kernel variants with interleaved CUDA-graph replays, bf16, the benchmark grid's shapes (batch x seqlen
= 16K tokens, 2048 / head_dim heads). Each implementation's call is captured once as a CUDA graph (with its variant
active), then the graphs are replayed in turn, each preceded equally often by every other (train_gpt2.balanced_order),
each between CUDA events: every variant runs under the same clocks and power state, and no host work sits between the events.
Medians per implementation; ratios to the first implementation and to cuDNN.

Implementations (a '#tag' suffix, e.g. flashtrain#2, runs a second copy of the same one: the run's noise floor):
flashtrain; flashtrain+FT_MACRO=v[+...] (kernels compiled with those macros through
FLASHTRAIN_EXTRA_DEFINES, kernel_variant below); flashtrain@ENV=v[@...] (environment variables set while the call is
captured, e.g. flashtrain@FLASHTRAIN_BWD_SM90_Q80=0: dispatch switches read at plan time; build.NAME=v sets an int
attribute of flashtrain.kernels.build (ops.NAME, tma.NAME: of flashtrain.kernels.ops, .tma) instead, e.g.
flashtrain@build.LONG_CAUSAL_SEQLEN=512; FLASHTRAIN_FWD_SM90_TILES=... / FLASHTRAIN_BWD_SM90_TILES=... re-read the tile tables); both: flashtrain+MACRO=v@ENV=v; flashtrain-det[...]: the
same with deterministic=True; cudnn, fa2 (SDPA backends). Passes: fwd, fb (forward + backward), bwd (the backward
alone: the forward runs once before the capture, the graph holds the gradient kernels).

    PYTHONPATH=$PWD python3 benchmarks/probes/ab_probe.py --impls flashtrain flashtrain+FT_X=1 cudnn \
        --configs 64:512:causal 128:4096:full [--pass fwd|fb]
    PYTHONPATH=$PWD python3 benchmarks/probes/ab_probe.py --impls flashtrain cudnn --configs 128:8192:causal:32/8:1 \
        --pass fb                                          # GQA: 32 query heads on 8 key / value heads, batch 1
    PYTHONPATH=$PWD python3 benchmarks/probes/ab_probe.py --impls flashtrain flashtrain-det --pass bwd
    PYTHONPATH=$PWD python3 benchmarks/probes/ab_probe.py --impls flashtrain flashtrain@build.LONG_KEYS_SEQLEN=1048576 \
        --configs 128:16384:full --sustained 3 --rounds 2     # sustained: each graph back to back for 3 s

--sustained SECONDS: instead of interleaving, each implementation's graph is replayed back to back for SECONDS
(attention.py's sustained_ms: its clocks settle where its own power draw puts them, as in training), --rounds times,
the implementations' order reversed every other round; the mean of the rounds' medians. --clocks (with --sustained):
each run's steady-state SM clock and board power too (attention.sustained_ms_clocks), and TFLOP/s per GHz: tells a variant
that is slower because the power cap lowers its clock from one that does less per clock.

--json PATH: the same rows as a record (GPU, driver, power limit, L2 size and whether the small-L2 dispatch ran, torch,
cuDNN, UTC date, source commit, the command line; per configuration each implementation's TFLOP/s, its ratio to the
first implementation and to cuDNN, and with --clocks its SM clock and board power), rewritten after each
configuration, so that a cut run keeps what it measured.
"""
import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import build, flash_attn_func, ops, tma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa4_baseline  # noqa: E402
import gpu_clocks  # noqa: E402
from attention_features import FeatureRow  # noqa: E402
from train_gpt2 import time_interleaved  # noqa: E402

MODULES = {"build": build, "ops": ops, "tma": tma}
TILE_TABLES = (build.FWD_SM90_TILES, build.FWD_SM90_TILES_NONCAUSAL, build.FWD_SM90_TILES_LONG_CAUSAL,
               build.FWD_SM90_TILES_SHORT_CAUSAL, build.FWD_SM90_TILES_LONG_KEYS, build.BWD_SM90_TILES)
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
GRID = [f"{hd}:{s}:{m}" for hd in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384) for m in ("full", "causal")]


def loaded_kernels() -> tuple[dict, dict]:
    """The launcher's caches of loaded kernels and modules (flashtrain.kernels.launch), which a variant clears and
    restores; two empty dicts where cuda-python is missing (launch cannot be imported, so nothing was loaded)."""
    try:
        from flashtrain.kernels import launch
    except ImportError:
        return {}, {}
    return launch._kernels, launch._modules


@contextlib.contextmanager
def kernel_variant(name: str):
    """Kernels compiled with the macros after '+' in `name` (none: the default build)."""
    defines = ",".join(name.split("+")[1:])
    saved_env = os.environ.get("FLASHTRAIN_EXTRA_DEFINES")
    kernels, modules = loaded_kernels()
    saved_kernels, saved_modules = dict(kernels), dict(modules)

    def reset():
        kernels.clear()
        modules.clear()
        ops.clear_plans()
        for cached in vars(build).values():  # kernel specs (a macro may change one's shared-memory size)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()

    if defines:
        os.environ["FLASHTRAIN_EXTRA_DEFINES"] = defines
        reset()
    try:
        yield
    finally:
        if defines:
            if saved_env is None:
                os.environ.pop("FLASHTRAIN_EXTRA_DEFINES", None)
            else:
                os.environ["FLASHTRAIN_EXTRA_DEFINES"] = saved_env
            reset()
            kernels.update(saved_kernels)
            modules.update(saved_modules)


@contextlib.contextmanager
def variant(name: str):
    """A flashtrain implementation's variant active (its '@' settings, then its '+' kernels): around every call of it
    that is measured or profiled (this probe's captures, ncu_probe.py's calls)."""
    with env_variant(name), kernel_variant(name.split("@")[0]):
        yield


@contextlib.contextmanager
def env_variant(name: str):
    """flashtrain@ENV=v[@...]: the variables (or build.NAME / ops.NAME attributes, numbers) set (launch plans dropped
    on entry and exit)."""
    items = dict(item.split("=", 1) for item in name.split("@")[1:])
    attrs = {tuple(key.split(".", 1)): float(value) if "." in value or "inf" in value else int(value)
             for key, value in items.items() if key.split(".")[0] in MODULES}
    items = {key: value for key, value in items.items() if key.split(".")[0] not in MODULES}
    saved = {key: os.environ.get(key) for key in items}
    saved_attrs = {key: getattr(MODULES[key[0]], key[1]) for key in attrs}
    # FLASHTRAIN_FWD_SM90_TILES / FLASHTRAIN_BWD_SM90_TILES (read by build at import): the tile tables re-read,
    # kernels of the same name reloaded
    tiles = "FLASHTRAIN_FWD_SM90_TILES" in items or "FLASHTRAIN_BWD_SM90_TILES" in items
    saved_tables = [dict(table) for table in TILE_TABLES]
    kernels, modules = loaded_kernels()
    saved_kernels, saved_modules = dict(kernels), dict(modules)
    os.environ.update(items)
    for (module, attr), value in attrs.items():
        setattr(MODULES[module], attr, value)
    if tiles:
        build._tile_overrides()
        build._bwd_tile_overrides()
        kernels.clear()
        modules.clear()
    ops.clear_plans()
    try:
        yield
    finally:
        if tiles:
            for table, saved_table in zip(TILE_TABLES, saved_tables):
                table.clear()
                table.update(saved_table)
            kernels.clear()
            modules.clear()
            kernels.update(saved_kernels)
            modules.update(saved_modules)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for (module, attr), value in saved_attrs.items():
            setattr(MODULES[module], attr, value)
        ops.clear_plans()


@dataclasses.dataclass
class Config:
    """head_dim:seqlen:full|causal[:heads/kv_heads[:batch]][:wN]: the grid's shapes (batch x seqlen = 16K tokens, 2048 /
    head_dim heads) unless heads (GQA: query heads / key-value heads) and batch are given, e.g. 128:8192:causal:32/8:1,
    the attention benchmark's GQA workload; wN: a causal sliding window of N keys before each query (window_size
    (N, 0); flashtrain and fa4 only), e.g. 128:16384:causal:16:1:w1024, attention_features.py's window row."""

    head_dim: int
    seqlen: int
    causal: bool
    nheads: int
    nheads_kv: int
    batch: int
    window: int = -1

    @classmethod
    def parse(cls, text: str) -> "Config":
        parts = text.split(":")
        window = int(parts.pop()[1:]) if len(parts) > 3 and parts[-1].startswith("w") else -1
        if len(parts) not in (3, 4, 5) or parts[2] not in ("full", "causal") or (window >= 0 and parts[2] != "causal"):
            raise SystemExit(f"--configs: {text!r} is not head_dim:seqlen:full|causal[:heads/kv_heads[:batch]][:wN] "
                             "(a window with causal)")
        head_dim, seqlen = int(parts[0]), int(parts[1])
        nheads = nheads_kv = 2048 // head_dim
        if len(parts) > 3:
            nheads, nheads_kv = (int(x) for x in parts[3].split("/")) if "/" in parts[3] else (int(parts[3]),) * 2
        batch = int(parts[4]) if len(parts) > 4 else max(1, 16384 // seqlen)
        return cls(head_dim, seqlen, parts[2] == "causal", nheads, nheads_kv, batch, window)

    def label(self) -> str:
        heads = "" if self.nheads == self.nheads_kv == 2048 // self.head_dim else (
            f" {self.nheads}/{self.nheads_kv}h" if self.nheads != self.nheads_kv else f" {self.nheads}h")
        mask = f"{'causal' if self.causal else 'full':<6}"
        window = f" w{self.window}" if self.window >= 0 else ""
        return f"hd{self.head_dim} S{self.seqlen:<6} {mask}{heads} B{self.batch}{window}"

    def flops(self, kind: str) -> float:
        flops = 4 * self.batch * self.nheads * self.seqlen**2 * self.head_dim / (2 if self.causal else 1)
        if self.window >= 0:  # the (query, key) pairs the window computes, as attention_features.py counts them
            flops = FeatureRow("window", self.batch, self.seqlen, self.nheads, self.head_dim, self.window).fwd_flops()
        return flops * {"fwd": 1.0, "bwd": 2.5, "fb": 3.5}[kind]


def attention_call(name: str, config: Config, kind: str):
    """(call, inputs): a no-argument callable running `name`'s forward (kind fwd), forward + backward (fb) or backward
    (bwd: of one forward run here, its graph retained) on fresh bf16 inputs of `config`, and those inputs. name:
    flashtrain[-det][+MACRO=v][@ENV=v] (the variant is whatever is active when the call runs; -det: deterministic=True),
    fa4 (FlashAttention-4 where installed; ncu_probe.py runs it, CUDA graphs of it are untried) or an SDPA backend of
    BACKENDS."""
    c = config
    deterministic = name.split("+")[0].split("@")[0] == "flashtrain-det"
    flash_layout = name.startswith("flashtrain") or name == "fa4"
    if not flash_layout and name not in BACKENDS:
        raise SystemExit(f"--impls: unknown implementation {name!r} (flashtrain[+/@variant], fa4, "
                         f"{', '.join(BACKENDS)})")
    if name == "fa4":  # named explicitly: measure it or stop (fa4_baseline.require)
        fa4_baseline.require("--impls fa4")

    def tensor(heads):
        shape = (c.batch, c.seqlen, heads, c.head_dim) if flash_layout else (c.batch, heads, c.seqlen, c.head_dim)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=kind != "fwd")

    q, k, v, dout = tensor(c.nheads), tensor(c.nheads_kv), tensor(c.nheads_kv), tensor(c.nheads)
    gqa = {"enable_gqa": True} if c.nheads != c.nheads_kv else {}  # only when needed: not every backend takes it
    fa4 = fa4_baseline.attention(c.causal, window=c.window) if name == "fa4" else None
    if c.window >= 0 and not flash_layout:
        raise SystemExit(f"--impls: {name} has no sliding window (flashtrain, fa4)")
    window = {"window_size": (c.window, 0)} if c.window >= 0 else {}

    def forward():
        if name.startswith("flashtrain"):
            return flash_attn_func(q, k, v, causal=c.causal, impl="cuda", deterministic=deterministic, **window)
        if fa4 is not None:
            return fa4(q, k, v)
        with sdpa_kernel(BACKENDS[name]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=c.causal, **gqa)

    if kind == "bwd":  # (the forward on the first call's stream: the backward runs on the forward's)
        saved = []

        def backward():
            if not saved:
                saved.append(forward())
            torch.autograd.grad(saved[0], (q, k, v), dout, retain_graph=True)
        return backward, (q, k, v, dout, saved)

    def call():
        out = forward()
        if kind == "fb":
            torch.autograd.grad(out, (q, k, v), dout)
    return call, (q, k, v, dout)


def variant_spec(name: str) -> str:
    """The implementation an --impls name runs: the name without a '#tag' suffix. A tagged copy (flashtrain#2) runs
    the same variant as a separate implementation, so that the run shows its own noise floor at each configuration."""
    return name.split("#", 1)[0]


def capture(name: str, config: Config, kind: str) -> torch.cuda.CUDAGraph:
    """One call of `name` (fwd, or fwd + backward) as a CUDA graph, on inputs of its own."""
    name = variant_spec(name)
    flashtrain = name.startswith("flashtrain")
    call, inputs = attention_call(name, config, kind)

    with contextlib.ExitStack() as stack:
        if flashtrain:
            stack.enter_context(variant(name))
        if kind == "fwd":
            stack.enter_context(torch.no_grad())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # build, load, warm up outside the capture
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            call()
    graph.inputs = inputs  # keep them alive with the graph
    return graph


def sustained_measure(calls: dict, flops: float, seconds: float, rounds: int, clocks: bool = False) -> dict:
    """{name: {"tflops": ...}} of each call run alone back to back for `seconds` (attention.sustained_ms), `rounds`
    times in alternating order, means over the rounds; with `clocks` also "sm_mhz" and "watts", the steady-state SM
    clock and board power sampled by nvidia-smi during each run (attention.sustained_ms_clocks)."""
    from attention import sustained_ms, sustained_ms_clocks, sustained_rounds  # (attention.py's sustained mode)

    def measure(name):
        if not clocks:
            return {"tflops": flops / sustained_ms(calls[name], seconds) / 1e9}
        ms, (mhz, watts) = sustained_ms_clocks(calls[name], seconds)
        if mhz is None:
            raise SystemExit("--clocks: nvidia-smi gave no SM clock / power samples")
        return {"tflops": flops / ms / 1e9, "sm_mhz": mhz, "watts": watts}

    results = sustained_rounds(measure, rounds, list(calls))
    return {name: {kind: statistics.mean(values) for (impl, kind), values in results.items() if impl == name}
            for name in calls}


def row_record(tflops: dict, measured: dict | None = None) -> dict:
    """One configuration's results: {"tflops": {impl: TFLOP/s}, "over_first": {impl: ratio to the first
    implementation} (the flashtrain variants after the first), "over_cudnn": {impl: ratio} (flashtrain ones, where cudnn
    ran), and with --clocks "sm_mhz" / "watts" per implementation (measured: sustained_measure's dicts)."""
    names = list(tflops)
    row = {"tflops": {name: round(value, 1) for name, value in tflops.items()},
           "over_first": {name: round(tflops[name] / tflops[names[0]], 3) for name in names[1:]
                          if name.startswith("flashtrain")}}
    if "cudnn" in tflops:
        row["over_cudnn"] = {name: round(tflops[name] / tflops["cudnn"], 3) for name in names
                             if name.startswith("flashtrain")}
    if measured and all("sm_mhz" in m for m in measured.values()):
        row["sm_mhz"] = {name: round(m["sm_mhz"]) for name, m in measured.items()}
        row["watts"] = {name: round(m["watts"]) for name, m in measured.items()}
    return row


def row_line(label: str, tflops: dict, row: dict) -> str:
    """The printed form of a row_record: TFLOP/s per implementation, then its ratios."""
    line = "  ".join(f"{name} {value:6.1f}" for name, value in tflops.items())
    first = next(iter(tflops))
    ratios = "".join(f"  /{first}: {name} {ratio:.3f}" for name, ratio in row["over_first"].items())
    ratios += "".join(f"  {name}/cudnn {ratio:.3f}" for name, ratio in row.get("over_cudnn", {}).items())
    return f"{label} TFLOP/s {line}{ratios}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "cudnn"])
    parser.add_argument("--configs", nargs="+", default=GRID,
                        help="head_dim:seqlen:full|causal[:heads/kv_heads[:batch]] (Config)")
    parser.add_argument("--pass", dest="kind", choices=("fwd", "fb", "bwd"), default="fwd")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="each implementation back to back for SECONDS instead of interleaved replays")
    parser.add_argument("--rounds", type=int, default=2, help="with --sustained: rounds, alternating the order")
    parser.add_argument("--clocks", action="store_true",
                        help="with --sustained: also each implementation's SM clock and board power (nvidia-smi)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the rows as a record (rewritten after each configuration)")
    args = parser.parse_args()
    fa4_baseline.require_if_named(args.impls)
    if args.sustained < 0 or args.rounds < 1:
        parser.error(f"--sustained must be >= 0 and --rounds >= 1 (got {args.sustained}, {args.rounds})")
    if args.clocks and args.sustained <= 0:
        parser.error("--clocks needs --sustained SECONDS (clocks settle only in back-to-back runs)")
    print(torch.cuda.get_device_name(), torch.__version__, f"cuDNN {torch.backends.cudnn.version()}", args.kind,
          flush=True)
    record = {"what": "benchmarks/probes/ab_probe.py " + " ".join(sys.argv[1:]), "gpu": torch.cuda.get_device_name(),
              **gpu_clocks.board(), **gpu_clocks.memory_system(torch.cuda.get_device_properties(0).L2_cache_size),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": gpu_clocks.source_commit(Path(__file__).resolve().parents[2]), "pass": args.kind,
              "timing": f"sustained {args.sustained:g} s x {args.rounds}" if args.sustained > 0
              else f"interleaved CUDA-graph replays, median of {args.repeats}", "rows": {}}
    for config in map(Config.parse, args.configs):
        graphs = {name: capture(name, config, args.kind) for name in args.impls}
        names = list(graphs)
        for graph in graphs.values():  # warm up the replays
            graph.replay()
        flops = config.flops(args.kind)
        replays = {name: graph.replay for name, graph in graphs.items()}
        clock_line, measured = "", None
        if args.sustained > 0:
            measured = sustained_measure(replays, flops, args.sustained, args.rounds, args.clocks)
            tflops = {name: m["tflops"] for name, m in measured.items()}
            if args.clocks:  # TFLOP/s per GHz of SM clock: the work per clock, apart from where power put the clock
                clock_line = "; " + "  ".join(
                    f"{name} {m['sm_mhz']:.0f} MHz {m['watts']:.0f} W {m['tflops'] / m['sm_mhz'] * 1e3:.1f}/GHz"
                    for name, m in measured.items())
        else:
            times = time_interleaved(replays, args.repeats)
            tflops = {name: flops / statistics.median(times[name]) / 1e12 for name in names}
        row = row_record(tflops, measured)
        mode = f" sustained {args.sustained:g} s x {args.rounds}" if args.sustained > 0 else ""
        print(row_line(f"{config.label()} {args.kind}{mode}", tflops, row) + clock_line, flush=True)
        if args.json is not None:
            record["rows"][" ".join(config.label().split())] = row
            args.json.write_text(json.dumps(record, indent=1) + "\n")
        del graphs


if __name__ == "__main__":
    main()
