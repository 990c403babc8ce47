"""What a longer context buys, measured on the same tokens for every model (GPT-2 and Llama-style runs alike).

Every model scores the same held-out documents: the first `--docs` documents of the validation split that are at
least max(buckets) + 1 tokens long, each cut to its first max(buckets) + 1 tokens. Each token is scored once, with
as much of its document before it as the model can see:

    a model whose window (n_positions) covers the document reads it in one pass;
    a shorter one slides its window along the document with `--stride` (default 512): the first window scores all
    its tokens, each later window only its last `stride` ones, so every token past the first window has between
    window - stride and window tokens of context (Hugging Face's perplexity recipe).

Perplexity is reported by the position of the predicted token's context in its document (buckets 0-1K, 1K-2K,
2K-4K by default: the token after input position i, for i in [lo, hi)). In 0-1K a 1K and a 4K model see the same
context; beyond it only the 4K model sees the whole document, so that is where the benefit (or cost) of context is.

    python benchmarks/gpt2_context.py --run 1K=runs/gpt2-small-1k/DATE --run 4K=runs/gpt2-small-4k/DATE \\
        --out benchmarks/results/gpt2_context-h200          # -> .json (table) and .png (curves + bucket bars)
    python benchmarks/gpt2_context.py --smoke --out /tmp/gpt2_context_smoke   # CPU: tiny models trained here

The runs of benchmarks/results/gpt2_context-h200 (one H200, ~2.5 minutes each; 400 steps x 64K tokens):

    R="python launch.py recipe=gpt2-small-1k data=python-site logger=none optim.warmup_steps=40 \
       trainer.eval_interval=100 trainer.save_interval=100 trainer.keep_checkpoints=8 data.val_samples=64"
    B4="model.n_positions=4096 trainer.micro_batch_size=8 trainer.global_batch_size=16"
    $R trainer.micro_batch_size=32 trainer.global_batch_size=64 trainer.max_steps=400 hydra.run.dir=runs/gpt2_context/1k
    $R $B4 trainer.max_steps=400 hydra.run.dir=runs/gpt2_context/4k
    $R $B4 trainer.max_steps=400 data.document_mask=true data.reset_positions=true hydra.run.dir=runs/gpt2_context/4k_docmask
    $R $B4 trainer.max_steps=100 optim.warmup_steps=10 init_from=runs/gpt2_context/1k/checkpoints/step_00000300 \
       hydra.run.dir=runs/gpt2_context/ext
    python benchmarks/gpt2_context.py --run 1K=runs/gpt2_context/1k --run 4K=runs/gpt2_context/4k --run 4K-docmask=runs/gpt2_context/4k_docmask \
       --run 1K-then-4K=runs/gpt2_context/ext --out benchmarks/results/gpt2_context-h200

RoPE context extension (the Llama-style model; recipes/llama-125m-1k.yaml and llama-125m-8k-yarn.yaml): a 1K
pretraining, its continuation at 8K with YaRN, and the same model trained at 8K from scratch, scored at positions up
to 8K (the 1K run slides its window: "before extension"):

    python launch.py recipe=llama-125m-1k hydra.run.dir=runs/ext/1k
    python launch.py recipe=llama-125m-8k-yarn init_from=runs/ext/1k hydra.run.dir=runs/ext/8k_yarn
    python launch.py recipe=llama-125m-2k model.n_positions=8192 trainer.micro_batch_size=4 \
        trainer.global_batch_size=8 hydra.run.dir=runs/ext/8k_scratch
    python benchmarks/gpt2_context.py --run 1K=runs/ext/1k --run 1K-then-8K-yarn=runs/ext/8k_yarn \
        --run 8K-scratch=runs/ext/8k_scratch --buckets 0,1024,2048,4096,8192 --out benchmarks/results/llama_context-h200
    python benchmarks/gpt2_context.py --smoke --smoke-family llama --out /tmp/llama_context_smoke   # CPU, the same 3

benchmarks/results/llama_context-h200.json ran these on one nvidia-h200-x2 call (~5 minutes), the two pretraining runs
side by side (CUDA_VISIBLE_DEVICES=0 and 1) and shortened: trainer.max_steps=400 for the 1K run and, for the 8K run
from scratch, trainer.max_steps=600 (as many tokens as the 1K run and its 200-step YaRN continuation together); the
record's `training` field has the commands, `tokens_seen` each run's tokens.

Every run must have been trained on the same data (corpus, tokenizer, split seed): the validation documents come
from the first run's data config, and each other run's data config must name the same token files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashtrain.data.lm import LMDataConfig, prepare_lm_data  # noqa: E402
from flashtrain.models.gpt2 import GPT2Config  # noqa: E402
from flashtrain.train.metrics import save_figure  # noqa: E402

BUCKETS = (0, 1024, 2048, 4096)  # bucket edges: input positions [0, 1K), [1K, 2K), [2K, 4K)
SMOKE_BUCKETS = (0, 64, 128, 256)


@dataclass
class Scored:
    """One model's scores: the summed negative log-likelihood and the token count of each bucket."""

    label: str
    window: int  # tokens the model reads at once (its n_positions)
    nll: np.ndarray  # (n_buckets,) float64
    tokens: np.ndarray  # (n_buckets,) int64

    def table(self, edges: tuple[int, ...]) -> dict:
        row = {bucket_name(lo, hi): {"ppl": math.exp(n / t), "tokens": int(t)}
               for lo, hi, n, t in zip(edges, edges[1:], self.nll, self.tokens)}
        row["all"] = {"ppl": math.exp(self.nll.sum() / self.tokens.sum()), "tokens": int(self.tokens.sum())}
        return {"window": self.window, "buckets": row}


