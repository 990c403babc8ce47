"""BERT-large masked-LM training throughput on one GPU: flashtrain's BertForMaskedLM (padding removed, varlen
FlashAttention kernel, the MLM head on the masked tokens only) against Hugging Face transformers' BertForMaskedLM
with attn_implementation="sdpa" (padded batch, key-padding mask, the head on every token, as its API does), in one
process, at the same micro-batch.

Every implementation runs the same training step on the same batch: bf16 autocast (fp32 on the CPU), forward,
masked-LM cross-entropy in float32, backward, grad-norm clipping at 1.0, flashtrain's LAMB (the recipe's optimizer,
the same code for both), dropout 0.1 as in pretraining. The batch holds --batch sequences of at most 512 tokens with
realistic padding: a share --full-fraction of the sequences is full length and the others have a length drawn
uniformly in [64, 512) (default 0.7: ~13% of the batch is padding; BERT pretraining data cut at 512 tokens has more,
so this is a conservative setting for the unpadded model); 15% of the real tokens are masked. The step time is the
median of --steps timed steps (CUDA events) after --warmup untimed ones; sequences/s = batch / step time.
"flashtrain-sdpa" is flashtrain's model with attn_impl=sdpa (padded, PyTorch's attention and its backend choice):
it separates the kernel's share of the gain from the rest; "flashtrain-sdpa-cudnn" / "-fa2" / "-efficient" force one
SDPA backend (a backend that cannot run the padded, dropout batch reports its error). On a GPU the implementations'
steps are interleaved (train_gpt2.time_interleaved: each preceded equally often by every other, all under the same
clocks; every model stays in memory); --timing windows runs each one's steps back to back.

    python benchmarks/train_bert.py --out $OUT/train_bert.json          # BERT-large, seq 512, batch 32 on a GPU
    python benchmarks/train_bert.py --vs-sdpa                           # unpadded flash vs every padded SDPA backend
    python benchmarks/train_bert.py --vs-sdpa --compile                 # ... eager and under torch.compile
    python benchmarks/train_bert.py --vs-sdpa --full-fraction 0 --min-length 2   # ~50% padding (MLPerf's data)
    python benchmarks/train_bert.py --device cpu --tiny --out /tmp/b.json   # smoke test (2 layers x 64 wide)

Needs torch, transformers and matplotlib only.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import warnings
from pathlib import Path

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt2 import measure_matmul_flops, save_results, time_steps  # noqa: E402  (the sibling's helpers)

from flashtrain.kernels import flash_attn_varlen_func  # noqa: E402
from flashtrain.models.bert import BertConfig, BertForMaskedLM  # noqa: E402
from flashtrain.train.lamb import LAMB  # noqa: E402

VOCAB = 30522
MODEL_SHAPES = {"large": (24, 1024, 16, 4096), "tiny": (2, 64, 2, 128)}  # layers, width, heads, MLP width
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
IMPLS = ("flashtrain", "flashtrain-sdpa", *(f"flashtrain-sdpa-{backend}" for backend in SDPA_BACKENDS), "hf-sdpa")
DEFAULT_IMPLS = ("flashtrain", "flashtrain-sdpa", "hf-sdpa")
VS_SDPA = IMPLS[:-1]


def make_batch(batch: int, seq_len: int, full_fraction: float, vocab_size: int, device: torch.device,
               seed: int = 0, min_length: int = 64) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, labels (batch, seq_len): lengths as the module docstring says, right-padded with 0;
    15% of the real tokens after [CLS] carry a label (their original id), the rest -100."""
    generator = torch.Generator().manual_seed(seed)
    is_full = torch.rand(batch, generator=generator) < full_fraction
    lengths = torch.where(is_full, seq_len, torch.randint(min_length, seq_len, (batch,), generator=generator))
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(200, vocab_size, (batch, seq_len), generator=generator) * attention_mask
    input_ids[:, 0] = 101  # [CLS]
    is_predicted = (torch.rand(batch, seq_len, generator=generator) < 0.15) & attention_mask.bool()
    is_predicted[:, 0] = False
    labels = torch.where(is_predicted, input_ids, -100)
    input_ids = torch.where(is_predicted, 103, input_ids)  # [MASK]
    return {k: v.to(device) for k, v in
            {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}.items()}


