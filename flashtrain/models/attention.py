"""The one attention entry of every model. A model config's `attn_impl` names the backend; the names live here only.

    flash      flashtrain's FlashAttention: the CUDA kernel on CUDA tensors, the plain-PyTorch reference of the same
               algorithm on CPU tensors. On CUDA a call the kernel cannot run raises with the reason (never a silent
               fallback); `check_backend` finds that at start-up, before any data is prepared.
    sdpa       PyTorch's scaled_dot_product_attention, on padded inputs with a key-padding mask
    reference  flashtrain's plain-PyTorch reference (flashtrain.kernels.reference), on any device
    auto       the CUDA kernel where it runs the model's calls, else sdpa; never the reference

Inputs are packed (padding removed: (total, H, D) with cu_seqlens, flash_attn_varlen_func) or padded ((B, T, H, D),
with an optional key-padding mask); `runs_packed` decides which, once per forward, for every model.

Attention layers (`BidirectionalSelfAttention`) hold an inner attention module that maps q, k, v to the output:
`ExactAttention` (softmax attention through `attention` above, optionally block-sparse) or one of the variants of
flashtrain/models/attention_variants/ (Linformer, Performer, local window, LSH, ...). Every inner module takes the
same call, `inner(q, k, v, dropout_p=..., cu_seqlens=..., max_seqlen=..., key_padding_mask=..., block_mask=...)`, and
is built by the variant's config, an `AttentionConfig` (`config.build(...)`), which also says whether the model packs
its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func
from flashtrain.kernels.interface import features_unavailable_reason
from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE
from flashtrain.parallel.context import active_context

ATTN_IMPLS = ("flash", "sdpa", "reference", "auto")
# what runs a call: our CUDA kernel, our reference, or PyTorch's SDPA
KERNEL, REFERENCE, SDPA = "kernel", "reference", "sdpa"


def check_attn_impl(attn_impl: str) -> None:
    """For model configs' __post_init__: a ValueError naming the field unless attn_impl is one of ATTN_IMPLS."""
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")


def kernel_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int, block_mask: bool,
                              features: tuple[str, ...] = ()) -> str | None:
    """None when flashtrain's CUDA kernel runs attention on `device` in `dtype` with the options named in `features`
    (window_size, softcap), else a sentence saying why not."""
    if device.type != "cuda":
        return f"the tensors are on {device.type}; the CUDA kernel needs CUDA tensors"
    reason = features_unavailable_reason(features)
    if reason is not None:
        return reason
    from flashtrain.kernels import ops  # the kernel's Python side; only CUDA tensors need it

    return ops.unavailable_reason(device, head_dim=head_dim, dtype=dtype, block_mask=block_mask)