def bucket_name(lo: int, hi: int) -> str:
    def short(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)
    return f"{short(lo)}-{short(hi)}"


def long_documents(tokens: np.ndarray, eos_id: int, min_tokens: int, limit: int) -> list[np.ndarray]:
    """The first `limit` documents of a flat token file (each ended by EOS) with at least `min_tokens` tokens, each
    cut to its first min_tokens."""
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    documents = [tokens[s:s + min_tokens].astype(np.int64) for s, e in zip(starts, ends) if e - s >= min_tokens]
    if not documents:
        raise ValueError(f"no validation document has {min_tokens} tokens; use a corpus with longer documents "
                         f"(data=python-site) or smaller buckets")
    return documents[:limit]


@torch.no_grad()
def token_losses(model: torch.nn.Module, document: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """document (N,) int64 -> (N - 1,) float32: loss[i] = -log p(document[i + 1] | its context), the context being
    document[:i + 1] when i < window, else the sliding window's (module docstring). stride <= window."""
    n_inputs = len(document) - 1
    losses = torch.empty(n_inputs, dtype=torch.float32, device=document.device)
    scored_to = 0  # inputs [0, scored_to) are scored
    for begin in range(0, n_inputs, stride):
        end = min(begin + window, n_inputs)
        logits = model(document[None, begin:end])[0][0, scored_to - begin:].float()  # (end - scored_to, vocab)
        losses[scored_to:end] = F.cross_entropy(logits, document[scored_to + 1:end + 1], reduction="none")
        scored_to = end
        if end == n_inputs:
            break
    return losses


def score(label: str, model: torch.nn.Module, window: int, documents: list[np.ndarray], edges: tuple[int, ...],
          stride: int, device: torch.device) -> Scored:
    nll, counts = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1, dtype=np.int64)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    for document in documents:
        with autocast:
            losses = token_losses(model, torch.from_numpy(document).to(device), window, min(stride, window))
        losses = losses.double().cpu().numpy()
        for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
            nll[b] += losses[lo:hi].sum()
            counts[b] += len(losses[lo:hi])
    return Scored(label, window, nll, counts)


# ---- runs -------------------------------------------------------------------------------------------------------

def tokens_before(init_from: str | None) -> int:
    """Tokens the weights of `init_from` (a checkpoint or run directory of a local run) had been trained on: a run
    that starts from them (context extension) continues that run's token count. 0 for none or hf:NAME."""
    from flashtrain.export import find_intact_checkpoint
    from flashtrain.train.checkpoint import CHECKPOINT_PREFIX
    from flashtrain.train.trainer import read_metrics

    if not init_from or init_from.startswith("hf:"):
        return 0
    try:
        run_dir, checkpoint = find_intact_checkpoint(init_from)
    except FileNotFoundError:
        print(f"init_from={init_from!r} is not here: its run's tokens are not counted in the curves", flush=True)
        return 0
    step = int(checkpoint.name[len(CHECKPOINT_PREFIX):])
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    return max((r["tokens"] for r in records if "tokens" in r and r["step"] <= step), default=0)


