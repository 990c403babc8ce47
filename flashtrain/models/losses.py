"""Cross-entropy of a linear head without the (tokens, vocab) logits: `linear_cross_entropy(hidden, weight, targets)`
equals F.cross_entropy((hidden @ weight.T).float(), targets) (mean over the targets that are not ignore_index) and
its gradients, computed a chunk of rows at a time.

A language model's head over a 50K vocabulary makes the largest activations of a training step: at 16K tokens the
bf16 logits are 1.6 GB, their float32 copy for the loss 3.2 GB, and the loss's backward writes as much again. Here
each chunk's logits live only while the chunk is processed: the forward computes the chunk's loss terms and, when a
gradient is needed, already the gradients of hidden and weight (softmax minus the one-hot target, over the number of
counted targets, through the two matmuls). The backward then only scales them by the incoming gradient.

Precision as in the plain path under autocast: the matmuls in the autocast dtype (bf16 / fp16) with float32
accumulation, the softmax and the loss in float32; the weight's gradient is summed over chunks in float32."""
from __future__ import annotations

import torch
from torch import Tensor

from flashtrain.models.attention import compute_dtype

CHUNK_ELEMENTS = 2**26  # logits per chunk (256 MB in float32): 1335 rows at a 50257-token vocabulary


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_rows: int) -> Tensor:
        dtype = compute_dtype(hidden)
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            counted = targets != ignore_index
            n_counted = counted.sum().clamp(min=1).float()  # (a device scalar: no host sync)
            loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
            grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) \
                if ctx.needs_input_grad[1] else None
            for start in range(0, h.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                logits = (h[rows] @ w.T).float()  # (n, V)
                lse = torch.logsumexp(logits, dim=-1)
                target = targets[rows].clamp(min=0).unsqueeze(1)
                keep = counted[rows]
                loss += ((lse - logits.gather(1, target).squeeze(1)) * keep).sum()
                if needs_grad:  # d loss / d logits = (softmax - one_hot) / n_counted on counted rows
                    grad = torch.exp(logits.sub_(lse.unsqueeze(1)))
                    grad.scatter_add_(1, target, torch.full_like(target, -1, dtype=grad.dtype))
                    grad = (grad * (keep.float() / n_counted).unsqueeze(1)).to(dtype)
                    if grad_h is not None:
                        grad_h[rows] = grad @ w
                    if grad_w is not None:
                        grad_w += (grad.T @ h[rows]).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss / n_counted

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        grad_hidden = (grad_h * grad_loss).to(ctx.dtypes[0]) if grad_h is not None else None
        grad_weight = (grad_w * grad_loss).to(ctx.dtypes[1]) if grad_w is not None else None
        return grad_hidden, grad_weight, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                         chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """Mean cross-entropy of hidden (N, C) @ weight (V, C)^T against targets (N,) int64, over the targets that are not
    ignore_index (0 when none is counted), in float32; gradients for hidden and weight."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, C) and weight (V, C) expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},), got {tuple(targets.shape)}")
    chunk_rows = max(1, chunk_elements // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_rows)


def padded_logits(hidden: Tensor, weight: Tensor, multiple: int, bias: Tensor | None = None) -> Tensor:
    """F.linear(hidden, weight, bias) computed with the head's rows (the vocabulary) padded with zeros to a multiple
    of `multiple`: (..., padded vocab), the columns past weight.shape[0] exactly 0 (slice them off for the logits;
    cross_entropy(..., vocab=) reads the padded tensor as it is). The parameters keep their shape. A 50257-token
    vocabulary makes every matmul of the head (forward, and both of its backward) run with an odd leading dimension,
    which keeps cuBLAS off its aligned kernels; 50304 columns do not. multiple <= 1: plain F.linear."""
    vocab = weight.shape[0]
    pad = -vocab % multiple if multiple > 1 else 0
    if pad == 0:
        return torch.nn.functional.linear(hidden, weight, bias)
    weight = torch.nn.functional.pad(weight.to(compute_dtype(hidden)), (0, 0, 0, pad))  # the cast first: one copy
    if bias is not None:
        bias = torch.nn.functional.pad(bias.to(weight.dtype), (0, pad))
    return torch.nn.functional.linear(hidden, weight, bias)


def cross_entropy(logits: Tensor, targets: Tensor, vocab: int | None = None, ignore_index: int = -100,
                  fused: bool = True) -> Tensor:
    """Mean cross-entropy (float32) of logits (rows, columns) [:, :vocab] against targets (rows,), over the targets
    that are not ignore_index (0 when there is none). fused, on CUDA: flashtrain's kernels
    (flashtrain.kernels.cross_entropy: the logits read in their dtype, no float32 copy); otherwise F.cross_entropy of
    the float32 logits."""
    if fused and logits.device.type == "cuda":
        from flashtrain.kernels.cross_entropy import cross_entropy as fused_cross_entropy

        return fused_cross_entropy(logits, targets, vocab, ignore_index)
    vocab = logits.shape[-1] if vocab is None else vocab
    total = torch.nn.functional.cross_entropy(logits[:, :vocab].float(), targets, ignore_index=ignore_index,
                                              reduction="sum")
    return total / (targets != ignore_index).sum().clamp(min=1)
