"""Attention features (window, softcap, ALiBi, mask_mod, head dim 512) against FlexAttention and against plain
attention, in one process on one GPU.

Rows (bf16, causal, 16 heads of 128 unless stated): a sliding window of 1024 keys at 16K tokens; softcap 30 at 4K;
ALiBi (geometric slopes) at 4K; head dim 512 at 4K (4 heads); a document mask at 16K tokens of 8 documents, twice:
as varlen, and as the mask expression "doc[q_idx] == doc[kv_idx]" over one sequence (mask_mod). Each row
times three implementations, interleaved (attention_timing.time_passes_interleaved):

  flashtrain   flash_attn_func with the feature (window_size, softcap, alibi_slopes; the document mask as
               flash_attn_varlen_func over the documents, or mask_mod with its block states computed in each call),
               impl="cuda"
  flex         torch.compile(flex_attention) with the same score_mod / mask_mod and the BlockMask of the mask
               (built once, outside the timed calls); head dims past 256 with small Triton tiles
               (FLEX_WIDE_HEAD_TILES: its default tiles run out of shared memory there)
  plain        flashtrain's plain causal attention of the same shape: what a kernel without the feature computes
               (the window's "dense causal" time)
  fa4          FlashAttention-4 (benchmarks/fa4_baseline.py, where installed) on the rows it offers: the window
               (window_size), softcap, and the document mask as varlen; "-" on the others, "not installed" when
               missing

FLOPs count the (query, key) pairs each row computes exactly (4 * pairs * head_dim per head forward; backward 2.5x):
TFLOP/s compare flashtrain against FlexAttention and FA4 (>= 1.0 forward and forward+backward), and for the window the time of
plain causal attention over the window's (>= 8x at 16K). Work per computed block (target: softcap, ALiBi and the
window within 10% of plain attention) is time per 128 x 128 tile that holds a visible pair (computed_tiles), the
feature's against plain causal attention's: vs_plain_block_<pass> = (plain ms / plain tiles) / (ft ms / ft tiles).

    python benchmarks/attention_features.py --out benchmarks/results/attention_features-<gpu>.json
    python benchmarks/attention.py --workloads     # also runs these rows (the JSON's "features")
"""

from __future__ import annotations

import argparse
import datetime
import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func
import fa4_baseline  # FlashAttention-4 where installed (this folder is on sys.path)

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("flashtrain", "flex", "plain", "fa4")


