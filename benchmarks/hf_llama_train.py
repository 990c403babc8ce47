"""A tiny Llama-style transformers model trained 20 steps on flashtrain's attention: attn_implementation="ft_attention"
(flashtrain's CUDA kernel through transformers' attention interface, flashtrain.models.hf_attention) against "sdpa"
(PyTorch) and "eager" (transformers' own matmul + softmax, which measures how far bf16 runs drift apart anyway), from
the same initial weights, on the same batches, with the same optimizer. The ft_attention loss curve should equal the
sdpa one within that bf16 noise.

Model: transformers' LlamaConfig, 4 layers x 512 wide, 8 query heads on 2 key/value heads (GQA, head_dim 64), SwiGLU
MLP 1408 wide, RoPE, a vocabulary of the 256 byte values. Data: this Python's standard library sources as bytes,
--batch sequences of --seq-len bytes per step at fixed random offsets (the same for every implementation). Training:
fp32 weights under bf16 autocast (as flashtrain's trainer, and transformers' Trainer with bf16=True, train), AdamW
(lr 1e-3 after 5 linear warmup steps, betas 0.9 / 0.95, weight decay 0.1), gradient-norm clipping at 1.0, no dropout.
Reported per implementation: the loss and gradient norm of every step and the median step time (CUDA events); then
max |loss(ft_attention) - loss(sdpa)| next to max |loss(eager) - loss(sdpa)| over the steps, and a verdict.

    python benchmarks/hf_llama_train.py                  # GPU: -> benchmarks/results/hf_llama_train-<gpu>.json/.png
    python benchmarks/hf_llama_train.py --out $OUT/hf_llama_train.json
    python benchmarks/hf_llama_train.py --device cpu --tiny --steps 4 --out /tmp/l.json   # smoke test (reference)

Needs torch, transformers and matplotlib only (no hydra, datasets or accelerate); on the GPU what flashtrain's kernel
needs (cuda-python: `python -m flashtrain.kernels.doctor` says). Exit code 1 when the verdict fails.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import sysconfig
from pathlib import Path

import torch

# this checkout's flashtrain, installed or not, and the sibling benchmark's helpers
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from train_gpt2 import save_results  # noqa: E402  (the sibling benchmark's JSON + PNG writer)

from flashtrain.models.attention import kernel_unavailable_reason  # noqa: E402
from flashtrain.models.hf_attention import NAME, register  # noqa: E402

IMPLS = (NAME, "sdpa", "eager")  # ft_attention first: it fails fast where the kernel cannot run
MODEL_SHAPES = {  # layers, width, query heads, key/value heads, MLP width
    "small": (4, 512, 8, 2, 1408),
    "tiny": (2, 64, 4, 2, 128),  # CPU smoke test
}
WARMUP_STEPS, LR = 5, 1e-3
# the verdict: ft_attention's curve within 2x the eager-vs-sdpa spread (bf16 noise) of sdpa's, plus a small floor
NOISE_FACTOR, NOISE_FLOOR = 2.0, 0.02


def stdlib_bytes(n_bytes: int) -> torch.Tensor:
    """The first n_bytes of this Python's standard library sources (sorted paths), as int64 token ids 0..255."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= n_bytes:
            break
    data = b"".join(chunks)[:n_bytes]
    if len(data) < n_bytes:
        raise SystemExit(f"the standard library has {len(data)} bytes of sources, fewer than the {n_bytes} needed")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """`steps` batches (batch, seq_len) at random offsets, fixed by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, len(tokens) - seq_len, (steps, batch), generator=generator)
    return [torch.stack([tokens[o:o + seq_len] for o in row.tolist()]) for row in offsets]


def llama_config(shape: str, seq_len: int):
    import transformers

    layers, width, heads, kv_heads, mlp = MODEL_SHAPES[shape]
    return transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=mlp,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                                    tie_word_embeddings=False, attention_dropout=0.0)


def train_one(impl: str, initial_state: dict, config, data: list[torch.Tensor], device: torch.device) -> dict:
    """`len(data)` optimizer steps of a Llama with attn_implementation=impl from initial_state -> its curve."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl)
    model.load_state_dict(initial_state)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    losses, grad_norms, step_ms = [], [], []
    for input_ids in data:
        input_ids = input_ids.to(device)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if device.type == "cuda" else (None,) * 2
        if start is not None:
            start.record()
        with autocast:
            loss = model(input_ids, labels=input_ids).loss  # transformers shifts the labels
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if end is not None:
            end.record()
            torch.cuda.synchronize()
            step_ms.append(start.elapsed_time(end))
        losses.append(loss.item())
        grad_norms.append(grad_norm.item())
        print(f"{impl:>13} step {len(losses):>3}  loss {losses[-1]:.5f}  grad norm {grad_norms[-1]:.4f}", flush=True)
    return {"impl": impl, "losses": losses, "grad_norms": grad_norms,
            "median_step_ms": statistics.median(step_ms) if step_ms else None}


