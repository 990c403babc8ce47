"""Llama-style training throughput on one GPU: flashtrain's Llama (flashtrain/models/llama.py) with our kernel against
the same model on every SDPA backend (PyTorch's choice, cuDNN forced, FA2 forced) and against Hugging Face
transformers' LlamaForCausalLM with attn_implementation "sdpa" and "eager", each eager and under torch.compile, in
one process. The sibling of benchmarks/train_gpt2.py, whose timing it uses: the same training step (bf16 autocast,
forward, float32 cross-entropy over the full logits, backward, grad-norm clipping, fused AdamW), the same
micro-batch of tokens for every implementation, steps interleaved (each implementation preceded equally often by
every other), median of --steps timed steps; MFU against the bf16 matmul rate measured in the same run.

Model FLOPs per token = 6 N + 12 L T d (N: parameters, the tied head a real matmul; the attention term counts the full
T x T scores, as PaLM's MFU). Shapes (MODEL_SHAPES) are conf/model/llama-125m.yaml's and llama-350m.yaml's; the
vocabulary is GPT-2's 50257.

    python benchmarks/train_llama.py                        # 125m at 2K and 8K, every implementation, eager + compiled
    python benchmarks/train_llama.py --configs 125m:2048 --impls flashtrain hf-sdpa
    python benchmarks/train_llama.py --device cpu --tiny --out /tmp/l.json   # smoke test (CPU, seconds)

Writes benchmarks/results/train_llama-<gpu>.json and .png (tokens/s and MFU per implementation). Needs torch,
transformers and matplotlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from pathlib import Path

import torch

from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.llama import Llama, LlamaConfig
from train_gpt2 import (SDPA_BACKENDS, SDPA_IMPL, add_speedups, format_table, hf_loss_fn, measure_matmul_flops,
                        parse_impl, run_config, save_results)
from train_gpt2 import plot as gpt2_plot

VOCAB = 50257
MODEL_SHAPES = {  # name -> (n_layer, n_embd, n_head, n_kv_head, intermediate_size)
    "125m": (12, 768, 12, 4, 2048),
    "350m": (24, 1024, 16, 8, 2816),
    "tiny": (2, 64, 4, 2, 128),  # CPU smoke test
}
HF_NAMES = ("hf-sdpa", "hf-eager")
EAGER = ["flashtrain", SDPA_IMPL, *(f"{SDPA_IMPL}-{backend}" for backend in SDPA_BACKENDS), *HF_NAMES]
ALL = EAGER + [f"{impl}-compile" for impl in EAGER]


def build_loss_fn(impl: str, shape, seq_len: int, vocab_size: int, device: torch.device, chunked_loss: bool = False):
    """(model, loss_fn(x, y) -> mean cross-entropy) of one implementation, parameters in float32 on `device`."""
    n_layer, n_embd, n_head, n_kv_head, intermediate = shape
    attn, backend, mode = parse_impl(impl)
    if impl.startswith("flashtrain"):
        config = LlamaConfig(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                             n_head=n_head, n_kv_head=n_kv_head, intermediate_size=intermediate, attn_impl=attn,
                             chunked_loss=chunked_loss)
        with device:
            model = Llama(config)
        step_model = torch.compile(model, mode=mode) if mode is not None else model

        def loss_fn(x, y):  # (a forced backend also while torch.compile traces)
            with torch.nn.attention.sdpa_kernel(SDPA_BACKENDS[backend]) if backend else contextlib.nullcontext():
                return step_model(x, y)[1]
        return model, loss_fn

    import transformers  # only the comparison needs it

    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=intermediate,
                                      num_hidden_layers=n_layer, num_attention_heads=n_head,
                                      num_key_value_heads=n_kv_head, max_position_embeddings=seq_len,
                                      rope_theta=10000.0, tie_word_embeddings=True, attention_dropout=0.0)
    with device:
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn.removeprefix("hf-"))
    return model, hf_loss_fn(model, attn.removeprefix("hf-"), mode)


def flops_per_token(model, shape, seq_len: int) -> float:
    """Every parameter is a matmul's (RoPE has no table parameters; the tied head counts once, as its matmul)."""
    return training_flops_per_token(model, [], shape[0], shape[1], seq_len)


def plot(rows: list[dict], env: dict, path: Path) -> None:
    """tokens/s and MFU per (model, context), a bar per implementation (train_gpt2.plot)."""
    gpt2_plot(rows, env, path, MODEL_SHAPES, "Llama-style")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) | cpu (with --tiny: smoke test)")
    parser.add_argument("--tiny", action="store_true", help="2 layers x 64 wide, context 64 and 128, vocab 512")
    parser.add_argument("--configs", nargs="+", default=None, metavar="MODEL:CONTEXT",
                        help="(model, context) pairs, default 125m:2048 125m:8192 (tiny: tiny:64 tiny:128)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="tokens per micro-batch (default 16384)")
    parser.add_argument("--impls", nargs="+", default=None,
                        help=f"default: all of {' '.join(ALL)} (tiny: the eager ones)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiled: 3 more)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; use --device cpu --tiny for the smoke test")
    try:
        configs = [(name, int(seq_len)) for name, seq_len in (c.split(":") for c in args.configs or (
            ["tiny:64", "tiny:128"] if args.tiny else ["125m:2048", "125m:8192"]))]
    except ValueError:
        raise SystemExit(f"--configs: MODEL:CONTEXT pairs such as 125m:2048, got {args.configs}") from None
    batch_tokens = args.batch_tokens or (256 if args.tiny else 16384)
    for name, seq_len in configs:
        if name not in MODEL_SHAPES:
            raise SystemExit(f"--configs: unknown model {name!r}; choose from {list(MODEL_SHAPES)}")
        if batch_tokens % seq_len:
            raise SystemExit(f"--batch-tokens={batch_tokens} must be a multiple of every context ({seq_len})")
    impls = args.impls or (EAGER if args.tiny else ALL)
    for impl in impls:
        try:
            parse_impl(impl)
        except ValueError as error:
            raise SystemExit(f"--impls: {error}") from None
    vocab_size = 512 if args.tiny else VOCAB

    import transformers

    matmul_size = 256 if device.type == "cpu" else 8192
    env = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "precision": "bf16 autocast" if device.type == "cuda" else "fp32", "matmul_size": matmul_size,
           "matmul_tflops": measure_matmul_flops(device, matmul_size) / 1e12, "batch_tokens": batch_tokens,
           "vocab_size": vocab_size, "warmup_steps": args.warmup, "timed_steps": args.steps,
           "shapes": {name: MODEL_SHAPES[name] for name, _ in configs}}
    print(json.dumps(env), flush=True)
    rows = []
    for model_name, seq_len in configs:
        for row in run_config(impls, model_name, seq_len, batch_tokens // seq_len, vocab_size, device, args.warmup,
                              args.steps, True, shapes=MODEL_SHAPES, build=build_loss_fn, flops=flops_per_token):
            if row["status"] == "ok":
                row["model_tflops"] = row["tokens_per_s"] * row["flops_per_token"] / 1e12
                row["mfu"] = row["model_tflops"] / env["matmul_tflops"]
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
    add_speedups(rows)
    print(format_table(rows))
    return save_results("train_llama", args.out, env, rows, plot)


if __name__ == "__main__":
    main()
