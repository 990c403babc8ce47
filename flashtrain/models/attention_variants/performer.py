"""Performer's FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers"): softmax attention
approximated with positive orthogonal random features, in time and memory linear in the sequence length.

With x' = x / D^(1/4) (so that q' . k' = q . k / sqrt(D)) and m random directions w_1..w_m (rows of W, (m, D)),

    phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m)        (m,), positive; E[phi(q) . phi(k)] = exp(q . k / sqrt(D))
    out_i  = sum_j phi(q_i) . phi(k_j) v_j / sum_j phi(q_i) . phi(k_j)
           = phi(q_i) (phi(K)^T V) / phi(q_i) (phi(K)^T 1)     -- no (N, N) matrix

W is drawn once per layer (a buffer, saved with the weights): blocks of D orthonormal rows (QR of a Gaussian
matrix), each row rescaled to the norm of an independent Gaussian D-vector, so every row is marginally N(0, I) and
the rows of a block are exactly orthogonal (the "orthogonal" of FAVOR+, which lowers the estimator's variance).
Computed in float32 (float64 inputs: float64); exp is stabilised by a factor per query (its largest logit) and one
per (sequence, head) for the keys (their largest logit), both of which cancel in the ratio. Pad keys get phi = 0.
There is no attention matrix, so there is nothing for attention dropout to drop: dropout_p is not applied.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from torch import Tensor

from flashtrain.models.attention import AttentionConfig, check_padded


@dataclass
class PerformerConfig(AttentionConfig):
    name: ClassVar[str] = "performer"
    num_features: int = 256  # m, random features per head

    def __post_init__(self):
        if self.num_features < 1:
            raise ValueError(f"attention.num_features must be >= 1, got {self.num_features}")

    def build(self, *, d_model: int, n_head: int, max_len: int, attn_impl: str) -> nn.Module:
        return Performer(d_model // n_head, self.num_features)


def orthogonal_gaussian(num_rows: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """(num_rows, dim) float32: stacked blocks of dim orthonormal rows (the last block cut), each row scaled to the
    norm of its own Gaussian dim-vector (chi with dim degrees of freedom), as an i.i.d. N(0, I) row's norm."""
    gaussian = torch.randn(math.ceil(num_rows / dim), dim, dim, generator=generator, dtype=torch.float64)
    orthonormal, triangular = torch.linalg.qr(gaussian)  # (blocks, dim, dim), columns orthonormal
    # signs fixed by R's diagonal: then each rotation is uniformly (Haar) distributed; without it the estimator is
    # biased (QR's own sign convention prefers some directions)
    orthonormal = orthonormal * torch.sign(torch.diagonal(triangular, dim1=-2, dim2=-1))[:, None, :]
    rows = orthonormal.transpose(1, 2).flatten(0, 1)[:num_rows]  # (num_rows, dim), unit rows
    norms = torch.randn(num_rows, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (rows * norms).float()


def feature_logits(x: Tensor, projection: Tensor) -> Tensor:
    """x (B, T, H, D), already scaled by D^(-1/4); projection W (m, D) -> W x - |x|^2 / 2 (B, T, H, m):
    phi(x) = exp(these) / sqrt(m)."""
    return torch.einsum("bthd,md->bthm", x, projection) - x.square().sum(-1, keepdim=True) / 2


class Performer(nn.Module):
    def __init__(self, head_dim: int, num_features: int):
        super().__init__()
        self.register_buffer("projection", orthogonal_gaussian(num_features, head_dim))  # W: (m, D)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, cu_seqlens: Tensor | None,
                max_seqlen: int | None, key_padding_mask: Tensor | None, block_mask: Tensor | None) -> Tensor:
        """Padded q, k, v (B, T, H, D), key_padding_mask (B, T) (True at real tokens) or None -> (B, T, H, D)."""
        check_padded("performer", cu_seqlens, block_mask)
        dtype = torch.promote_types(q.dtype, torch.float32)  # at least float32 throughout: exp of the logits
        with torch.autocast(q.device.type, enabled=False):
            scale, projection = q.shape[-1] ** -0.25, self.projection.to(dtype)
            q_logits = feature_logits(q.to(dtype) * scale, projection)  # (B, T, H, m)
            k_logits = feature_logits(k.to(dtype) * scale, projection)
            if key_padding_mask is not None:
                k_logits = k_logits.masked_fill(~key_padding_mask[:, :, None, None], -math.inf)  # phi(pad key) = 0
            # constant factors cancel in the ratio: 1 / sqrt(m), exp(-max) per query, exp(-max) per sequence and head
            phi_q = torch.exp(q_logits - q_logits.amax(dim=-1, keepdim=True).detach())
            phi_k = torch.exp(k_logits - k_logits.amax(dim=(1, 3), keepdim=True).detach())  # max over (T, m)
            kv = torch.einsum("bthm,bthd->bhmd", phi_k, v.to(dtype))  # phi(K)^T V per sequence and head: (B, H, m, D)
            numerator = torch.einsum("bthm,bhmd->bthd", phi_q, kv)
            denominator = torch.einsum("bthm,bhm->bth", phi_q, phi_k.sum(dim=1))  # phi(q) . sum_j phi(k_j)
            out = numerator / denominator.clamp_min(torch.finfo(dtype).tiny)[..., None]
        return out.to(q.dtype)