def load_runs(specs: list[str], attn_impl: str | None):
    """[(label, model, data config, metrics records)] of LABEL=RUN_DIR_OR_CHECKPOINT specs; a run started from
    another local run's weights (init_from) counts that run's tokens before its own."""
    from flashtrain.export import load_run
    from flashtrain.train.trainer import read_metrics

    runs = []
    for spec in specs:
        label, _, path = spec.partition("=")
        if not path:
            raise ValueError(f"--run {spec!r}: expected LABEL=RUN_DIR (or LABEL=CHECKPOINT_DIR)")
        run = load_run(path, attn_impl)
        run_dir = run.checkpoint.parent.parent
        metrics = run_dir / "metrics.jsonl"
        offset = tokens_before(getattr(run.cfg, "init_from", None))
        records = [{**r, "tokens": r["tokens"] + offset} if "tokens" in r else r
                   for r in (read_metrics(metrics) if metrics.is_file() else [])]
        runs.append((label, run.model, run.cfg.data, records))
    return runs


def validation_documents(data_cfgs: list[LMDataConfig], labels: list[str], min_tokens: int, limit: int):
    prepared = [prepare_lm_data(cfg) for cfg in data_cfgs]  # token caches: hits for trained runs
    for label, data in zip(labels[1:], prepared[1:]):
        if data.val_path != prepared[0].val_path:
            raise ValueError(f"run {label!r} was validated on {data.val_path}, run {labels[0]!r} on "
                             f"{prepared[0].val_path}: the runs must share corpus, tokenizer and split")
    meta = json.loads((prepared[0].val_path.parent / "meta.json").read_text())
    tokens = np.fromfile(prepared[0].val_path, dtype=meta["dtype"])
    return long_documents(tokens, prepared[0].eos_id, min_tokens, limit), prepared[0]


# ---- smoke: tiny models trained here ------------------------------------------------------------------------------

