"""RoPE and its context extensions (flashtrain.models.rope) against transformers' own definitions: for each scaling,
the inverse frequencies and the attention factor of transformers' ROPE_INIT_FUNCTIONS for the same rope_type, within
1e-6 relative (ours are float64, transformers' float32: its rounding is ~1e-7); the rotation itself against a complex
multiplication, and the property RoPE exists for (scores depend on the distance between positions only)."""

import copy
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from flashtrain.models.rope import RopeScaling, apply_rope, ntk_theta, rope_frequencies, rope_tables

FREQ_RTOL = 1e-6  # float32 frequencies (transformers) against float64 (ours)


def hf_config(rope_parameters: dict, head_dim: int, max_position_embeddings: int):
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=max_position_embeddings,
                                    rope_parameters=copy.deepcopy(rope_parameters))


def assert_frequencies_equal(ours: tuple[torch.Tensor, float], theirs: tuple[torch.Tensor, float]) -> None:
    (inv_freq, factor), (hf_inv_freq, hf_factor) = ours, theirs
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == hf_inv_freq.shape
    assert ((inv_freq - hf_inv_freq.double()).abs() / inv_freq).max().item() <= FREQ_RTOL
    assert factor == pytest.approx(hf_factor, rel=FREQ_RTOL, abs=0)


@pytest.mark.parametrize("head_dim, theta", [(64, 10000.0), (128, 500000.0), (48, 1e6)])
def test_plain_rope_is_transformers_default(head_dim, theta):
    config = hf_config({"rope_type": "default", "rope_theta": theta}, head_dim, 64)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    assert_frequencies_equal(rope_frequencies(head_dim, theta), theirs)
    assert_frequencies_equal(rope_frequencies(head_dim, theta, RopeScaling()), theirs)  # type default


@pytest.mark.parametrize("factor", [1.0, 2.0, 8.0])
def test_linear_is_transformers_linear(factor):
    rope = {"rope_type": "linear", "factor": factor, "rope_theta": 10000.0}
    theirs = ROPE_INIT_FUNCTIONS["linear"](hf_config(rope, 64, 256))
    assert_frequencies_equal(rope_frequencies(64, 10000.0, RopeScaling("linear", factor)), theirs)


@pytest.mark.parametrize("factor, hf_factor", [(4.0, 1.0), (4.0, 2.0), (2.5, 3.0), (16.0, 8.0)])
def test_ntk_is_transformers_dynamic_where_its_scale_reaches_the_factor(factor, hf_factor):
    """transformers' dynamic NTK at sequence length s over max_position_embeddings L scales theta by
    (hf_factor * s / L - (hf_factor - 1)) ** (D / (D - 2)); at s = L * (1 + (factor - 1) / hf_factor) that is our
    static NTK of `factor` (hf_factor 1: s = factor * L, the extended length)."""
    original, head_dim = 64, 96
    seq_len = original * (1 + (factor - 1) / hf_factor)
    assert seq_len == int(seq_len)
    config = hf_config({"rope_type": "dynamic", "factor": hf_factor, "rope_theta": 10000.0}, head_dim, original)
    theirs = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=int(seq_len))
    assert_frequencies_equal(rope_frequencies(head_dim, 10000.0, RopeScaling("ntk", factor)), theirs)
    # the highest frequency is kept and the lowest divided by the factor: NTK-aware scaling's definition
    inv_freq, plain = rope_frequencies(head_dim, 10000.0, RopeScaling("ntk", factor))[0], rope_frequencies(
        head_dim, 10000.0)[0]
    assert inv_freq[0].item() == 1.0
    assert (inv_freq[-1] * factor).item() == pytest.approx(plain[-1].item(), rel=1e-12)
    assert ntk_theta(10000.0, factor, head_dim) == pytest.approx(10000.0 * factor ** (head_dim / (head_dim - 2)))


YARN_CASES = {
    "paper defaults": dict(factor=4.0),
    "attention_factor set": dict(factor=8.0, attention_factor=1.3),
    "DeepSeek mscale": dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0),
    "mscale ratio": dict(factor=16.0, mscale=1.0, mscale_all_dim=0.5),
    "no truncation": dict(factor=4.0, truncate=False, beta_fast=16.0, beta_slow=2.0),
    "factor 1": dict(factor=1.0),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
@pytest.mark.parametrize("head_dim, original, theta", [(64, 2048, 10000.0), (128, 4096, 500000.0)])
def test_yarn_is_transformers_yarn(case, head_dim, original, theta):
    fields = YARN_CASES[case]
    rope = {"rope_type": "yarn", "rope_theta": theta, "original_max_position_embeddings": original, **fields}
    theirs = ROPE_INIT_FUNCTIONS["yarn"](hf_config(rope, head_dim, int(original * fields["factor"])))
    ours = rope_frequencies(head_dim, theta, RopeScaling("yarn", original_max_position_embeddings=original, **fields))
    assert_frequencies_equal(ours, theirs)
    if case == "paper defaults":  # the temperature: sqrt(1 / t) = 0.1 ln(s) + 1
        assert ours[1] == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)


