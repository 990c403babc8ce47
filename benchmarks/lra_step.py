"""One training step of the Path-X and Path-256 models at full length: tokens/s, peak memory, GPU-hours of a full run.

Cases (model, batch and length from the recipes, composed through Hydra as a run would):
    path64   recipe path64:  4,097 tokens (CLS + 64 x 64),   batch 256, dense
    pathx    recipe pathx:  16,385 tokens (CLS + 128 x 128), batch 64,  dense
    path256  recipe path256: 65,537 tokens (CLS + 256 x 256), batch 32,  block-sparse (model/attention=butterfly)
A step is what the trainer does: forward and backward under bf16 autocast with fp32 weights, AdamW (fused), random
pixel tokens. `--impl flash` asks for flashtrain's CUDA kernel and never falls back: a case the kernel refuses (e.g.
a block_mask before the block-sparse kernel exists) is reported with the kernel's reason, not run on the slow
reference. The GPU-hours of a full run = recipe steps x batch x tokens / measured tokens/s.

    python benchmarks/lra_step.py --out $OUT                      # all cases, our kernel
    python benchmarks/lra_step.py --cases pathx --impl sdpa --out $OUT
Writes $OUT/lra_step.json and $OUT/lra_step.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = ("path64", "pathx", "path256")


def recipe_config(recipe: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from flashtrain.train import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=[f"recipe={recipe}", "name=bench", "logger=none",
                                                                "init_from=null"]))


def kernel_refusal(model_cfg, seqlen: int, device: torch.device) -> str | None:
    """Why flashtrain's CUDA kernel would not run this model's attention (None: it runs), asked with impl='cuda'."""
    from flashtrain.kernels import flash_attn_func

    head_dim = model_cfg.d_model // model_cfg.n_head
    q = torch.randn(1, seqlen, model_cfg.n_head, head_dim, device=device, dtype=torch.bfloat16)
    block_mask = model_cfg.attention.block_mask(seqlen)
    block_mask = None if block_mask is None else block_mask.to(device)
    try:
        flash_attn_func(q, q, q, block_mask=block_mask, impl="cuda")
    except RuntimeError as error:
        return str(error)
    return None


def run_case(name: str, impl: str, steps: int, warmup: int, batch: int | None) -> dict:
    from flashtrain.models.lra import LRAClassifier

    cfg = recipe_config(name)
    try:
        model_cfg = replace(cfg.model, attn_impl=impl)  # flash | sdpa | reference
    except ValueError as error:  # the model's attention cannot run on impl (block-sparse on sdpa)
        return {"case": name, "impl": impl, "batch": batch or cfg.trainer.micro_batch_size,
                "seqlen": cfg.model.max_len, "status": f"skipped: {error}"}
    batch = batch or cfg.trainer.micro_batch_size
    tokens = model_cfg.max_len - (model_cfg.pooling == "cls")  # pixels; the model adds the CLS token
    result = {"case": name, "impl": impl, "batch": batch, "seqlen": model_cfg.max_len, "n_layer": model_cfg.n_layer,
              "d_model": model_cfg.d_model, "n_head": model_cfg.n_head,
              "attention": {"name": model_cfg.attention.name, **vars(model_cfg.attention)}}
    device = torch.device("cuda")
    if impl == "flash":
        reason = kernel_refusal(model_cfg, model_cfg.max_len, device)
        if reason is not None:
            return {**result, "status": f"kernel refused: {reason}"}

    torch.manual_seed(0)
    model = LRAClassifier(model_cfg).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, fused=True)
    x = torch.randint(0, 256, (batch, tokens), device=device)
    y = torch.randint(0, 2, (batch,), device=device)

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
    except torch.cuda.OutOfMemoryError as error:
        return {**result, "status": f"out of memory: {str(error).splitlines()[0]}"}
    tokens_per_s = batch * model_cfg.max_len / seconds
    run_tokens = cfg.trainer.max_steps * (cfg.trainer.global_batch_size or batch) * model_cfg.max_len
    return {**result, "status": "ok", "step_s": seconds, "tokens_per_s": tokens_per_s,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss),
            "recipe_steps": cfg.trainer.max_steps,
            "recipe_epochs": cfg.trainer.max_steps * cfg.trainer.micro_batch_size // cfg.data.n_train,
            "full_run_gpu_hours": run_tokens / tokens_per_s / 3600}


def table(rows: list[dict]) -> str:
    lines = ["| case | impl | batch x tokens | step (s) | tokens/s | peak memory (GiB) | full run (GPU-hours) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['impl']} | {r['batch']} x {r['seqlen']} | {r['status']} | | | |")
            continue
        lines.append(f"| {r['case']} | {r['impl']} | {r['batch']} x {r['seqlen']} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['peak_memory_gib']:.1f} | {r['full_run_gpu_hours']:,.1f} "
                     f"({r['recipe_epochs']} epochs, {r['recipe_steps']:,} steps) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--impl", choices=("flash", "sdpa", "reference"), default="flash",
                        help="flash: flashtrain's CUDA kernel, no fallback")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (kernel compile, allocator)")
    parser.add_argument("--batch", type=int, default=None, help="override the recipes' batch sizes")
    parser.add_argument("--out", required=True, help="directory for lra_step.json and lra_step.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("lra_step.py measures a GPU: no CUDA device found")
    rows = []
    for name in args.cases:
        row = run_case(name, args.impl, args.steps, args.warmup, args.batch)
        row["device"] = torch.cuda.get_device_name()
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lra_step.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "lra_step.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
