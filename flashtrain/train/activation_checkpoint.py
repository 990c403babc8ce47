"""trainer.activation_checkpointing: recompute activations in the backward pass instead of keeping them, block by block.

    none        every activation the backward pass needs is kept from the forward pass
    full        each block keeps only its input; the backward pass runs the block's forward again (about one more
                forward of the blocks per step, the least memory)
    selective   each block keeps the outputs of its matrix multiplications and of attention (the costly ops) and
                recomputes the cheap rest: layer norms, GELU, dropout, residual adds, reshapes

The blocks are the modules whose class a model names in `_no_split_modules` (the same classes Accelerate's FSDP shards
as units, so FSDP and checkpointing agree on what a block is). Each is wrapped by torch's checkpoint API
(torch.utils.checkpoint, non-reentrant): the RNG state is restored before recomputing, so dropout masks repeat exactly,
and flashtrain's attention (the CUDA op, or the reference on CPU) runs inside like any other op. The wrapper keeps the
state dict's keys, so checkpoints move freely between runs with and without it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten
# selective: the ops whose outputs are kept (matmuls and attention); everything else in a block is recomputed
SAVED_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_dot_product_flash_attention,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention,
             aten._scaled_dot_product_flash_attention_for_cpu}
SAVED_CUSTOM_OPS = {"flashtrain::flash_attn_fwd"}  # flashtrain/kernels/ops.py: the CUDA kernel's forward


def _keep_matmuls_and_attention(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func.name().split(".")[0] in SAVED_CUSTOM_OPS:
        return CheckpointPolicy.MUST_SAVE
    # only ops that autograd records: inside an autograd.Function's forward (grad mode off; flashtrain's reference
    # attention on the CPU) outputs are scratch that the function may overwrite in place, and are recomputed
    if torch.is_grad_enabled() and func.overloadpacket in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def block_classes(model: nn.Module) -> set[str]:
    """The class names of the model's blocks (its `_no_split_modules`)."""
    return set(getattr(model, "_no_split_modules", None) or ())


def apply(model: nn.Module, mode: str) -> int:
    """Wrap every block of `model` in place for `mode` (none | full | selective); returns the number wrapped. Raises
    ValueError when the model names no blocks or none of them is in it."""
    if mode == "none":
        return 0
    names = block_classes(model)
    if not names:
        raise ValueError(f"trainer.activation_checkpointing={mode}: {type(model).__name__} names no blocks to "
                         f"checkpoint (a class attribute _no_split_modules = ['BlockClass', ...])")
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"trainer.activation_checkpointing={mode}: {type(model).__name__} has no module of the "
                         f"classes in its _no_split_modules {sorted(names)}")
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
    wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True,
                             **kwargs)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: type(m).__name__ in names)
    return len(blocks)