def build_loss_fn(impl: str, shape, seq_len: int, vocab_size: int, device: torch.device):
    """(model, loss_fn(batch) -> masked-LM loss) with float32 parameters on `device`; a "-compile" name steps the
    model under torch.compile (the parameters and the optimizer are the eager model's)."""
    n_layer, width, n_head, mlp = shape
    compiled = impl.endswith("-compile")
    impl = impl.removesuffix("-compile")
    if impl.startswith("flashtrain"):
        backend = impl.removeprefix("flashtrain-sdpa-") if impl.startswith("flashtrain-sdpa-") else None
        config = BertConfig(vocab_size=vocab_size, hidden_size=width, num_hidden_layers=n_layer,
                            num_attention_heads=n_head, intermediate_size=mlp, max_length=seq_len,
                            head="masked_lm", attn_impl="flash" if impl == "flashtrain" else "sdpa")
        with device:
            model = BertForMaskedLM(config)
        step_model = torch.compile(model) if compiled else model

        def flashtrain_loss(b):
            with sdpa_kernel(SDPA_BACKENDS[backend]) if backend else contextlib.nullcontext():
                return step_model(b["input_ids"], b["attention_mask"], labels=b["labels"])[1]
        return model, flashtrain_loss

    import transformers  # only the comparison needs it

    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=width, num_hidden_layers=n_layer,
                                     num_attention_heads=n_head, intermediate_size=mlp,
                                     max_position_embeddings=seq_len)
    with device:
        model = transformers.BertForMaskedLM._from_config(config, attn_implementation="sdpa")
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"transformers picked attn_implementation={model.config._attn_implementation!r}")

    def loss_fn(b):  # HF's own loss: logits on every token, cross-entropy where labels != -100, in float32
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), ignore_index=-100)
    return model, loss_fn