def backend(attn_impl: str, device: torch.device, dtype: torch.dtype, head_dim: int,
            block_mask: bool = False, features: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """(KERNEL | REFERENCE | SDPA, why the kernel does not run or None) for calls on `device` in `dtype` with the
    attention options named in `features` (window_size, softcap). attn_impl flash on a CUDA device where the kernel
    cannot run raises RuntimeError with the reason; SDPA chosen for a softcap raises ValueError (it has none)."""
    if attn_impl == "reference":
        return REFERENCE, None
    reason = kernel_unavailable_reason(device, dtype, head_dim, block_mask, features) if attn_impl != "sdpa" else None
    if attn_impl != "sdpa" and reason is None:
        return KERNEL, None
    if attn_impl == "flash":
        if device.type == "cuda":
            hint = ("attn_impl=reference" if features_unavailable_reason(features) else
                    "attn_impl=auto (PyTorch SDPA where the kernel cannot run) or sdpa")
            raise RuntimeError(f"attn_impl=flash cannot run flashtrain's CUDA kernel: {reason}. Use {hint}")
        return REFERENCE, None  # CPU tensors: the reference is flash's CPU path
    if "softcap" in features:
        raise ValueError(f"softcap: attn_impl={attn_impl} runs PyTorch SDPA here"
                         + (f" ({reason})" if reason else "") + ", which has no logit softcapping; use flash or "
                         "reference")
    return SDPA, reason


def check_backend(attn_impl: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                  block_mask: bool = False, features: tuple[str, ...] = ()) -> str:
    """Start-up check of a model's attention calls: raises when attn_impl=flash cannot run them on `device`; returns
    the run header's words for what runs them, e.g. "auto -> sdpa (the tensors are on cpu; ...)"."""
    chosen, reason = backend(attn_impl, torch.device(device), dtype, head_dim, block_mask, features)
    return f"{attn_impl} -> {chosen}" + (f" ({reason})" if attn_impl == "auto" and reason else "")


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype that attention inputs computed from `x` will have: the autocast dtype where autocast is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def runs_packed(attn_impl: str, x: Tensor, head_dim: int, block_mask: bool = False) -> bool:
    """Whether a model with padded inputs packs them (removes the padding) before attention: every backend but sdpa.
    x: the model's activations (their device and, under autocast, the compute dtype decide "auto")."""
    return backend(attn_impl, x.device, compute_dtype(x), head_dim, block_mask)[0] != SDPA


def attention(q: Tensor, k: Tensor, v: Tensor, attn_impl: str, *, causal: bool = False, dropout_p: float = 0.0,
              cu_seqlens: Tensor | None = None, max_seqlen: int | None = None, key_padding_mask: Tensor | None = None,
              block_mask: Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0) -> Tensor:
    """Self-attention of packed q, k, v (total, H, D) with cu_seqlens (B + 1,) int32 and max_seqlen, or of padded
    ones (B, T, H, D) with key_padding_mask (B, T) bool (True at real tokens; sdpa only) or None. Padded k, v may be
    longer than q (a KV cache: the queries are the last tokens; causal aligns to the bottom-right corner). block_mask: None or
    bool (ceil(T / 128),) * 2 (flashtrain.kernels.block_sparse layouts). window_size (left, right), softcap: as
    flash_attn_func's (sliding-window attention, logit softcapping; sdpa: the window as a mask, no softcap).
    -> the output in q's layout."""
    features = attention_features(window_size, softcap, causal)
    if (context := active_context()) is not None:  # parallel.context > 1: ring attention over the processes that share
        # each sequence (flashtrain.parallel.context); the run's device and compute dtype decide what computes it
        chosen, reason = backend(attn_impl, context.device, context.dtype, q.shape[-1])
        if chosen == SDPA:
            raise ValueError(f"parallel.context={context.size}: model.attn_impl={attn_impl} runs PyTorch SDPA here"
                             + (f" ({reason})" if reason else "") + "; ring attention merges flashtrain's attention "
                             "of each block of keys by its log-sum-exp: use model.attn_impl=flash or reference")
        return context.attention(q, k, v, impl="cuda" if chosen == KERNEL else "reference", causal=causal,
                                 dropout_p=dropout_p, cu_seqlens=cu_seqlens, key_padding_mask=key_padding_mask,
                                 block_mask=block_mask, features=features)
    chosen, _ = backend(attn_impl, q.device, q.dtype, q.shape[-1], block_mask is not None, features)
    options = {"window_size": tuple(window_size), "softcap": softcap} if features else {}
    if chosen != SDPA:
        impl = "cuda" if chosen == KERNEL else "reference"
        if key_padding_mask is not None:
            raise ValueError(f"key_padding_mask: attn_impl {attn_impl} runs packed inputs; pass cu_seqlens instead")
        # torch.use_deterministic_algorithms(True) (trainer.deterministic) selects the bitwise-reproducible backward
        deterministic = torch.are_deterministic_algorithms_enabled()
        if cu_seqlens is not None:
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                          causal=causal, block_mask=block_mask, deterministic=deterministic, impl=impl,
                                          **options)
        return flash_attn_func(q, k, v, dropout_p, causal=causal, block_mask=block_mask, deterministic=deterministic,
                               impl=impl, **options)
    if cu_seqlens is not None:
        raise ValueError(f"cu_seqlens: attn_impl {attn_impl} runs PyTorch SDPA here, on padded inputs; "
                         f"check runs_packed before packing")
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # (B, 1, 1, T): keys
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if causal and seqlen_q != seqlen_k:  # new queries after cached keys: SDPA's is_causal aligns top-left, ours not
        bottom_right = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        mask = bottom_right if mask is None else mask & bottom_right
        causal = False
    if "window_size" in features:  # keys j of query i: i + offset - left <= j <= i + offset + right (-1: unbounded)
        left, right = window_size
        offset = seqlen_k - seqlen_q
        rows = torch.arange(seqlen_q, device=q.device)[:, None] + offset
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        band = ((cols >= rows - left) | (left < 0)) & ((cols <= rows + right) | (right < 0))
        if causal:  # the bottom-right causal bound as a mask too (SDPA's is_causal aligns top-left)
            band &= cols <= rows
            causal = False
        mask = band if mask is None else mask & band
    if block_mask is not None:  # one bit per 128 x 128 block -> one per (query, key)
        T = q.shape[1]
        dense = block_mask.repeat_interleave(BLOCK_SPARSE_SIZE, -2).repeat_interleave(BLOCK_SPARSE_SIZE, -1)
        mask = dense[..., :T, :T] if mask is None else mask & dense[..., :T, :T]
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       dropout_p=dropout_p, is_causal=causal)  # (B, H, T, D)
    return y.transpose(1, 2)  # (B, T, H, D)


