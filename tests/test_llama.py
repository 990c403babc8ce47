"""The Llama-style decoder (flashtrain.models.llama): against a float64 reference of its own definition written out
here, against transformers' LlamaForCausalLM / MinistralForCausalLM both ways, the KV cache, the loss options, the
context extension and the Hugging Face start (init_from=hf:); a run through launch.py, its export and a longer start
from its checkpoint (slow); and attn_implementation="ft_attention" with transformers' sliding windows and softcapping
(tiny Mistral and Gemma 2 models)."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from flashtrain.models.hf_convert import (from_pretrained_hf, llama_config_from_hf, llama_config_to_hf,
                                          to_hf_state_dict)
from flashtrain.models.llama import Llama, LlamaConfig
from flashtrain.models.rope import RopeScaling, rope_frequencies

ATTN_IMPLS = ["reference", "sdpa", "flash"]  # flash on CPU tensors runs the reference
# 6 query heads of 16 on 2 key/value heads (GQA 3:1), an awkward vocabulary (padded to 128 for the head)
TINY = dict(vocab_size=97, n_positions=64, n_embd=96, n_layer=3, n_head=6, n_kv_head=2, intermediate_size=80)
# float64 against the float64 reference: only summation order differs
F64_ATOL = 1e-10
# float32 against the float64 reference (logits O(1), 3 layers): float32 rounding, ~1e-6
F32_ATOL = 2e-5


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Random norm weights too, so a norm weight applied in the wrong place shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def tiny_model(dtype=torch.float64, seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**(TINY | overrides))).to(dtype)
    perturb_(model, seed + 1)
    return model


def random_ids(batch: int, seqlen: int, seed: int = 2, vocab: int = TINY["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


# ---- the reference: the definition written out, float64 --------------------------------------------------------

def rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, inv_freq, attention_factor):
    """x (B, T, H, D): pair (x[i], x[i + D/2]) as a complex number times attention_factor * e^(j p inv_freq[i])."""
    half = x.shape[-1] // 2
    turn = attention_factor * torch.exp(1j * positions[..., None, None].double() * inv_freq)  # (B, T, 1, D / 2)
    z = torch.complex(x[..., :half], x[..., half:]) * turn
    return torch.cat([z.real, z.imag], dim=-1)


def reference_logits(model: Llama, input_ids, positions=None, documents=None):
    """The model's function from its parameters (differentiable): RMSNorm, RoPE as a complex product, every key and
    value head repeated for its query heads, softmax over the keys a query may see (causal, its layer's window, its
    document: `documents` (B, T) ids), SwiGLU, the head."""
    c = model.config
    p = dict(model.named_parameters())
    B, T = input_ids.shape
    H, H_kv, D = c.n_head, c.n_kv_head, c.head_dim
    positions = torch.arange(T).expand(B, T) if positions is None else positions
    inv_freq, attention_factor = rope_frequencies(D, c.rope_theta, c.rope_scaling)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    same_document = torch.ones(B, T, T, dtype=torch.bool) if documents is None else \
        documents[:, :, None] == documents[:, None, :]
    x = p["model.embed_tokens.weight"][input_ids]
    for layer, window in enumerate(c.layer_windows()):
        prefix = f"model.layers.{layer}."
        visible = (j <= i) & ((i - j <= window) | (window < 0)) & same_document  # (B, T, T)
        h = rms_norm(x, p[prefix + "input_layernorm.weight"], c.norm_eps)
        q = rotate((h @ p[prefix + "self_attn.q_proj.weight"].T).view(B, T, H, D), positions, inv_freq,
                   attention_factor)
        k = rotate((h @ p[prefix + "self_attn.k_proj.weight"].T).view(B, T, H_kv, D), positions, inv_freq,
                   attention_factor)
        v = (h @ p[prefix + "self_attn.v_proj.weight"].T).view(B, T, H_kv, D)
        k, v = k.repeat_interleave(H // H_kv, dim=2), v.repeat_interleave(H // H_kv, dim=2)  # (B, T, H, D)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
        weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhts,bshd->bthd", weights, v).reshape(B, T, H * D)
        x = x + out @ p[prefix + "self_attn.o_proj.weight"].T
        h = rms_norm(x, p[prefix + "post_attention_layernorm.weight"], c.norm_eps)
        gate, up = h @ p[prefix + "mlp.gate_proj.weight"].T, h @ p[prefix + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ p[prefix + "mlp.down_proj.weight"].T
    head = p["model.embed_tokens.weight"] if c.tie_embeddings else p["lm_head.weight"]
    return rms_norm(x, p["model.norm.weight"], c.norm_eps) @ head.T


def shifted_targets(input_ids):
    return torch.cat([input_ids[:, 1:], torch.full((input_ids.shape[0], 1), -100)], dim=1)


def assert_loss_and_grads_match(model, loss, expected_logits, targets, **inputs):
    """The model's loss (float32: its cross-entropy runs in float32) against the reference's, and the gradients of a
    float64 cross-entropy of the model's logits (without targets they are differentiable) against the reference's,
    every parameter, within 1e-9."""
    reference_loss = F.cross_entropy(expected_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(reference_loss.item(), rel=1e-6)
    logits = model(inputs.pop("input_ids"), **inputs)[0]
    params = [param for _, param in model.named_parameters()]
    ours = torch.autograd.grad(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100), params)
    theirs = torch.autograd.grad(reference_loss, params)
    for (name, _), got, want in zip(model.named_parameters(), ours, theirs):
        assert (got - want).abs().max().item() <= 1e-9, name


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
@pytest.mark.parametrize("variant", ["plain", "windows and yarn", "untied, MHA, ntk"])
def test_logits_loss_and_gradients_equal_the_reference(attn_impl, variant):
    overrides = {"plain": {},
                 "windows and yarn": dict(attn_window=5, global_every=3, rope_theta=500.0,
                                          rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16)),
                 "untied, MHA, ntk": dict(n_kv_head=6, tie_embeddings=False, norm_eps=1e-2,
                                          rope_scaling=RopeScaling("ntk", 3.0))}[variant]
    model = tiny_model(attn_impl=attn_impl, **overrides)
    input_ids = random_ids(2, 33)
    targets = shifted_targets(input_ids)
    logits, loss = model(input_ids, targets)
    expected = reference_logits(model, input_ids)
    assert logits.shape == (2, 33, TINY["vocab_size"])
    assert (logits - expected).abs().max().item() <= F64_ATOL
    assert_loss_and_grads_match(model, loss, expected, targets, input_ids=input_ids)


def test_float32_model_is_the_float64_reference_within_float32_rounding():
    exact = tiny_model(torch.float64, attn_window=9)
    model = copy.deepcopy(exact).float()  # the same weights, rounded to float32; the RoPE tables too
    input_ids = random_ids(2, 64)
    with torch.no_grad():
        logits = model(input_ids)[0]
        expected = reference_logits(exact, input_ids)
    assert 0 < (logits.double() - expected).abs().max().item() <= F32_ATOL


@pytest.mark.parametrize("attn_impl", ["reference", "flash"])
def test_documents_and_positions_from_the_batch(attn_impl):
    """cu_seqlens (documents packed in the B * T tokens) keeps attention inside each document; position_ids (B, T)
    are the tokens' positions, whatever they are (reset per document, or a context-parallel rank's share)."""
    from flashtrain.data.lm import document_offsets

    eos = 0
    input_ids = random_ids(2, 40, seed=5)
    input_ids[input_ids == eos] = 1
    input_ids[0, [6, 7, 19]] = eos  # a one-token document too
    input_ids[1, 30] = eos
    cu_seqlens, reset_positions = document_offsets(input_ids, eos)
    documents = torch.zeros(80, dtype=torch.long)
    documents[cu_seqlens[1:-1].long()] = 1
    documents = documents.cumsum(0).view(2, 40)
    model = tiny_model(attn_impl=attn_impl, attn_window=11, window_layers=[0, 2])
    targets = shifted_targets(input_ids)
    logits, loss = model(input_ids, targets, cu_seqlens=cu_seqlens, position_ids=reset_positions)
    expected = reference_logits(model, input_ids, reset_positions, documents)
    assert (logits - expected).abs().max().item() <= F64_ATOL
    assert_loss_and_grads_match(model, loss, expected, targets, input_ids=input_ids, cu_seqlens=cu_seqlens,
                                position_ids=reset_positions)
    # RoPE is relative: inside documents, reset positions give what block positions give
    assert (model(input_ids, cu_seqlens=cu_seqlens)[0] - logits).abs().max().item() <= F64_ATOL
    # non-contiguous positions, as a context-parallel rank holds them (zigzag: two chunks of a longer sequence)
    zigzag = torch.cat([torch.arange(0, 20), torch.arange(44, 64)]).expand(2, 40)
    assert (model(input_ids, position_ids=zigzag)[0] - reference_logits(model, input_ids, zigzag)).abs().max() \
        <= F64_ATOL


def test_sdpa_refuses_documents_at_the_data_check():
    from flashtrain.data.task import DataSpec

    spec = DataSpec("causal_lm", 97, 64, "data.seq_len", document_mask=True)
    LlamaConfig(**TINY).check_data(spec)  # flash: fine
    with pytest.raises(ValueError, match="document_mask.*attn_impl=sdpa"):
        LlamaConfig(**TINY, attn_impl="sdpa").check_data(spec)
    with pytest.raises(ValueError, match="model.vocab_size=97"):
        LlamaConfig(**TINY).check_data(DataSpec("causal_lm", 98, 64, "data.seq_len"))
    with pytest.raises(ValueError, match="data.seq_len=65 is longer than model.n_positions=64"):
        LlamaConfig(**TINY).check_data(DataSpec("causal_lm", 97, 65, "data.seq_len"))
    with pytest.raises(ValueError, match="causal_lm data"):
        LlamaConfig(**TINY).check_data(DataSpec("classification", 97, 64, "data.max_length"))


# ---- generation -------------------------------------------------------------------------------------------------

def test_cached_forward_equals_the_full_forward():
    """The prompt, then one token at a time and then a chunk of 3 against the cache (GQA keys stored rotated, a
    sliding window on two of three layers): every step's logits are the full forward's at those positions."""
    model = tiny_model(attn_impl="flash", attn_window=4, global_every=3)
    input_ids = random_ids(2, 20)
    full = model(input_ids)[0]
    cache = model.new_cache(2)
    assert cache.keys.shape == (3, 2, 64, 2, 16)
    steps = [model(input_ids[:, :10], cache=cache)[0]]
    steps += [model(input_ids[:, t:t + 1], cache=cache)[0] for t in range(10, 17)]
    steps.append(model(input_ids[:, 17:], cache=cache)[0])
    assert cache.length == 20
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= F64_ATOL


@pytest.mark.parametrize("attn_impl", ["sdpa", "flash"])
def test_generate_with_the_cache_equals_recomputing_and_crops_the_context(attn_impl):
    model = tiny_model(torch.float32, attn_impl=attn_impl, attn_window=6).eval()
    prompt = random_ids(2, 58)  # 58 + 10 > n_positions = 64: the context is cropped, the cache refilled
    cached = model.generate(prompt, 10, temperature=0.0)
    assert cached.shape == (2, 68) and torch.equal(cached[:, :58], prompt)
    assert torch.equal(cached, model.generate(prompt, 10, temperature=0.0, use_cache=False))
    expected = prompt
    with torch.no_grad():
        for _ in range(10):
            logits = model(expected[:, -64:])[0]
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, expected)
    sampled = [model.generate(prompt[:, :5], 8, temperature=0.8, top_k=20,
                              generator=torch.Generator().manual_seed(seed)) for seed in (3, 3, 4)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])


# ---- the head: padded vocabulary, chunked loss ------------------------------------------------------------------

def test_padded_vocabulary_and_chunked_loss_keep_values_and_gradients():
    model = tiny_model(torch.float64, vocab_size=300, vocab_multiple=1, tie_embeddings=False)
    input_ids, targets = random_ids(2, 24, vocab=300), random_ids(2, 24, seed=3, vocab=300)
    targets[0, :4] = -100
    logits, loss = model(input_ids, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.config.vocab_multiple = 128  # 300 -> 384 columns in the head's matmuls
    padded, padded_loss = model(input_ids, targets)
    assert padded.shape == (2, 24, 300) and not padded.requires_grad  # a slice: detached, the loss trains
    assert (padded - logits).abs().max().item() <= 1e-12 and abs(padded_loss.item() - loss.item()) <= 1e-12
    for got, want in zip(torch.autograd.grad(padded_loss, list(model.parameters())), grads):
        assert (got - want).abs().max().item() <= 1e-12
    model.config.chunked_loss = True
    none, chunked = model(input_ids, targets)
    assert none is None and chunked.item() == pytest.approx(loss.item(), rel=1e-6)  # float32 loss
    for got, want in zip(torch.autograd.grad(chunked, list(model.parameters())), grads):
        assert (got - want).abs().max().item() <= 1e-6


# ---- Hugging Face: transformers' Llama / Ministral both ways ---------------------------------------------------------

def hf_llama(dtype=torch.float32, **overrides):
    fields = dict(vocab_size=97, hidden_size=96, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=0) | overrides
    model_type = fields.pop("model_type", "llama")
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "ministral": transformers.MinistralConfig}[model_type]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**fields), attn_implementation="eager")
    model = model.to(dtype).eval()
    perturb_(model, seed=1)
    return model


HF_CASES = {
    "llama": dict(),
    "llama untied, yarn": dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1000.0}),
    "llama linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama3 rope": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 500000.0}),
    "mistral window": dict(model_type="mistral", sliding_window=7),
    "ministral mixed windows": dict(model_type="ministral", sliding_window=5,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_and_loss_equal_transformers(case):
    """float32 logits within 1e-4 (transformers computes RoPE angles in float32, we in float64, then both round)."""
    hf_model = hf_llama(**HF_CASES[case])
    model = from_pretrained_hf(Llama, hf_model, attn_impl="flash").eval()
    assert model.model.embed_tokens.weight.dtype == torch.float32
    input_ids = random_ids(3, 50)
    with torch.no_grad():
        hf_out = hf_model(input_ids, labels=input_ids)
        logits, loss = model(input_ids, shifted_targets(input_ids))
    assert 0 < (logits - hf_out.logits).abs().max().item() <= 1e-4
    assert abs(loss.item() - hf_out.loss.item()) <= 1e-5


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_config_round_trip_and_export_loads_strictly(case):
    hf_model = hf_llama(torch.float64, **HF_CASES[case])
    config = llama_config_from_hf(hf_model.config)
    back = llama_config_to_hf(config, eos_token_id=0)
    assert llama_config_from_hf(back) == config
    assert type(back).__name__ == ("LlamaConfig" if config.attn_window < 0 else "MinistralConfig")
    assert hf_model.config.rope_parameters.items() <= back.rope_parameters.items()  # defaults (beta_fast ...) written
    if case == "ministral mixed windows":
        assert (config.attn_window, config.window_layers) == (4, [0, 2])  # 5 tokens: the query and 4 before it
        assert back.layer_types == hf_model.config.layer_types
    model = from_pretrained_hf(Llama, hf_model, attn_impl="sdpa").eval()
    exported = transformers.AutoModelForCausalLM.from_config(back, attn_implementation="eager").double().eval()
    exported.load_state_dict(to_hf_state_dict(model), strict=True)
    input_ids = random_ids(2, 40)
    with torch.no_grad():
        assert (exported(input_ids).logits - hf_model(input_ids).logits).abs().max().item() <= 1e-12


def test_ours_to_transformers_with_every_option():
    """A flashtrain model of each option transformers has: its export gives our logits, in float64 (HF's float32
    RoPE frequencies: ~1e-7)."""
    cases = [dict(), dict(tie_embeddings=False, rope_scaling=RopeScaling("llama3", 4.0, 16)),
             dict(attn_window=3, global_every=2, rope_scaling=RopeScaling("yarn", 2.0, 32, beta_fast=8.0)),
             dict(rope_scaling=RopeScaling("ntk", 4.0))]  # ntk: transformers' plain RoPE of the scaled theta
    for overrides in cases:
        model = tiny_model(attn_impl="sdpa", **overrides).eval()
        hf_model = transformers.AutoModelForCausalLM.from_config(llama_config_to_hf(model.config, 0)).double().eval()
        hf_model.load_state_dict(to_hf_state_dict(model), strict=True)
        input_ids = random_ids(2, 45)
        with torch.no_grad():
            assert (hf_model(input_ids).logits - model(input_ids)[0]).abs().max().item() <= 1e-6, overrides


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True),
                                          ("head_dim", 32), ("attention_dropout", 0.1)])
def test_unsupported_hf_options_name_the_field(field, value):
    config = hf_llama().config
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"hf_config.{field}"):
        llama_config_from_hf(config)


def test_unsupported_hf_rope_names_it():
    config = hf_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}).config
    with pytest.raises(ValueError, match="rope_parameters.*dynamic"):
        llama_config_from_hf(config)


def test_parameter_count_names_and_tying_match_transformers():
    for tied in (True, False):
        model = Llama(LlamaConfig(**TINY, tie_embeddings=tied))
        hf_model = hf_llama(tie_word_embeddings=tied)
        assert model.num_parameters() == hf_model.num_parameters()
        assert model.num_parameters(exclude_embeddings=True) == hf_model.num_parameters(exclude_embeddings=True)
        names = set(hf_model.state_dict())
        assert set(model.state_dict()) == (names - {"lm_head.weight"} if tied else names)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    tied, reloaded = Llama(LlamaConfig(**TINY)), Llama(LlamaConfig(**TINY))
    reloaded.load_state_dict(tied.state_dict(), strict=True)  # the tied head comes with the token table
    assert torch.equal(reloaded.lm_head.weight, tied.model.embed_tokens.weight)
    # init: std 0.02, the residual projections 0.02 / sqrt(2 * n_layer)
    model = Llama(LlamaConfig(**(TINY | dict(n_embd=256, n_head=4, n_kv_head=4, intermediate_size=512))))
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.001
    assert abs(model.model.layers[0].self_attn.o_proj.weight.std().item() - 0.02 / math.sqrt(6)) < 0.0005
    assert model.model.layers[0].input_layernorm.weight.eq(1).all()


# ---- configuration ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("attn_impl", "triton"), ("n_embd", 100), ("n_kv_head", 4), ("vocab_size", 0), ("n_positions", 0),
    ("n_layer", 0), ("intermediate_size", -1), ("rope_theta", 0.0), ("norm_eps", 0.0), ("vocab_multiple", 0),
    ("attn_window", -2), ("global_every", -1),
])
def test_bad_config_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        LlamaConfig(**(TINY | {field: value}))


@pytest.mark.parametrize("fields, named", [
    (dict(attn_window=4, window_layers=[0, 3]), "window_layers"),
    (dict(attn_window=4, window_layers=[1, 1]), "window_layers"),
    (dict(attn_window=4, window_layers=[1], global_every=2), "window_layers and global_every"),
    (dict(global_every=2), "attn_window"),
])
def test_window_choice_is_checked(fields, named):
    with pytest.raises(ValueError, match=named):
        LlamaConfig(**(TINY | fields))


def test_window_patterns():
    assert LlamaConfig(**TINY).layer_windows() == [-1, -1, -1]
    assert LlamaConfig(**TINY, attn_window=8).layer_windows() == [8, 8, 8]
    assert LlamaConfig(**(TINY | dict(n_layer=6)), attn_window=8, global_every=3).layer_windows() == \
        [8, 8, -1, 8, 8, -1]  # Gemma 3's pattern at 3
    assert LlamaConfig(**TINY, attn_window=8, window_layers=[1]).layer_windows() == [-1, 8, -1]


def test_flops_count_each_layers_band():
    plain = Llama(LlamaConfig(**TINY)).flops_per_token()
    windowed = Llama(LlamaConfig(**TINY, attn_window=7, window_layers=[0, 2])).flops_per_token()
    # two of three layers see 8 keys of 64: 2 * 8 / 64 of the square each
    assert plain - windowed == pytest.approx(12 * 96 * 64 * 2 * (1 - 2 * 8 / 64))
    untied = Llama(LlamaConfig(**TINY, tie_embeddings=False))
    # an untied table is a lookup: the matmul parameters are the same
    assert untied.flops_per_token() == pytest.approx(plain)


def test_config_is_a_structured_config_schema():
    schema = OmegaConf.structured(LlamaConfig)
    config = OmegaConf.to_object(OmegaConf.merge(schema, {"n_layer": 2, "rope_scaling": {
        "type": "yarn", "factor": 4, "original_max_position_embeddings": 512}, "window_layers": [1], "attn_window": 3}))
    assert config == LlamaConfig(n_layer=2, rope_scaling=RopeScaling("yarn", 4.0, 512), window_layers=[1],
                                 attn_window=3)
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(schema, {"n_kv_heads": 2})
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(schema, {"rope_scaling": {"kind": "yarn"}})


def test_bad_inputs_raise_naming_the_argument():
    model = tiny_model()
    with pytest.raises(ValueError, match="input_ids"):
        model(random_ids(1, 65))
    with pytest.raises(ValueError, match="input_ids"):
        model(random_ids(1, 4)[0])
    with pytest.raises(ValueError, match="targets"):
        model(random_ids(2, 4), targets=random_ids(2, 3))
    with pytest.raises(ValueError, match="position_ids"):
        model(random_ids(2, 4), position_ids=torch.arange(4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(random_ids(1, 4), cache=model.new_cache(1), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


# ---- longer context: extend_positions, init_from=hf: ------------------------------------------------------------

def test_extend_positions():
    model = tiny_model()
    short = random_ids(2, 30)
    before = model(short)[0]
    model.extend_positions(128, "repeat")  # frequencies kept: the first 64 positions compute what they did
    assert model.config.n_positions == 128 and model.config.rope_scaling.type == "default"
    assert torch.equal(model(short)[0], before) and model(random_ids(1, 128))[0].shape == (1, 128, 97)
    for method, kind in (("interpolate", "linear"), ("ntk", "ntk"), ("yarn", "yarn")):
        extended = tiny_model()
        extended.extend_positions(256, method)
        assert extended.config.rope_scaling == RopeScaling(kind, 4.0, original_max_position_embeddings=64)
        built = tiny_model(n_positions=256, rope_scaling=RopeScaling(kind, 4.0, original_max_position_embeddings=64))
        long = random_ids(1, 200)
        assert torch.equal(extended(long)[0], built(long)[0])
        assert (extended(short)[0] - before).abs().max() > 1e-3  # the frequencies changed
        with pytest.raises(ValueError, match="already scaled"):
            extended.extend_positions(512, "yarn")
    with pytest.raises(ValueError, match="method"):
        tiny_model().extend_positions(128, "stretch")
    with pytest.raises(ValueError, match="new_max"):
        tiny_model().extend_positions(64, "repeat")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers LlamaForCausalLM saved as a directory (config.json with its rope_parameters)."""
    path = tmp_path_factory.mktemp("hf-llama")
    hf_llama(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}).save_pretrained(path)
    return path