def check_flash_kernel(shape, seq_len: int, device: torch.device) -> str:
    """On CUDA, insist that flashtrain runs its CUDA kernel (varlen, with dropout), never the slow reference."""
    if device.type != "cuda":
        return "reference (CPU)"
    _, width, n_head, _ = shape
    cu_seqlens = torch.tensor([0, seq_len, 2 * seq_len - 100], device=device, dtype=torch.int32)
    q, k, v = (torch.randn(2 * seq_len - 100, n_head, width // n_head, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, seq_len, seq_len, dropout_p=0.1,
                           impl="cuda").sum().backward()
    return "cuda kernel"


def prepare(impl: str, shape, seq_len: int, batch: dict, device: torch.device, warmup: int) -> tuple:
    """One implementation's training step, warmed up: (train_step, its row's fields so far); peak memory as in
    train_gpt2.prepare (beyond what was allocated before it was built)."""
    torch.manual_seed(0)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn = build_loss_fn(impl, shape, seq_len, VOCAB if shape != MODEL_SHAPES["tiny"] else 512, device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = LAMB([{"params": decay, "weight_decay": 0.01},
                      {"params": no_decay, "weight_decay": 0.0, "trust_ratio": False}],
                     lr=3.75e-3, betas=(0.9, 0.999), eps=1e-6)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def train_step():
        with autocast:
            loss = loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(warmup):
            train_step()
    return train_step, {
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else None,
        "n_params": sum(p.numel() for p in model.parameters()),
        "warnings": sorted({str(w.message) for w in caught}),
    }


def run_all(impls, shape, seq_len, batch, device, warmup, steps, interleave: bool) -> list[dict]:
    """Every implementation built and warmed up (a failure, an out-of-memory too, reported in its row), then timed:
    on a GPU interleaved unless interleave is False."""
    rows, steps_of = {}, {}
    for impl in impls:
        row = rows[impl] = {"impl": impl, "seq_len": seq_len, "batch": batch["input_ids"].shape[0]}
        try:
            if impl.removesuffix("-compile") == "flashtrain":
                row["attention"] = check_flash_kernel(shape, seq_len, device)
            steps_of[impl], fields = prepare(impl, shape, seq_len, batch, device, warmup)
            row.update(status="ok", **fields)
        except torch.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as error:  # noqa: BLE001 -- reported in the table, the other implementations still run
            row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        gc.collect()
    n_sequences, n_real = batch["input_ids"].shape[0], int(batch["attention_mask"].sum())
    for impl, step_s in time_steps(steps_of, device, steps, interleave).items():
        rows[impl].update(step_ms=1000 * step_s, sequences_per_s=n_sequences / step_s,
                          real_tokens_per_s=n_real / step_s)
    del steps_of
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def format_table(rows: list[dict]) -> str:
    lines = [f"{'impl':<26} {'T':>4} {'B':>3} {'seq/s':>8} {'step ms':>8} {'peak GiB':>8}  flashtrain speedup"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['impl']:<26} {row['seq_len']:>4} {row['batch']:>3} {row['status']}")
            continue
        peak = f"{row['peak_mem_gib']:.1f}" if row["peak_mem_gib"] is not None else "-"
        speedup = f"{row['speedup_of_flashtrain']:.2f}x" if row.get("speedup_of_flashtrain") else ""
        lines.append(f"{row['impl']:<26} {row['seq_len']:>4} {row['batch']:>3} {row['sequences_per_s']:>8.1f} "
                     f"{row['step_ms']:>8.1f} {peak:>8}  {speedup}")
    return "\n".join(lines)


def plot(rows: list[dict], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["impl"] for r in ok], [r["sequences_per_s"] for r in ok], color=[f"C{i}" for i in range(len(ok))])
    for i, r in enumerate(ok):
        ax.text(i, r["sequences_per_s"], f"{r['sequences_per_s']:.0f}", ha="center", va="bottom")
    ax.set_ylabel("sequences/s (training)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"BERT-{env['model']} MLM, seq {env['seq_len']}, batch {env['batch']}, "
                 f"{100 * env['padding_fraction']:.0f}% padding\n{env['device_name']}, {env['precision']}, "
                 f"LAMB, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) | cpu (with --tiny: smoke test)")
    parser.add_argument("--tiny", action="store_true", help="2 layers x 64 wide, seq 128, vocab 512")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 32; tiny 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 512 (tiny 128)")
    parser.add_argument("--full-fraction", type=float, default=0.7, help="share of full-length sequences")
    parser.add_argument("--min-length", type=int, default=64,
                        help="the other sequences' lengths are uniform in [min-length, seq-len) (default 64). "
                             "--full-fraction 0 --min-length 2: ~50%% padding, the share Krell et al. (2021, "
                             "arXiv:2107.02027) measured in the Wikipedia data MLPerf pretrains BERT on at 512 tokens")
    parser.add_argument("--impls", nargs="+", default=None, help=f"a subset of {IMPLS} (default {DEFAULT_IMPLS})")
    parser.add_argument("--compile", action="store_true",
                        help="also time flashtrain's implementations under torch.compile (their -compile names)")
    parser.add_argument("--vs-sdpa", action="store_true",
                        help="flashtrain's model unpadded with our kernel against the same model padded on SDPA: "
                             "PyTorch's choice and each backend forced (instead of the HF model)")
    parser.add_argument("--timing", choices=("interleaved", "windows"), default="interleaved",
                        help="interleaved: the implementations' steps take turns; windows: each one's back to back")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; use --device cpu --tiny for the smoke test")
    impls = list(args.impls or (VS_SDPA if args.vs_sdpa else DEFAULT_IMPLS))
    if args.compile:
        impls += [f"{impl}-compile" for impl in impls if impl.startswith("flashtrain") and not impl.endswith("-compile")]
    for impl in impls:
        if impl.removesuffix("-compile") not in IMPLS or impl == "hf-sdpa-compile":
            raise SystemExit(f"--impls: unknown implementation {impl!r}; choose from {IMPLS} (flashtrain ones also "
                             f"with -compile)")
    model_name = "tiny" if args.tiny else "large"
    seq_len = args.seq_len or (128 if args.tiny else 512)
    if not 2 <= args.min_length < seq_len:
        raise SystemExit(f"--min-length must be in [2, --seq-len={seq_len}) (the shorter sequences' lengths are drawn "
                         f"from [min-length, seq-len)), got {args.min_length}")
    if not 0.0 <= args.full_fraction <= 1.0:
        raise SystemExit(f"--full-fraction must be in [0, 1], got {args.full_fraction}")
    batch_size = args.batch or (4 if args.tiny else 32)
    batch = make_batch(batch_size, seq_len, args.full_fraction, 512 if args.tiny else VOCAB, device,
                       min_length=args.min_length)

    import transformers

    env = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "matmul_tflops": measure_matmul_flops(device, 256 if device.type == "cpu" else 8192) / 1e12,
        "model": model_name,
        "seq_len": seq_len,
        "batch": batch_size,
        "full_fraction": args.full_fraction,
        "min_length": args.min_length,
        "padding_fraction": 1.0 - batch["attention_mask"].float().mean().item(),
        "masked_tokens": int(batch["labels"].ne(-100).sum()),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "timing": args.timing,
    }
    print(json.dumps(env), flush=True)
    rows = run_all(impls, MODEL_SHAPES[model_name], seq_len, batch, device, args.warmup, args.steps,
                   args.timing == "interleaved")
    for mode in ("", "-compile"):  # eager rows against eager flashtrain, compiled against compiled
        ours = next((r for r in rows if r["impl"] == f"flashtrain{mode}" and r["status"] == "ok"), None)
        peers = [r for r in rows if r["impl"].endswith("-compile") == bool(mode) and r["impl"] != f"flashtrain{mode}"]
        for row in peers:
            if ours is not None and row["status"] == "ok":
                row["speedup_of_flashtrain"] = ours["sequences_per_s"] / row["sequences_per_s"]
        sdpa = [r for r in peers if r["impl"].startswith("flashtrain-sdpa") and r["status"] == "ok"]
        if ours is not None and sdpa:  # the padded model on its fastest SDPA backend
            fastest = max(sdpa, key=lambda r: r["sequences_per_s"])
            env[f"fastest_sdpa{mode}"] = fastest["impl"]
            env[f"speedup_over_fastest_sdpa{mode}"] = fastest["speedup_of_flashtrain"]
    print(format_table(rows))

    return save_results("train_bert", args.out, env, rows, plot)


if __name__ == "__main__":
    main()
