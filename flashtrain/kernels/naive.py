"""Standard attention that materialises softmax(Q K^T): the test oracle. Not for training (O(seqlen^2) memory).

Same features and conventions as flash_attn_func / flash_attn_varlen_func: bottom-right causal, GQA/MQA, varlen,
block_mask, window_size, softcap, ALiBi, an explicit dropout keep-mask, rows that see no key give out 0 and lse -inf. It computes in the dtype of its
inputs, so running it on float64 copies gives the oracle and on fp16/bf16 inputs gives the error that plain PyTorch
makes in low precision (FlashAttention-2's yardstick).
"""

import math

import torch
from torch import Tensor

from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE


def _attention_one(q, k, v, *, softmax_scale, causal, block_mask, dropout_p, dropout_mask, window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, mask_mod=None, b=0):
    """q (seqlen_q, nheads, D), k/v (seqlen_k, nheads_kv, D) -> out (seqlen_q, nheads, D), lse (nheads, seqlen_q).
    alibi_slopes: (nheads,) of this sequence."""
    seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv, _ = k.shape
    k = k.repeat_interleave(nheads // nheads_kv, dim=1)  # query head h uses kv head h // group
    v = v.repeat_interleave(nheads // nheads_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale  # (nheads, seqlen_q, seqlen_k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # key j minus the key aligned with query i (bottom-right): j - i - (seqlen_k - seqlen_q)
    distance = (torch.arange(seqlen_k, device=q.device)[None, :] - torch.arange(seqlen_q, device=q.device)[:, None]
                - (seqlen_k - seqlen_q))
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(scores.dtype)[:, None, None] * distance.abs().to(scores.dtype)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    left, right = window_size[0], 0 if causal else window_size[1]
    if right >= 0:  # causal (right = 0): query i sees key j iff j <= i + seqlen_k - seqlen_q
        visible &= distance <= right
    if left >= 0:
        visible &= distance >= -left
    if block_mask is not None:  # ([nheads,] n_qblocks, n_kblocks) -> per token, cropped to this sequence
        tokens = block_mask.repeat_interleave(BLOCK_SPARSE_SIZE, -2).repeat_interleave(BLOCK_SPARSE_SIZE, -1)
        visible = visible & tokens[..., :seqlen_q, :seqlen_k]
    if mask_mod is not None:  # (nheads, seqlen_q, seqlen_k) for sequence b
        visible = visible & mask_mod.evaluate(b, torch.arange(nheads, device=q.device).view(-1, 1, 1),
                                              torch.arange(seqlen_q, device=q.device).view(1, -1, 1),
                                              torch.arange(seqlen_k, device=q.device).view(1, 1, -1))
    # rows that see no key get finite dummy scores (no NaN in forward or backward), then probabilities 0, lse -inf
    row_sees_key = visible.any(-1, keepdim=True)  # ([nheads,] seqlen_q, 1)
    scores = scores.masked_fill(~visible, -math.inf).masked_fill(~row_sees_key, 0.0)
    lse = scores.logsumexp(-1).masked_fill(~row_sees_key.squeeze(-1), -math.inf)  # (nheads, seqlen_q)
    probs = torch.softmax(scores, dim=-1) * row_sees_key
    if dropout_p > 0:
        probs = probs * dropout_mask / (1 - dropout_p)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    mask_mod=None,
) -> tuple[Tensor, Tensor]:
    """Batch form: q (batch, seqlen_q, nheads, D), k/v (batch, seqlen_k, nheads_kv, D), dropout_mask
    (batch, nheads, seqlen_q, seqlen_k) -> out (batch, seqlen_q, nheads, D), lse (batch, nheads, seqlen_q).
    Varlen form (cu_seqlens given): q (total_q, nheads, D), k/v (total_k, nheads_kv, D), dropout_mask
    (nheads, total_q, max_seqlen_k) -> out (total_q, nheads, D), lse (nheads, total_q).
    dropout_p > 0 needs dropout_mask (True = keep). window_size, softcap, alibi_slopes ((nheads,) or
    (batch, nheads)) and mask_mod (a MaskMod) as in flash_attn_func. Differentiable; everything in the inputs' dtype."""
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("dropout_mask: naive_attention needs the explicit keep-mask when dropout_p > 0")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    options = dict(softmax_scale=softmax_scale, causal=causal, block_mask=block_mask, dropout_p=dropout_p,
                   window_size=window_size, softcap=softcap, mask_mod=mask_mod)
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    slopes = None if alibi_slopes is None else alibi_slopes.expand(batch, q.shape[-2])
    if cu_seqlens_q is None:
        outs, lses = zip(*[
            _attention_one(q[b], k[b], v[b], dropout_mask=None if dropout_mask is None else dropout_mask[b],
                           alibi_slopes=None if slopes is None else slopes[b], b=b, **options)
            for b in range(q.shape[0])
        ])
        return torch.stack(outs), torch.stack(lses)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        rows_q = slice(starts_q[b], starts_q[b + 1])
        rows_k = slice(starts_k[b], starts_k[b + 1])
        mask = None if dropout_mask is None else dropout_mask[:, rows_q, : rows_k.stop - rows_k.start]
        out, lse = _attention_one(q[rows_q], k[rows_k], v[rows_k], dropout_mask=mask,
                                  alibi_slopes=None if slopes is None else slopes[b], b=b, **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)
