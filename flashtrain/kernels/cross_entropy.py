"""Fused cross-entropy for language-model heads: `cross_entropy(logits, targets, vocab, ignore_index)` is
F.cross_entropy(logits[:, :vocab].float(), targets, ignore_index=ignore_index) (mean over the counted targets) and its
gradient, computed by two CUDA kernels (csrc/cross_entropy.cu) that read bf16 / fp16 / fp32 logits as they are: the
forward reads them once (log-sum-exp and the target's logit per row), the backward reads them once more and writes
their gradient, in their dtype. F.cross_entropy on bf16 logits first writes a float32 copy, then its log-softmax, and
the backward as much again (GPT-2 small at 16K tokens: 3.3 GB per float32 copy of a 50K-column vocabulary).

`vocab` < logits.shape[1] reads a head whose matmul ran on zero-padded columns (flashtrain.models.losses.
padded_logits): the gradient comes back for every column (zeros past vocab), so the matmul's backward takes it as
is. Targets outside [0, vocab) that are not ignore_index make the loss NaN (no device assert, no host sync).
The ops (flashtrain::cross_entropy_fwd / _bwd) have fake implementations: torch.compile keeps them as graph nodes.
"""

from __future__ import annotations

import torch
from torch import Tensor

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _params(logits: Tensor, targets: Tensor, vocab: int, ignore_index: int, lse: Tensor, loss: Tensor | None,
            grad: Tensor | None, scale: Tensor | None):
    from flashtrain.kernels import launch

    vector_elems = 16 // logits.element_size()
    aligned = [t for t in (logits, grad) if t is not None]
    vectorized = all(t.data_ptr() % 16 == 0 and t.stride(0) % vector_elems == 0 for t in aligned)
    return launch.CeParams(
        logits=logits.data_ptr(), targets=targets.data_ptr(), lse=lse.data_ptr(),
        loss=loss.data_ptr() if loss is not None else 0, grad=grad.data_ptr() if grad is not None else 0,
        scale=scale.data_ptr() if scale is not None else 0,
        row_stride=logits.stride(0), grad_row_stride=grad.stride(0) if grad is not None else 0,
        ignore_index=ignore_index, rows=logits.shape[0], vocab=vocab, width=logits.shape[1],
        vectorized=int(vectorized))


def _launch(which: int, logits: Tensor, params) -> None:
    from flashtrain.kernels import build, launch

    spec = build.cross_entropy_kernels(_DTYPES[logits.dtype])
    launch.get_kernel(spec, spec.symbols[which], logits.device).launch((logits.shape[0], 1, 1), params, logits.device)


@torch.library.custom_op("flashtrain::cross_entropy_fwd", mutates_args=(), device_types="cuda")
def cross_entropy_fwd(logits: Tensor, targets: Tensor, vocab: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """-> (loss per row: lse - the target's logit, 0 where ignored; lse per row), float32 (rows,)."""
    loss = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    _launch(0, logits, _params(logits, targets, vocab, ignore_index, lse, loss, None, None))
    return loss, lse


@cross_entropy_fwd.register_fake
def _(logits, targets, vocab, ignore_index):
    return logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(logits.shape[0],
                                                                                     dtype=torch.float32)


@torch.library.custom_op("flashtrain::cross_entropy_bwd", mutates_args=(), device_types="cuda")
def cross_entropy_bwd(logits: Tensor, targets: Tensor, lse: Tensor, scale: Tensor, vocab: int,
                      ignore_index: int) -> Tensor:
    """-> d(sum of counted rows' losses * scale)/d logits, logits' dtype and shape (zeros past vocab)."""
    grad = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    _launch(1, logits, _params(logits, targets, vocab, ignore_index, lse, None, grad, scale))
    return grad


@cross_entropy_bwd.register_fake
def _(logits, targets, lse, scale, vocab, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab: int, ignore_index: int) -> Tensor:
        loss_rows, lse = cross_entropy_fwd(logits, targets, vocab, ignore_index)
        counted = (targets != ignore_index).sum().clamp(min=1).float()  # a device scalar: no host sync
        ctx.save_for_backward(logits, targets, lse, counted)
        ctx.vocab, ctx.ignore_index = vocab, ignore_index
        return loss_rows.sum() / counted

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, targets, lse, counted = ctx.saved_tensors
        scale = (grad_loss.float() / counted).reshape(1)  # the mean's 1 / counted and the incoming gradient
        return cross_entropy_bwd(logits, targets, lse, scale, ctx.vocab, ctx.ignore_index), None, None, None


def cross_entropy(logits: Tensor, targets: Tensor, vocab: int | None = None, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of logits (rows, columns) [:, :vocab] against targets (rows,), float32, on the CUDA kernels
    (the module's docstring); 0 when every target is ignore_index (F.cross_entropy: NaN)."""
    vocab = check_inputs(logits, targets, vocab)
    if logits.device.type != "cuda":
        raise ValueError(f"the fused cross-entropy runs on CUDA tensors, logits are on {logits.device.type}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _CrossEntropy.apply(logits, targets.to(torch.int64).contiguous(), vocab, ignore_index)


def check_inputs(logits: Tensor, targets: Tensor, vocab: int | None) -> int:
    """Validate (naming the argument) and return vocab (default: every column)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (rows, columns), got shape {tuple(logits.shape)}")
    if targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"targets must be ({logits.shape[0]},) like logits' rows, got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor (int64), got {targets.dtype}")
    if logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    vocab = logits.shape[1] if vocab is None else vocab
    if not 0 < vocab <= logits.shape[1]:
        raise ValueError(f"vocab must be in [1, {logits.shape[1]}] (logits' columns), got {vocab}")
    if logits.shape[0] >= 2**31 or logits.shape[1] >= 2**31:
        raise ValueError(f"logits of shape {tuple(logits.shape)}: rows and columns must be < 2^31")
    return vocab