def smoke_runs(steps: int, cache_dir: str | None, family: str = "gpt2"):
    """Tiny models trained `steps` steps on the standard library, with their records. gpt2: windows 64 and 256;
    llama: a 64-token pretraining, its continuation at 256 tokens with YaRN (steps / 4 more steps, its records
    counting the pretraining's tokens first), and 256 tokens from scratch."""
    data_cfg = LMDataConfig(corpus="stdlib", max_bytes=1_500_000, vocab_size=512, seq_len=256, val_fraction=0.25,
                            num_proc=1, **({"cache_dir": cache_dir} if cache_dir else {}))
    data = prepare_lm_data(data_cfg)
    meta = json.loads((data.train_path.parent / "meta.json").read_text())
    train = torch.from_numpy(np.fromfile(data.train_path, dtype=meta["dtype"]).astype(np.int64))

    def fit(model, window: int, n_steps: int, records: list[dict]):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator, batch = torch.Generator().manual_seed(len(records)), 4096 // window  # 4K tokens per step
        tokens = records[-1]["tokens"] if records else 0
        for step in range(1, n_steps + 1):
            starts = torch.randint(0, len(train) - window - 1, (batch,), generator=generator)
            block = torch.stack([train[s:s + window + 1] for s in starts.tolist()])  # (batch, window + 1)
            loss = model(block[:, :-1], block[:, 1:])[1]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            records.append({"step": len(records) + 1, "tokens": tokens + step * batch * window,
                            "train_loss": loss.item()})
        return model.eval(), records

    def build(window: int, **rope):
        torch.manual_seed(0)
        if family == "gpt2":
            return GPT2Config(vocab_size=512, n_positions=window, n_embd=64, n_layer=2, n_head=2,
                              attn_impl="sdpa").build()
        from flashtrain.models.llama import LlamaConfig
        from flashtrain.models.rope import RopeScaling

        return LlamaConfig(vocab_size=512, n_positions=window, n_embd=64, n_layer=2, n_head=4, n_kv_head=2,
                           intermediate_size=128, attn_impl="sdpa", rope_scaling=RopeScaling(**rope)).build()

    if family == "gpt2":
        runs = []
        for window in (64, 256):
            model, records = fit(build(window), window, steps, [])
            runs.append((f"{window} window", model, data_cfg, records))
        return runs
    short, short_records = fit(build(64), 64, steps, [])
    extended = build(256, type="yarn", factor=4.0, original_max_position_embeddings=64)
    extended.load_state_dict(short.state_dict())  # RoPE has no position table: the same weights at any length
    extended, extended_records = fit(extended.train(), 256, max(1, steps // 4), list(short_records))
    scratch, scratch_records = fit(build(256), 256, steps, [])
    return [("64", short, data_cfg, short_records), ("64-then-256-yarn", extended, data_cfg, extended_records),
            ("256-scratch", scratch, data_cfg, scratch_records)]


# ---- report -------------------------------------------------------------------------------------------------------

def plot(runs, scores: list[Scored], edges: tuple[int, ...], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, _, _, records in runs:
        train = [r for r in records if "train_loss" in r]
        ax_loss.plot([r["tokens"] for r in train], [r["train_loss"] for r in train], label=label)
    ax_loss.set(xlabel="tokens", ylabel="train loss", title="training loss")
    names = [bucket_name(lo, hi) for lo, hi in zip(edges, edges[1:])]
    width = 0.8 / len(scores)
    for i, scored in enumerate(scores):
        ppl = [math.exp(n / t) for n, t in zip(scored.nll, scored.tokens)]
        bars = ax_ppl.bar(np.arange(len(names)) + (i - (len(scores) - 1) / 2) * width, ppl, width,
                          label=f"{scored.label} (window {scored.window})")
        ax_ppl.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_ppl.set_xticks(np.arange(len(names)), [f"positions {n}" for n in names])
    ax_ppl.set(ylabel="perplexity", title="held-out long documents: perplexity by token position")
    save_figure(fig, (ax_loss, ax_ppl), png)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], help="LABEL=RUN_DIR or LABEL=CHECKPOINT_DIR; repeat")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    parser.add_argument("--docs", type=int, default=64, help="held-out documents scored (the first long ones)")
    parser.add_argument("--stride", type=int, default=512, help="sliding-window stride of models shorter than a document")
    parser.add_argument("--buckets", default=None, help="bucket edges, e.g. 0,1024,2048,4096 (the default)")
    parser.add_argument("--attn-impl", default=None, help="override the runs' attn_impl (e.g. sdpa, reference)")
    parser.add_argument("--smoke", action="store_true", help="CPU check: two tiny models trained here, buckets "
                                                             "0-64, 64-128, 128-256, stride 32")
    parser.add_argument("--smoke-steps", type=int, default=100)
    parser.add_argument("--smoke-family", choices=("gpt2", "llama"), default="gpt2",
                        help="smoke: two GPT-2 windows, or the Llama-style extension runs (64, 64 -> 256 YaRN, 256)")
    parser.add_argument("--cache-dir", default=None, help="smoke: the data cache (default: flashtrain's)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.smoke:
        edges, stride = SMOKE_BUCKETS, 32
        runs = smoke_runs(args.smoke_steps, args.cache_dir, args.smoke_family)
    else:
        if not args.run:
            parser.error("give at least one --run LABEL=RUN_DIR (or --smoke)")
        edges, stride = BUCKETS, args.stride
        runs = load_runs(args.run, args.attn_impl)
    if args.buckets:
        edges = tuple(int(edge) for edge in args.buckets.split(","))
    documents, data = validation_documents([cfg for _, _, cfg, _ in runs], [r[0] for r in runs], edges[-1] + 1,
                                           args.docs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scores = []
    for label, model, _, _ in runs:
        scores.append(score(label, model.to(device), model.config.n_positions, documents, edges, stride, device))
        model.cpu()
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "validation": f"{len(documents)} documents of >= {edges[-1] + 1} tokens from {data.description}",
        "stride": stride, "runs": {s.label: s.table(edges) for s in scores},
        "tokens_seen": {label: records[-1]["tokens"] if records else None for label, _, _, records in runs},
        # training curves (tokens counted from the first run of a lineage), so the plot can be redrawn
        "curves": {label: [[r["tokens"], r["train_loss"]] for r in records if "train_loss" in r]
                   for label, _, _, records in runs},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(runs, scores, edges, args.out.with_suffix(".png"))
    names = [bucket_name(lo, hi) for lo, hi in zip(edges, edges[1:])] + ["all"]
    print(f"{summary['validation']}; {time.perf_counter() - start:.0f} s")
    print(f"{'model':>16} {'window':>6} " + " ".join(f"{n:>10}" for n in names))
    for label, row in summary["runs"].items():
        print(f"{label:>16} {row['window']:>6} " + " ".join(f"{row['buckets'][n]['ppl']:>10.3f}" for n in names))
    return summary


if __name__ == "__main__":
    main()