@pytest.mark.parametrize("fields", [dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
                                    dict(factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0)])
def test_llama3_is_transformers_llama3(fields):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "original_max_position_embeddings": 8192, **fields}
    theirs = ROPE_INIT_FUNCTIONS["llama3"](hf_config(rope, 128, 131072))
    ours = rope_frequencies(128, 500000.0, RopeScaling("llama3", original_max_position_embeddings=8192, **fields))
    assert_frequencies_equal(ours, theirs)


def test_rotation_is_the_complex_product_and_scores_depend_on_distance_only():
    """apply_rope turns each pair (x[i], x[i + D/2]) as the complex number x[i] + j x[i + D/2] times e^(j angle);
    shifting every position by 37 leaves q . k unchanged (to float64 rounding)."""
    torch.manual_seed(0)
    head_dim, n = 10, 64
    cos, sin = rope_tables(n + 37, head_dim, theta=100.0)
    q, k = torch.randn(2, 5, 3, head_dim, dtype=torch.float64), torch.randn(2, 5, 3, head_dim, dtype=torch.float64)
    positions = torch.tensor([[0, 3, 4, 9, 20], [7, 7, 1, 30, 63]])  # (B, T): any positions, repeats included
    rotated = apply_rope(q, cos[positions], sin[positions])
    angles = positions[..., None, None] * rope_frequencies(head_dim, 100.0)[0]  # (B, T, 1, D / 2)
    as_complex = torch.complex(q[..., :head_dim // 2], q[..., head_dim // 2:]) * torch.exp(1j * angles)
    assert torch.allclose(rotated, torch.cat([as_complex.real, as_complex.imag], dim=-1), rtol=0, atol=1e-12)

    def scores(shift):
        q_rot = apply_rope(q, cos[positions + shift], sin[positions + shift])
        k_rot = apply_rope(k, cos[positions.flip(1) + shift], sin[positions.flip(1) + shift])
        return torch.einsum("bthd,bshd->bhts", q_rot, k_rot)

    assert torch.allclose(scores(37), scores(0), rtol=0, atol=1e-12)
    assert (scores(0) - torch.einsum("bthd,bshd->bhts", q, k)).abs().max() > 0.1  # the rotation does something


def test_rotation_runs_in_float32_at_least_and_keeps_the_dtype():
    cos, sin = rope_tables(16, 8, theta=10000.0)
    x = torch.randn(1, 16, 2, 8, dtype=torch.bfloat16)
    exact = apply_rope(x.double(), cos, sin)
    rotated = apply_rope(x, cos, sin)
    assert rotated.dtype == torch.bfloat16
    # one bf16 rounding of the result (2^-8 relative), not one per product
    assert ((rotated.double() - exact).abs() / exact.abs().clamp(min=1e-3)).max() <= 2 ** -8


def test_yarn_tables_carry_the_attention_factor():
    scaling = RopeScaling("yarn", 4.0, original_max_position_embeddings=32)
    cos, sin = rope_tables(128, 16, 10000.0, scaling)
    factor = rope_frequencies(16, 10000.0, scaling)[1]
    assert torch.allclose(cos ** 2 + sin ** 2, torch.full_like(cos, factor ** 2), rtol=1e-12, atol=0)


@pytest.mark.parametrize("fields, named", [
    (dict(type="dynamic", factor=2.0), "rope_scaling.type"),
    (dict(type="linear", factor=0.5), "rope_scaling.factor"),
    (dict(type="default", factor=2.0), "rope_scaling.factor"),
    (dict(type="yarn", factor=4.0), "rope_scaling.original_max_position_embeddings"),
    (dict(type="llama3", factor=4.0), "rope_scaling.original_max_position_embeddings"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=0), "original_max_position_embeddings"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=0.0), "attention_factor"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=1.0, beta_slow=2.0), "beta_fast"),
    (dict(type="llama3", factor=4.0, original_max_position_embeddings=64, high_freq_factor=0.5), "high_freq_factor"),
])
def test_bad_scaling_names_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        RopeScaling(**fields)


def test_bad_head_dim_or_theta_names_the_argument():
    with pytest.raises(ValueError, match="head_dim"):
        rope_frequencies(7, 10000.0)
    with pytest.raises(ValueError, match="theta"):
        rope_frequencies(8, 0.0)
