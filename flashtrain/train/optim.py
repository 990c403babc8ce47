"""AdamW or LAMB with GPT-style parameter groups, and the learning-rate schedules: linear warmup, then cosine, rsqrt
or linear decay."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's local shard when it is a DTensor (FSDP2's parameters, gradients and optimizer state), else the
    tensor: in-place updates of the shard update the DTensor."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


class ShardLocalAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose update runs on the local shards of DTensor parameters (FSDP2), with their gradients and
    moments, instead of dispatching each of its list ops through DTensor: the same kernels and arithmetic (AdamW is
    element-wise), at a fraction of the host time (H200, GPT-2 small under FSDP2 on 2 GPUs: 6.5 ms of host time per
    step through DTensor, spent while the GPU waited; benchmarks/probes/trace_gaps.py). The state stays DTensors, so
    checkpoints (torch.distributed.checkpoint) see what torch.optim.AdamW has; plain parameters step as in AdamW.
    A group steps on local shards only where that is the same update: each DTensor gradient laid out as its
    parameter (same mesh and placements, none Partial, as FSDP2 and HSDP give) and no differentiable step; any other
    group goes through DTensor as in torch.optim.AdamW."""

    def _init_group(self, group, params_with_grad, grads, *state_lists):
        has_complex = super()._init_group(group, params_with_grad, grads, *state_lists)
        # (the same mesh object, as FSDP2 gives: an identity test, not DeviceMesh equality, per tensor and step)
        if not group["differentiable"] and all(
                not isinstance(p, DTensor) or (isinstance(g, DTensor) and g.device_mesh is p.device_mesh and
                                               g.placements == p.placements and
                                               not any(pl.is_partial() for pl in g.placements))
                for p, g in zip(params_with_grad, grads)):
            for tensors in (params_with_grad, grads, *state_lists):
                tensors[:] = local_shards(tensors)
        return has_complex


@torch.no_grad()
def clip_grad_norm_(accelerator, parameters, max_norm: float) -> torch.Tensor:
    """accelerator.clip_grad_norm_ (2-norm of every gradient together, scaled down to max_norm when above it; returns
    the norm before clipping), with FSDP2's DTensor gradients computed on their local shards: each process's norm of
    its shards, the squares summed over the shards' process group (one all-reduce), the coefficient applied to the
    shards in place; the arithmetic of DTensor's own partial-norm reduction, without dispatching every list op
    through DTensor (H200, GPT-2 small under FSDP2: 3-6 ms of host time per step, spent while the GPU waited). Other
    layouts (plain tensors, several meshes, replicated placements) take accelerator.clip_grad_norm_. Every process
    decides alike (FSDP2 shards every parameter on every process), so all of them join the one all-reduce."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    mesh = grads[0].device_mesh if grads and isinstance(grads[0], DTensor) else None
    sharded = mesh is not None and mesh.ndim == 1 and all(
        isinstance(g, DTensor) and g.device_mesh is mesh and g.placements[0].is_shard() for g in grads)
    if not sharded:
        return accelerator.clip_grad_norm_(parameters, max_norm)
    accelerator.unscale_gradients()
    local = local_shards(grads)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local, 2.0)), 2.0) ** 2
    torch.distributed.all_reduce(norm, group=mesh.get_group())
    norm = norm ** 0.5
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(local, coefficient)
    return norm


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """cfg.name "adamw" or "lamb", on param_groups. LAMB: the layer-wise trust ratio on the decayed group only, as
    NVIDIA's MLPerf BERT (apex FusedLAMB, use_nvlamb=False: biases and norms get a plain Adam-style step)."""
    if cfg.name == "lamb":
        decay, no_decay = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
        return LAMB([decay, {**no_decay, "trust_ratio": False}], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                    eps=cfg.eps)
    on_gpu = next(model.parameters()).is_cuda
    return ShardLocalAdamW(
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