def test_init_from_hf_directory_with_a_longer_context(hf_dir):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    same = Llama(LlamaConfig(**TINY, rope_theta=5000.0))
    assert same.load_pretrained(f"hf:{hf_dir}") == f"initialised from hf:{hf_dir}"
    input_ids = random_ids(2, 30)
    with torch.no_grad():
        assert (same(input_ids)[0] - hf_model(input_ids).logits).abs().max().item() <= 1e-4
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    longer = Llama(LlamaConfig(**(TINY | dict(n_positions=256, rope_theta=5000.0, rope_scaling=yarn))))
    assert longer.load_pretrained(f"hf:{hf_dir}") == \
        f"initialised from hf:{hf_dir}, positions 64 -> 256 (RoPE yarn x4 from 64 tokens)"
    for name, tensor in same.state_dict().items():
        assert torch.equal(longer.state_dict()[name], tensor), name
    extrapolated = Llama(LlamaConfig(**(TINY | dict(n_positions=256, rope_theta=5000.0))))
    assert extrapolated.load_pretrained(f"hf:{hf_dir}").endswith("positions 64 -> 256 (RoPE extrapolated)")
    with pytest.raises(ValueError, match=r"init_position_extension=interpolate.*model.rope_scaling=\{type: linear, "
                                         r"factor: 4, original_max_position_embeddings: 64\}"):
        extrapolated.load_pretrained(f"hf:{hf_dir}", "interpolate")
    with pytest.raises(ValueError, match=r"model.rope_theta=10000.0 \(init_from: 5000.0\)"):
        Llama(LlamaConfig(**TINY)).load_pretrained(f"hf:{hf_dir}")
    with pytest.raises(ValueError, match=r"model.n_kv_head=6 \(init_from: 2\)"):
        Llama(LlamaConfig(**(TINY | dict(n_kv_head=6, rope_theta=5000.0)))).load_pretrained(f"hf:{hf_dir}")


