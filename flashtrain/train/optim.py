"""AdamW or LAMB with GPT-style parameter groups, and the learning-rate schedules: linear warmup, then cosine, rsqrt
or linear decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from flashtrain.train.config import SCHEDULES, OptimConfig
from flashtrain.train.lamb import LAMB


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool) -> list[dict]:
    """Split parameters into decayed and non-decayed groups.

    Decayed: weights of Linear layers (and embeddings if `decay_embeddings`). Not decayed: biases, norm weights,
    and embeddings unless asked. Decided by module type, so a tied weight (lm_head is wte) is counted once.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            is_embedding = isinstance(module, nn.Embedding)
            if param.dim() >= 2 and (not is_embedding or decay_embeddings):
                decay.append(param)
            else:
                no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """cfg.name "adamw" or "lamb", on param_groups. LAMB: the layer-wise trust ratio on the decayed group only, as
    NVIDIA's MLPerf BERT (apex FusedLAMB, use_nvlamb=False: biases and norms get a plain Adam-style step)."""
    if cfg.name == "lamb":
        decay, no_decay = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
        return LAMB([decay, {**no_decay, "trust_ratio": False}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                    eps=cfg.eps)
    on_gpu = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay, cfg.decay_embeddings),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=cfg.fused and on_gpu,
    )


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float, schedule: str = "cosine") -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then cosine or linear to
    min_lr_ratio at max_steps, or rsqrt: sqrt(warmup_steps / (step + 1)), LRA's "linear_warmup * rsqrt_decay" divided by its value
    at the end of warmup (LRA's constant 0.05 with 1000 warmup steps is a peak of 0.05 / sqrt(1000))."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "rsqrt":
        return math.sqrt(warmup_steps / (step + 1))
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio, cfg.schedule)
    )