@dataclass(frozen=True)
class FeatureRow:
    name: str
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    window: int = -1  # keys before each query (causal sliding window); -1: none
    softcap: float = 0.0
    alibi: bool = False
    documents: int = 0  # equal documents packed in each sequence (causal inside each); 0: one
    mask_expr: bool = False  # the documents as a mask expression (mask_mod) over one sequence instead of varlen

    def pairs(self) -> int:
        """(query, key) pairs computed per (sequence, head): causal, cut by the window / the documents."""
        def causal(n: int, w: int) -> int:  # sum over queries i < n of min(i, w) + 1
            if w < 0 or w >= n - 1:
                return n * (n + 1) // 2
            return (w + 1) * (w + 2) // 2 + (n - w - 1) * (w + 1)
        if self.documents:
            return self.documents * causal(self.seqlen // self.documents, -1)
        return causal(self.seqlen, self.window)

    def computed_tiles(self, tile: int = 128) -> int:
        """tile x tile blocks (per sequence and head) holding a (query, key) pair the row computes: a query tile's
        visible keys are one range, from the window's (or its document's) start for its first row to its last row."""
        count = 0
        for q0 in range(0, self.seqlen, tile):
            q1 = min(q0 + tile, self.seqlen) - 1
            if self.documents:
                first = q0 - q0 % (self.seqlen // self.documents)
            else:
                first = max(0, q0 - self.window) if self.window >= 0 else 0
            count += q1 // tile - first // tile + 1
        return count

    def plain_tiles(self, tile: int = 128) -> int:
        return FeatureRow("plain", self.batch, self.seqlen, self.nheads, self.head_dim).computed_tiles(tile)

    def fwd_flops(self) -> float:
        return 4.0 * self.batch * self.nheads * self.pairs() * self.head_dim

    def plain_fwd_flops(self) -> float:
        return 4.0 * self.batch * self.nheads * self.seqlen * (self.seqlen + 1) // 2 * self.head_dim


def feature_rows() -> list[FeatureRow]:
    return [
        FeatureRow("window 1024 at 16K", 1, 16384, 16, 128, window=1024),
        FeatureRow("softcap 30 at 4K", 4, 4096, 16, 128, softcap=30.0),
        FeatureRow("ALiBi at 4K", 4, 4096, 16, 128, alibi=True),
        FeatureRow("head dim 512 at 4K", 4, 4096, 4, 512),
        FeatureRow("document mask 16K (8 documents)", 1, 16384, 16, 128, documents=8),
        FeatureRow("document mask 16K (8 documents, mask_mod)", 1, 16384, 16, 128, documents=8, mask_expr=True),
    ]


def alibi_slopes(nheads: int, device) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / nheads), float32."""
    return torch.tensor([2 ** (-8 * (h + 1) / nheads) for h in range(nheads)], device=device, dtype=torch.float32)


def flex_mods(row: FeatureRow, device):
    """(score_mod or None, mask_mod) of FlexAttention computing the same attention as flashtrain's row."""
    slopes = alibi_slopes(row.nheads, device) if row.alibi else None
    doc_len = row.seqlen // row.documents if row.documents else 0

    def mask_mod(b, h, q_idx, kv_idx):
        visible = q_idx >= kv_idx
        if row.window >= 0:
            visible = visible & (q_idx - kv_idx <= row.window)
        if doc_len:
            visible = visible & (q_idx // doc_len == kv_idx // doc_len)
        return visible

    def capped_and_biased(score, b, h, q_idx, kv_idx):  # flashtrain's order: softcap, then ALiBi
        if row.softcap:
            score = row.softcap * torch.tanh(score / row.softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score
    return (capped_and_biased if row.softcap or row.alibi else None), mask_mod


def flashtrain_fn(row: FeatureRow, device, impl: str = "cuda"):
    """fn(q, k, v) of flashtrain for the row; q, k, v (batch, seqlen, nheads, head_dim)."""
    if row.documents and row.mask_expr:
        from flashtrain.kernels.mask_mod import MaskMod

        doc = (torch.arange(row.seqlen, device=device) // (row.seqlen // row.documents)).to(torch.int32)
        mask = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
        return lambda q, k, v: flash_attn_func(q, k, v, causal=True, impl=impl, mask_mod=mask)
    if row.documents:
        lengths = torch.full((row.batch * row.documents,), row.seqlen // row.documents, device=device)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        doc_len = row.seqlen // row.documents

        def documents(q, k, v):
            packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
            out = flash_attn_varlen_func(*packed, cu, cu, doc_len, doc_len, causal=True, impl=impl)
            return out.view(q.shape)
        return documents
    options = {}
    if row.window >= 0:
        options["window_size"] = (row.window, 0)
    if row.softcap:
        options["softcap"] = row.softcap
    if row.alibi:
        options["alibi_slopes"] = alibi_slopes(row.nheads, device)
    return lambda q, k, v: flash_attn_func(q, k, v, causal=True, impl=impl, **options)


# Head dims past 256: FlexAttention's default Triton tiles run out of shared memory (H200, 2026-11-26); these small
# tiles (dividing the block mask's 128 x 128 blocks, one pipeline stage) are the ones it is given there.
FLEX_WIDE_HEAD_TILES = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16,
                        "num_stages": 1}


def flex_fn(row: FeatureRow, device, compile_flex: bool = True):
    """fn(q, k, v) of FlexAttention for the row; q, k, v (batch, seqlen, nheads, head_dim) (transposed inside)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    score_mod, mask_mod = flex_mods(row, device)
    block_mask = create_block_mask(mask_mod, None, None, row.seqlen, row.seqlen, device=device)
    if compile_flex:
        # The timed backward pass reruns one graph's backward (retain_graph): a compiled backward that donates its
        # saved buffers refuses that (H200 run, 2026-11-26), so donation is off, for the benchmark process only.
        torch._functorch.config.donated_buffer = False
    attend = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
    options = FLEX_WIDE_HEAD_TILES if row.head_dim > 256 else None

    def fn(q, k, v):
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                     block_mask=block_mask, kernel_options=options)
        return out.transpose(1, 2)
    return fn


def fa4_fn(row: FeatureRow, device):
    """fn(q, k, v) of FA4 for the rows it offers (window, softcap, documents as varlen), else one that raises
    fa4_baseline.Unavailable (the row's FA4 cells stay empty)."""
    if row.alibi or row.mask_expr or row.head_dim > 256:
        return fa4_baseline._refusing("FA4 does not offer this row's feature here")
    if row.documents:
        doc_len = row.seqlen // row.documents
        cu = torch.arange(0, row.batch * row.seqlen + 1, doc_len, device=device, dtype=torch.int32)
        attend = fa4_baseline.varlen_attention(cu, doc_len, causal=True)

        def documents(q, k, v):
            return attend(*[x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]).view(q.shape)
        return documents
    return fa4_baseline.attention(True, window=row.window, softcap=row.softcap)


def case(impl: str, row: FeatureRow, device):
    """(fn, (q, k, v), dout) of one implementation."""
    gen = torch.Generator(device).manual_seed(0)
    shape = (row.batch, row.seqlen, row.nheads, row.head_dim)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if impl == "flashtrain":
        fn = flashtrain_fn(row, device)
    elif impl == "flex":
        fn = flex_fn(row, device)
    elif impl == "fa4":
        fn = fa4_fn(row, device)
    else:
        fn = lambda q, k, v: flash_attn_func(q, k, v, causal=True, impl="cuda")  # noqa: E731
    return fn, (q, k, v), dout


def add_ratios(row: dict, passes, feature: FeatureRow) -> None:
    for kind, _ in passes:
        ft, flex, plain, fa4 = (row.get(f"{impl}_{kind}") for impl in ("flashtrain", "flex", "plain", "fa4"))
        row[f"vs_flex_{kind}"] = round(ft / flex, 3) if ft and flex else None
        row[f"vs_fa4_{kind}"] = round(ft / fa4, 3) if ft and fa4 else None
        row[f"vs_plain_tflops_{kind}"] = round(ft / plain, 3) if ft and plain else None  # work per computed block
        ft_ms, plain_ms = row.get(f"flashtrain_{kind}_ms"), row.get(f"plain_{kind}_ms")
        row[f"speedup_over_plain_{kind}"] = round(plain_ms / ft_ms, 2) if ft_ms and plain_ms else None
        row[f"vs_plain_block_{kind}"] = (round(plain_ms / feature.plain_tiles() / (ft_ms / feature.computed_tiles()), 3)
                                         if ft_ms and plain_ms else None)


def run(repeats: int, rounds: int, only: str | None = None) -> list[dict]:
    import attention_timing  # the timers and PASSES shared with benchmarks/attention.py

    device = torch.device("cuda")
    out = []
    for row in feature_rows():
        if only and only not in row.name:
            continue
        # each row compiles FlexAttention afresh: the previous rows' graphs (other score / mask mods, guarded on the
        # closures) would count against dynamo's recompile limit (an ALiBi row after two others fell back to eager
        # tracing and failed, H200 2026-11-26)
        torch._dynamo.reset()
        record = {**asdict(row), "pairs": row.pairs(), "fwd_gflop": round(row.fwd_flops() / 1e9, 2),
                  "tiles": row.computed_tiles(), "plain_tiles": row.plain_tiles()}
        for _ in range(rounds):
            cases = {impl: case(impl, row, device) for impl in IMPLS}
            for impl, times in attention_timing.time_passes_interleaved(cases, repeats, row.name).items():
                attention_timing.keep_best(record, impl, times, row.plain_fwd_flops() if impl == "plain" else row.fwd_flops())
            del cases
        add_ratios(record, attention_timing.PASSES, row)
        out.append(record)
        print(f"{row.name:<34} " + "  ".join(
            f"{kind}: ft {record.get(f'flashtrain_{kind}') or '-'} flex {record.get(f'flex_{kind}') or '-'} "
            f"plain {record.get(f'plain_{kind}') or '-'} fa4 {record.get(f'fa4_{kind}') or '-'} TFLOP/s "
            f"(x{record[f'vs_flex_{kind}']} flex, x{record[f'vs_fa4_{kind}']} FA4)"
            for kind in ("fwd", "fb")), flush=True)
    return out


def markdown(rows: list[dict], fa4: str = fa4_baseline.NOT_INSTALLED) -> str:
    """One line per row; fa4: FA4's version ("not installed": its cells say so)."""
    missing = fa4_baseline.NOT_INSTALLED if fa4 == fa4_baseline.NOT_INSTALLED else "-"
    lines = ["| row | fwd TFLOP/s ft / flex / plain / FA4 | fwd+bwd TFLOP/s ft / flex / plain / FA4 | fwd / flex | "
             "fwd+bwd / flex | fwd / FA4 | fwd+bwd / FA4 | per tile vs plain fwd, fwd+bwd | time plain / ft fwd, "
             "fwd+bwd |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [" / ".join(str(r.get(f"{impl}_{kind}") or (missing if impl == "fa4" else "-")) for impl in IMPLS)
                 for kind in ("fwd", "fb")]
        lines.append(f"| {r['name']} | {cells[0]} | {cells[1]} | {r['vs_flex_fwd'] or '-'} | {r['vs_flex_fb'] or '-'} | "
                     f"{r.get('vs_fa4_fwd') or missing} | {r.get('vs_fa4_fb') or missing} | "
                     f"{r.get('vs_plain_block_fwd') or '-'}, {r.get('vs_plain_block_fb') or '-'} | "
                     f"{r['speedup_over_plain_fwd'] or '-'}, {r['speedup_over_plain_fb'] or '-'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Bars of TFLOP/s per row, forward and forward+backward: flashtrain, compiled FlexAttention, plain attention."""
    plot_passes(rows, IMPLS, [textwrap.fill(r["name"], 14) for r in rows], path, title, "TFLOP/s (pairs computed)")


def plot_passes(rows: list[dict], impls, ticks: list[str], path: Path, title: str, ylabel: str = "TFLOP/s") -> None:
    """Two panels (forward, forward+backward) of bars per row, one per implementation (rows' {impl}_fwd / {impl}_fb;
    "-" where one did not run), labelled with their values; general over the rows' names and implementations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(min(15, 7 + 0.9 * len(rows) * len(impls) / 3), 4.5), sharey=True)
    width = 0.8 / len(impls)
    for ax, (kind, label) in zip(axes, (("fwd", "forward"), ("fb", "forward + backward"))):
        for i, impl in enumerate(impls):
            values = [r.get(f"{impl}_{kind}") or 0.0 for r in rows]
            bars = ax.bar([x + (i - (len(impls) - 1) / 2) * width for x in range(len(rows))], values, width,
                          label=impl)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v else "-" for v in values], fontsize=7 if len(impls) < 4 else 5)
        ax.set_xticks(range(len(rows)), ticks, fontsize=8)
        ax.set_ylim(0, 1.2 * max([r.get(f"{impl}_{k}") or 0.0 for r in rows for impl in impls for k in ("fwd", "fb")]
                                 + [1.0]))
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].legend(loc="upper left", ncol=len(impls), fontsize=8 if len(impls) < 4 else 7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (the PNG beside it)")
    parser.add_argument("--only", default=None, help="only the rows whose name contains this text")
    parser.add_argument("--plot", type=Path, default=None, help="only redraw the PNG of this JSON (no GPU)")
    parser.add_argument("--require-fa4", action="store_true",
                        help="stop at once, naming the import error, where flash-attn-4 cannot be imported")
    args = parser.parse_args()
    if args.require_fa4 and args.plot is None:
        fa4_baseline.require()
    if args.plot:
        data = json.loads(args.plot.read_text())
        plot(data["rows"], args.plot.with_suffix(".png"), f"{data['env']['gpu']}, torch {data['env']['torch']}, "
             f"{data['env']['date'][:10]}: feature rows, bf16")
        return
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "fa4": fa4_baseline.version()}
    rows = run(args.repeats, args.rounds, args.only)
    out = args.out or RESULTS / f"attention_features-{gpu.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"), f"{gpu}, torch {torch.__version__}, {env['date'][:10]}: feature rows, bf16")
    print(f"wrote {out} (+ .png)\n\n{markdown(rows, env['fa4'])}")


if __name__ == "__main__":
    main()