@pytest.mark.cuda
def test_cuda_kernel_runs_the_model_in_bf16():
    """On a GPU the CUDA kernel runs the model (GQA 8 on 2 heads of 64, a 40-token window on two of three layers) under
    bf16 autocast: logits and every gradient within 2x the error of the same model on SDPA (both against float32
    SDPA); documents (cu_seqlens) within 2x the error of the plain-PyTorch reference under the same autocast (both
    against the float32 reference); the KV cache's logits, a token at a time, within 2x the error of the full
    forward's."""
    shape = dict(n_embd=512, n_head=8, n_kv_head=2, intermediate_size=1024, n_positions=512, attn_window=40,
                 global_every=3)
    models = {impl: tiny_model(torch.float32, attn_impl=impl, **shape).cuda() for impl in ("flash", "sdpa")}
    input_ids, targets = random_ids(2, 300).cuda(), random_ids(2, 300, seed=3).cuda()

    def run(model, autocast, **inputs):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids, **inputs)[0]
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        return [logits.detach().float()] + [p.grad.clone() for p in model.parameters()]

    def errors(got, want):
        return [(a - b).abs().max().item() for a, b in zip(got, want)]

    exact = run(models["sdpa"], autocast=False)
    kernel, sdpa = errors(run(models["flash"], True), exact), errors(run(models["sdpa"], True), exact)
    assert all(k <= 2 * s + 1e-3 for k, s in zip(kernel, sdpa)), (kernel, sdpa)
    cu_seqlens = torch.tensor([0, 97, 300, 301, 457, 600], dtype=torch.int32, device="cuda")
    models["reference"] = models.pop("sdpa")
    models["reference"].config.attn_impl = "reference"
    for block in models["reference"].model.layers:
        block.self_attn.attn_impl = "reference"
    exact = run(models["reference"], autocast=False, cu_seqlens=cu_seqlens)
    kernel = errors(run(models["flash"], True, cu_seqlens=cu_seqlens), exact)
    reference = errors(run(models["reference"], True, cu_seqlens=cu_seqlens), exact)
    assert all(k <= 2 * r + 1e-3 for k, r in zip(kernel, reference)), (kernel, reference)
    model, ids = models["flash"].eval(), input_ids[:, :80]
    with torch.no_grad():
        exact = models["reference"](ids)[0]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            full = model(ids)[0].float()
            cache = model.new_cache(2)
            steps = [model(ids[:, :50], cache=cache)[0]]
            steps += [model(ids[:, t:t + 1], cache=cache)[0] for t in range(50, 80)]
    cached = torch.cat(steps, dim=1).float()
    assert (cached - exact).abs().max().item() <= 2 * (full - exact).abs().max().item() + 1e-3


