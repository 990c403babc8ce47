"""Rotary position embeddings (RoPE, Su et al. 2021) and the ways to stretch them over a longer context.

RoPE rotates each query and key head: the pair (x[i], x[i + D/2]) of a token at position p turns by the angle
p * inv_freq[i], inv_freq[i] = theta ** (-2i / D) (the "rotate half" layout of Hugging Face's Llama, so its weights
load unchanged). A query-key score then depends on the two positions only through their difference.

A model pretrained on n tokens sees angles it never saw past n. `RopeScaling` (a model config's `rope_scaling`) changes
the frequencies, with transformers' definitions (`transformers.modeling_rope_utils`, whose ROPE_INIT_FUNCTIONS the
tests compare against):

    default  plain RoPE (factor 1)
    linear   position interpolation (Chen et al. 2023): every frequency divided by `factor`, so n * factor positions
             span the angles n did (transformers' "linear")
    ntk      NTK-aware scaling: theta -> theta * factor ** (D / (D - 2)); the highest frequency stays, the lowest is
             divided by `factor`. It is the static form of transformers' "dynamic" NTK, whose per-batch theta is this
             one once the batch is long enough for its scale to reach `factor` (transformers has no static type: an
             export writes the scaled theta)
    yarn     YaRN (Peng et al. 2023): frequencies whose wavelength fits original_max_position_embeddings many times
             (more than beta_fast rotations) kept, those that fit fewer than beta_slow times interpolated by `factor`,
             a linear ramp between; and an attention temperature: cos and sin multiplied by `attention_factor`
             (default 0.1 ln(factor) + 1, mscale), so every score is multiplied by its square (transformers' "yarn")
    llama3   Llama 3.1's: wavelengths longer than original / low_freq_factor interpolated by `factor`, shorter than
             original / high_freq_factor kept, smoothly between (transformers' "llama3")

transformers' "dynamic" (theta recomputed from each batch's longest position) and "longrope" are not here.
`rope_frequencies` computes inv_freq and the attention factor in float64; `rope_tables` the cos / sin tables a model
indexes by position; `apply_rope` rotates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

ROPE_TYPES = ("default", "linear", "ntk", "yarn", "llama3")


@dataclass
class RopeScaling:
    """How the rotary frequencies are stretched (a model config's `rope_scaling`; type default: not at all). The
    fields are transformers' `rope_parameters` of the same type."""

    type: str = "default"  # default (plain RoPE) | linear | ntk | yarn | llama3 (the module's docstring)
    factor: float = 1.0  # how many times longer the context is meant to be than the one pretrained (default: 1)
    # the context the model was pretrained on, in tokens; needed by yarn and llama3 (where the ramp sits)
    original_max_position_embeddings: Optional[int] = None
    attention_factor: Optional[float] = None  # yarn: cos / sin scale; null: from factor (and mscale, mscale_all_dim)
    beta_fast: float = 32.0  # yarn: dimensions turning more than beta_fast times over the original context are kept
    beta_slow: float = 1.0  # yarn: dimensions turning fewer than beta_slow times are interpolated by factor
    mscale: Optional[float] = None  # yarn (DeepSeek's form): with mscale_all_dim, attention_factor's numerator's scale
    mscale_all_dim: Optional[float] = None  # yarn: with mscale, attention_factor's denominator's scale
    truncate: bool = True  # yarn: round the ramp's bounds to whole dimensions (floor / ceil)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are interpolated
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor are kept

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.type must be one of {ROPE_TYPES}, got {self.type!r}")
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"rope_scaling.factor must be >= 1 (the context's growth), got {self.factor}")
        if self.type == "default" and self.factor != 1.0:
            raise ValueError(f"rope_scaling.factor={self.factor} with rope_scaling.type=default (plain RoPE, factor "
                             f"1): set the type ({', '.join(ROPE_TYPES[1:])})")
        original = self.original_max_position_embeddings
        if self.type in ("yarn", "llama3") and original is None:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be set for type {self.type} "
                             f"(the pretrained context, in tokens)")
        if original is not None and original < 1:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be >= 1, got {original}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"rope_scaling.attention_factor must be > 0 (or null), got {self.attention_factor}")
        if not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(f"rope_scaling.beta_fast ({self.beta_fast}) must exceed rope_scaling.beta_slow "
                             f"({self.beta_slow}), which must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                             f"rope_scaling.low_freq_factor ({self.low_freq_factor}), which must be > 0")

    def describe(self) -> str:
        """A few words for notes and messages: "yarn x4 from 2048 tokens"."""
        original = self.original_max_position_embeddings
        return f"{self.type} x{self.factor:g}" + (f" from {original} tokens" if original is not None else "")


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[Tensor, float]:
    """(inv_freq (head_dim / 2,) float64, attention factor) of RoPE with base `theta` and `scaling` (None or type
    default: plain RoPE, factor 1.0): the angle of dimension pair i at position p is p * inv_freq[i]; the factor
    multiplies cos and sin (YaRN's temperature; 1.0 for the other types)."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and >= 2 for RoPE, got {head_dim}")
    if not theta > 0:
        raise ValueError(f"theta must be > 0, got {theta}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # (D / 2,): 2i / D
    if scaling is None or scaling.type == "default":
        return theta ** -exponents, 1.0
    factor = scaling.factor
    if scaling.type == "linear":
        return theta ** -exponents / factor, 1.0
    if scaling.type == "ntk":
        return ntk_theta(theta, factor, head_dim) ** -exponents, 1.0
    if scaling.type == "yarn":
        return _yarn(head_dim, theta, scaling, exponents)
    return _llama3(theta, scaling, exponents), 1.0


def ntk_theta(theta: float, factor: float, head_dim: int) -> float:
    """NTK-aware scaling's base: the lowest frequency divided by `factor`, the highest kept."""
    return theta * factor ** (head_dim / (head_dim - 2))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, scaling: RopeScaling, exponents: Tensor) -> tuple[Tensor, float]:
    """YaRN's frequencies and attention factor, transformers' `_compute_yarn_parameters` in float64."""
    factor, original = scaling.factor, scaling.original_max_position_embeddings
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim) \
            if scaling.mscale and scaling.mscale_all_dim else _yarn_mscale(factor)

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: scale
    extrapolated = theta ** -exponents
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), float(attention_factor)


def _llama3(theta: float, scaling: RopeScaling, exponents: Tensor) -> Tensor:
    """Llama 3.1's frequencies, transformers' `_compute_llama3_parameters` in float64."""
    inv_freq = theta ** -exponents
    original, factor = scaling.original_max_position_embeddings, scaling.factor
    wavelength = 2 * math.pi / inv_freq
    # between the two wavelengths: a blend, from interpolated (smooth 0) to kept (smooth 1)
    smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / scaling.low_freq_factor, inv_freq / factor, inv_freq)
    medium = (wavelength >= original / scaling.high_freq_factor) & (wavelength <= original / scaling.low_freq_factor)
    return torch.where(medium, blended, scaled)


def rope_tables(n_positions: int, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (n_positions, head_dim / 2) float64: row p holds cos / sin of p * inv_freq, times the
    attention factor (`rope_frequencies`)."""
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling)
    angles = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv_freq  # (n_positions, D / 2)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., T, H, D) rotated by the angles whose cos / sin are (..., T, D / 2) (rows of `rope_tables` at the
    tokens' positions), in float32 at least (as the tables come in float64), returned in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    first, second = x.to(dtype).chunk(2, dim=-1)  # each (..., T, H, D / 2): the pairs (x[i], x[i + D / 2])
    cos, sin = cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)  # (..., T, 1, D / 2): every head alike
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