def attention_features(window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       causal: bool = False) -> tuple[str, ...]:
    """The names of the attention options beyond plain attention that a call sets (for backend checks); with causal
    a window's right bound is the diagonal already, so (-1, 0) sets none (flashtrain.kernels.interface's rule)."""
    left, right = window_size
    windowed = left >= 0 or (right >= 0 and not causal)
    return tuple(name for name, on in (("window_size", windowed), ("softcap", softcap != 0.0)) if on)


def check_padded(variant: str, cu_seqlens: Tensor | None, block_mask: Tensor | None) -> None:
    """For variants that take padded inputs only: a ValueError naming the argument they cannot take."""
    if cu_seqlens is not None:
        raise ValueError(f"cu_seqlens: {variant} attention takes padded inputs (B, T, H, D) with a key_padding_mask; "
                         f"its config's runs_packed is False")
    if block_mask is not None:
        raise ValueError(f"block_mask: {variant} attention takes no block mask")


class ExactAttention(nn.Module):
    """Softmax attention through `attention` with the model's attn_impl: dense, or block-sparse when a block_mask is
    passed. The inner module of the dense and block-sparse variants (and of BERT)."""

    def __init__(self, attn_impl: str):
        super().__init__()
        self.attn_impl = attn_impl

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, cu_seqlens: Tensor | None,
                max_seqlen: int | None, key_padding_mask: Tensor | None, block_mask: Tensor | None) -> Tensor:
        return attention(q, k, v, self.attn_impl, dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         key_padding_mask=key_padding_mask, block_mask=block_mask)


@dataclass
class AttentionConfig:
    """Base of the attention variants' configs (flashtrain/models/attention_variants/: one file per variant, its
    config a subclass of this). A variant builds the inner module of every attention layer and says how the model
    feeds it. The defaults describe a variant computed in plain PyTorch on padded inputs."""

    name: ClassVar[str]  # its Hydra schema is model/attention/<name>_schema

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        """The inner attention module of one layer (called once per layer: parameters are per layer). max_len: the
        longest sequence it will see (a model's position table)."""
        raise NotImplementedError

    def check_attn_impl(self, attn_impl: str) -> None:
        """For the model config's __post_init__: a ValueError when this variant cannot run with attn_impl."""

    def runs_packed(self, attn_impl: str, x: Tensor, head_dim: int) -> bool:
        """Whether the model packs padded inputs (removes the padding) before attention; else it passes them padded
        with a key-padding mask."""
        return False

    def block_mask(self, seqlen: int) -> Tensor | None:
        """The bool block mask (ceil(seqlen / 128),) * 2 that the inner modules take, on the CPU; None: none."""
        return None

    def backend(self, attn_impl: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        """Start-up check and the run header's words for what computes attention (raises as `check_backend`)."""
        return f"{self.name} (plain PyTorch)"

    def attention_flops_fraction(self, seqlen: int) -> float:
        """The share of softmax attention's seqlen x seqlen score matrix this variant computes, for the MFU's FLOPs
        (flashtrain.models.flops); 0: not softmax over pairs of tokens (its few matmuls are left out)."""
        return 0.0


@dataclass
class DenseAttentionConfig(AttentionConfig):
    """Exact softmax attention over every pair of real tokens (the default): `attention` with the model's attn_impl."""

    name: ClassVar[str] = "dense"

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        return ExactAttention(attn_impl)

    def runs_packed(self, attn_impl: str, x: Tensor, head_dim: int) -> bool:
        return runs_packed(attn_impl, x, head_dim)

    def backend(self, attn_impl: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
        return check_backend(attn_impl, device, dtype, head_dim)

    def attention_flops_fraction(self, seqlen: int) -> float:
        return 1.0


class BidirectionalSelfAttention(nn.Module):
    """Non-causal attention of the encoders (BERT/RoBERTa, LRA): a fused q|k|v projection (`qkv`), the inner attention
    module (`inner`: ExactAttention or a variant's) and an output projection (`out`)."""

    def __init__(self, d_model: int, n_head: int, inner: nn.Module, attn_dropout: float):
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # output columns [q | k | v]
        self.inner = inner
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None, max_seqlen: int, key_padding_mask: Tensor | None,
                block_mask: Tensor | None = None) -> Tensor:
        """Packed x (total, C) with cu_seqlens (B + 1,), or padded x (B, T, C) with cu_seqlens None and
        key_padding_mask (B, T) or None, as `attention` takes them."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).unbind(dim=-3)  # each (..., H, D)
        y = self.inner(q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, key_padding_mask=key_padding_mask, block_mask=block_mask)
        return self.out(y.flatten(-2, -1))  # (..., C)