# ---- a run through launch.py: training, export, a longer start from its checkpoint ---------------------------------

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
RUN_STEPS = 40


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """recipe=llama-tiny-stdlib (document masking on) shrunk to 2 layers x 64 (4 query heads on 2 key/value heads),
    128 tokens, a 512-token BPE on 300 KB of the standard library, 40 steps: about 10 s of training on 2 CPU cores."""
    run_dir = tmp_path_factory.mktemp("llama") / "run"
    cache_dir = run_dir.parent / "cache"
    proc = subprocess.run([
        sys.executable, "launch.py", "recipe=llama-tiny-stdlib", "logger=none", "model.n_layer=2", "model.n_embd=64",
        "model.n_head=4", "model.n_kv_head=2", "model.intermediate_size=128", "model.n_positions=128",
        "data.max_bytes=300000", "data.val_fraction=0.1", "data.vocab_size=512", "data.num_proc=1",
        f"data.cache_dir={cache_dir}", "data.val_samples=32", "data.sample_tokens=16", "trainer.micro_batch_size=8",
        f"trainer.max_steps={RUN_STEPS}", "trainer.log_interval=5", "trainer.eval_interval=20",
        "trainer.save_interval=20", "optim.lr=3e-3", "optim.warmup_steps=5", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_the_tiny_recipe_trains_through_launch(llama_run):
    """40 steps of 8 x 128 tokens with document masking: validation loss falls from near uniform over the 512-token
    vocabulary by more than 0.6 nat (a clear fall, not convergence; GPT-2's run of this size: the same bound), at
    both passes; the run wrote its
    transformers files."""
    records = [json.loads(line) for line in (llama_run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    train_losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(val) == 3 and val[0] > math.log(512) - 0.3, val
    assert val[0] > val[1] > val[2] and val[2] < val[0] - 0.6, val
    assert train_losses[-1] < train_losses[0] - 0.6, train_losses
    config = transformers.AutoConfig.from_pretrained(llama_run / "hf")
    assert (config.model_type, config.num_key_value_heads, config.max_position_embeddings) == ("llama", 2, 128)


@pytest.mark.slow
def test_export_reloads_with_transformers(llama_run, tmp_path):
    """python -m flashtrain.export: a LlamaForCausalLM with the run's logits (within 1e-4) and greedy continuation."""
    from flashtrain.export import load_run

    out_dir = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "flashtrain.export", str(llama_run), str(out_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = load_run(llama_run, attn_impl="reference")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert type(hf_model).__name__ == "LlamaForCausalLM" and hf_tokenizer.is_fast
    input_ids = torch.tensor([hf_tokenizer("def main(argv):\n    return sorted(argv)\n")["input_ids"]])
    with torch.no_grad():
        ours, theirs = run.model(input_ids)[0], hf_model(input_ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4 * max(1.0, ours.abs().max().item())
    n_new = 24
    greedy_ours = run.model.generate(input_ids, max_new_tokens=n_new, temperature=0.0)
    greedy_theirs = hf_model.generate(input_ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                      repetition_penalty=1.0, attention_mask=torch.ones_like(input_ids))
    assert greedy_ours.tolist() == greedy_theirs.tolist()


@pytest.mark.slow
def test_a_longer_run_starts_from_the_checkpoint(llama_run):
    """init_from=RUN into a 512-token model with YaRN from the run's 128 (the run's own config says so): the same
    weights; a source of other shapes, or interpolation the config does not carry, stops naming the field."""
    from dataclasses import replace

    from flashtrain.export import load_run

    run = load_run(llama_run, attn_impl="reference")
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=128)
    longer = Llama(replace(run.model.config, n_positions=512, rope_scaling=yarn))
    assert longer.load_pretrained(str(llama_run)) == \
        f"initialised from {llama_run}, positions 128 -> 512 (RoPE yarn x4 from 128 tokens)"
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(longer.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match=r"model.n_layer=3 \(init_from: 2\)"):
        Llama(replace(run.model.config, n_layer=3)).load_pretrained(str(llama_run))
    with pytest.raises(ValueError, match="init_position_extension=interpolate"):
        Llama(replace(run.model.config, n_positions=256)).load_pretrained(str(llama_run), "interpolate")


# ---- transformers models on flashtrain's attention: sliding windows and softcapping -------------------------------

def ft_pair(model_type: str, reference: str, **fields):
    """The same random tiny transformers model twice: attention through flashtrain (ft_attention) and through
    `reference` (sdpa, or eager for Gemma 2, whose softcapping SDPA lacks)."""
    from flashtrain.models.hf_attention import NAME, register

    register()
    config_class = {"mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config}[model_type]
    config = config_class(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          **fields)
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME)
    with torch.no_grad():  # sharper attention: scores of a few units, which a softcap of 2 bends
        for name, param in ours.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


FT_CASES = {
    "mistral window 5": ("mistral", "sdpa", dict(sliding_window=5)),
    # every other layer windowed, scores scaled by 1/sqrt(24) (not the head dim's 16), capped at 2 (a cap this low
    # moves them: the scores of this tiny model reach a few units)
    "gemma2 window 6, softcap 2": ("gemma2", "eager", dict(sliding_window=6, attn_logit_softcapping=2.0,
                                                            query_pre_attn_scalar=24, final_logit_softcapping=None)),
}


@pytest.mark.parametrize("case", sorted(FT_CASES))
def test_ft_attention_runs_windows_and_softcap_as_transformers(case):
    """Logits and every gradient equal transformers' own attention within float32 rounding (atol 2e-5, rtol 1e-4, as
    for Llama in tests/test_hf_attention.py); on a padded batch the real tokens' logits too."""
    model_type, reference, fields = FT_CASES[case]
    ours, theirs = ft_pair(model_type, reference, **fields)
    input_ids = torch.randint(0, 101, (2, 37), generator=torch.Generator().manual_seed(1))
    out_ours, out_theirs = ours(input_ids, labels=input_ids), theirs(input_ids, labels=input_ids)
    torch.testing.assert_close(out_ours.logits, out_theirs.logits, atol=2e-5, rtol=1e-4)
    out_ours.loss.backward()
    out_theirs.loss.backward()
    grads_theirs = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, grads_theirs[name].grad, atol=2e-5, rtol=1e-4, msg=name)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, :11] = 0  # left padding
    with torch.no_grad():
        padded_ours = ours(input_ids, attention_mask=mask).logits
        padded_theirs = theirs(input_ids, attention_mask=mask).logits
    torch.testing.assert_close(padded_ours[mask.bool()], padded_theirs[mask.bool()], atol=2e-5, rtol=1e-4)
    # each option matters here: without it the logits move far beyond the tolerance
    for without in ([dict(attn_logit_softcapping=None), dict(sliding_window=128)] if model_type == "gemma2" else
                    [dict(sliding_window=None)]):
        other, _ = ft_pair(model_type, reference, **(fields | without))
        with torch.no_grad():
            assert (other(input_ids).logits - out_ours.logits).abs().max().item() > 1e-2, without


def test_ft_attention_cached_generation_with_a_window_equals_sdpa():
    """Greedy decoding through transformers' cache (sliding layers keep only the window's keys): the same tokens."""
    ours, theirs = ft_pair("mistral", "sdpa", sliding_window=4)
    input_ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=15, min_new_tokens=15, do_sample=False, pad_token_id=0)
    assert ours.generate(input_ids, **kwargs).tolist() == theirs.generate(input_ids, **kwargs).tolist()


def test_score_options_map_transformers_fields():
    from flashtrain.models.hf_attention import score_options

    assert score_options(None, None, True) == {} and score_options(None, 0.0, True) == {}
    assert score_options(4096, 50.0, True) == {"window_size": (4095, 0), "softcap": 50.0}
    assert score_options(3, None, False) == {"window_size": (2, 2)}
    with pytest.raises(ValueError, match="sliding_window"):
        score_options(0, None, True)