def compare(rows: list[dict]) -> dict:
    """max |loss(impl) - loss(sdpa)| over the steps for each impl, and the verdict on ft_attention."""
    curves = {row["impl"]: row["losses"] for row in rows}
    spread = {impl: max(abs(a - b) for a, b in zip(curve, curves["sdpa"])) for impl, curve in curves.items()}
    noise = spread["eager"]
    bound = NOISE_FACTOR * noise + NOISE_FLOOR
    learned = curves[NAME][-1] < curves[NAME][0]
    return {"max_abs_loss_diff_vs_sdpa": spread, "bound": bound, "loss_fell": learned,
            "verdict": "PASS" if spread[NAME] <= bound and learned else "FAIL"}


def plot(rows: list[dict], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(11, 4))
    sdpa = next(row["losses"] for row in rows if row["impl"] == "sdpa")
    for row in rows:
        steps = range(1, len(row["losses"]) + 1)
        ax_loss.plot(steps, row["losses"], marker="o", markersize=3, label=row["impl"])
        if row["impl"] != "sdpa":
            ax_diff.plot(steps, [a - b for a, b in zip(row["losses"], sdpa)], marker="o", markersize=3,
                         label=f"{row['impl']} - sdpa")
    ax_loss.set(xlabel="step", ylabel="training loss (nats per byte)", title="Llama, bf16 autocast")
    ax_diff.set(xlabel="step", ylabel="loss difference", title="against attn_implementation='sdpa'")
    ax_diff.axhline(0.0, color="gray", linewidth=0.8)
    for ax in (ax_loss, ax_diff):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{env['device_name']}: {env['model']}, {env['steps']} steps of {env['batch']} x {env['seq_len']} "
                 f"bytes ({env['verdict']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) | cpu (with --tiny: smoke test)")
    parser.add_argument("--tiny", action="store_true", help="2 layers x 64 wide, 4 sequences of 128 bytes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; tiny: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default 1024; tiny: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the batch offsets")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = "tiny" if args.tiny else "small"
    batch, seq_len = args.batch or (4 if args.tiny else 16), args.seq_len or (128 if args.tiny else 1024)
    head_dim = MODEL_SHAPES[shape][1] // MODEL_SHAPES[shape][2]
    if device.type == "cuda":
        reason = kernel_unavailable_reason(device, torch.bfloat16, head_dim, block_mask=False)
        if reason is not None:
            raise SystemExit(f"flashtrain's kernel cannot run here: {reason}")

    import transformers

    register()
    config = llama_config(shape, seq_len)
    torch.manual_seed(args.seed)
    initial_state = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).state_dict()
    data = batches(stdlib_bytes(4_000_000 if not args.tiny else 200_000), args.steps, batch, seq_len, args.seed)
    rows = [train_one(impl, initial_state, config, data, device) for impl in IMPLS]
    summary = compare(rows)
    env = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": f"Llama {shape} {MODEL_SHAPES[shape]} (layers, width, heads, kv heads, MLP), head_dim {head_dim}",
           "precision": "bf16 autocast, fp32 weights",
           "steps": args.steps, "batch": batch, "seq_len": seq_len, "seed": args.seed, **summary}
    print(json.dumps({key: env[key] for key in ("max_abs_loss_diff_vs_sdpa", "bound", "loss_fell", "verdict")}))
    for row in rows:
        print(f"{row['impl']:>13}: loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}, median step "
              f"{row['median_step_ms'] or float('nan'):.1f} ms")
    result = save_results("hf_llama_train", args.out, env, rows, plot)
    if summary["verdict"] != "PASS":
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
