"""GPT-2 model: parity with transformers' GPT2LMHeadModel, HF export, attention implementations, generation."""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from flashtrain.models import GPT2, GPT2Config
from flashtrain.models.losses import linear_cross_entropy, padded_logits
from flashtrain.models.hf_convert import (from_pretrained_hf, gpt2_config_from_hf, gpt2_config_to_hf, load_hf_state_dict,
                                          to_hf_state_dict)

ATTN_IMPLS = ["sdpa", "reference", "flash"]  # "flash" on CPU dispatches to the reference
TINY = dict(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4)
# Logits are O(1); float32 matmul reordering between implementations gives ~1e-6.
LOGITS_ATOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Random biases and LayerNorm affines too, so a misplaced bias or LN weight shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def tiny_hf_model(dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    hf_config = HFGPT2Config(**TINY, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(hf_config).to(dtype).eval()
    perturb_(model, seed=1)
    return model


def tiny_model(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> GPT2:
    torch.manual_seed(seed)
    model = GPT2(GPT2Config(**(TINY | overrides))).to(dtype)
    perturb_(model, seed=seed + 1)
    return model


def random_ids(batch: int, seqlen: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
def test_logits_and_loss_match_hf(attn_impl, dtype):
    hf_model = tiny_hf_model(dtype)
    model = from_pretrained_hf(GPT2, hf_model, attn_impl=attn_impl).eval()
    assert model.transformer.wte.weight.dtype == dtype
    input_ids = random_ids(3, 17)
    # Ours takes shifted targets: targets[:, t] = input_ids[:, t + 1]; the last position has none (-100).
    targets = torch.cat([input_ids[:, 1:], torch.full((3, 1), -100)], dim=1)
    with torch.no_grad():
        hf_out = hf_model(input_ids, labels=input_ids)
        logits, loss = model(input_ids, targets=targets)
    atol = LOGITS_ATOL[dtype]
    assert logits.shape == (3, 17, TINY["vocab_size"])
    assert (logits - hf_out.logits).abs().max().item() <= atol
    assert abs(loss.item() - hf_out.loss.item()) <= atol


def test_non_default_hf_config_is_carried_over():
    """Every HF field the conversion reads, away from its default (a LayerNorm epsilon of 1e-2 moves the logits by
    ~1e-3, far above float64's 1e-10): the config keeps each one, the logits match HF's, and the export restores it."""
    fields = dict(vocab_size=61, n_positions=48, n_embd=48, n_layer=3, n_head=6, layer_norm_epsilon=1e-2,
                  resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.3)
    torch.manual_seed(0)
    hf_model = GPT2LMHeadModel(HFGPT2Config(**fields, bos_token_id=0, eos_token_id=0, attn_implementation="eager"))
    hf_model = hf_model.double().eval()
    perturb_(hf_model, seed=1)
    config = gpt2_config_from_hf(hf_model.config, attn_impl="sdpa")
    assert (config.vocab_size, config.n_positions, config.n_embd, config.n_layer, config.n_head) == (61, 48, 48, 3, 6)
    assert (config.layer_norm_eps, config.dropout, config.attn_dropout) == (1e-2, 0.2, 0.3)
    model = from_pretrained_hf(GPT2, hf_model, attn_impl="sdpa").eval()
    input_ids = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model(input_ids)[0] - hf_model(input_ids).logits).abs().max().item()
    assert diff <= LOGITS_ATOL[torch.float64]
    back = gpt2_config_to_hf(config, eos_token_id=0)
    assert {k: getattr(back, k) for k in fields} == fields


def test_load_old_style_hf_checkpoint():
    """Original hub checkpoints: no "transformer." prefix, causal-mask buffers, lm_head left to the tie."""
    hf_model = tiny_hf_model(torch.float32)
    old_style = {key.removeprefix("transformer."): value for key, value in hf_model.state_dict().items()
                 if key != "lm_head.weight"}
    for i in range(TINY["n_layer"]):
        old_style[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        old_style[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    model = load_hf_state_dict(GPT2(gpt2_config_from_hf(hf_model.config, attn_impl="sdpa")), old_style).eval()
    input_ids = random_ids(2, 9)
    with torch.no_grad():
        diff = (model(input_ids)[0] - hf_model(input_ids).logits).abs().max().item()
    assert diff <= LOGITS_ATOL[torch.float32]


def test_export_round_trip_loads_strictly_into_hf():
    model = tiny_model(torch.float64, attn_impl="sdpa").eval()
    hf_model = GPT2LMHeadModel(HFGPT2Config(**TINY, bos_token_id=0, eos_token_id=0)).double().eval()
    hf_model.load_state_dict(to_hf_state_dict(model), strict=True)
    input_ids = random_ids(2, 23)
    with torch.no_grad():
        diff = (model(input_ids)[0] - hf_model(input_ids).logits).abs().max().item()
    assert diff <= LOGITS_ATOL[torch.float64]
    # Tied: HF's lm_head is our wte.
    assert torch.equal(hf_model.lm_head.weight, model.transformer.wte.weight)


def test_gradients_agree_across_attn_impls():
    input_ids, targets = random_ids(2, 31, seed=3), random_ids(2, 31, seed=4)
    grads = {}
    for attn_impl in ATTN_IMPLS:
        model = tiny_model(torch.float64, attn_impl=attn_impl).train()  # same seed -> same weights
        model(input_ids, targets=targets)[1].backward()
        grads[attn_impl] = {name: param.grad for name, param in model.named_parameters()}
    for attn_impl in ("reference", "flash"):
        for name, grad in grads["sdpa"].items():
            torch.testing.assert_close(grads[attn_impl][name], grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
def test_attn_dropout_only_in_training(attn_impl):
    input_ids = random_ids(2, 20)
    model = tiny_model(attn_impl=attn_impl, attn_dropout=0.3)
    no_dropout = tiny_model(attn_impl=attn_impl)
    with torch.no_grad():
        eval_logits = model.eval()(input_ids)[0]
        torch.testing.assert_close(eval_logits, no_dropout.eval()(input_ids)[0], rtol=0, atol=0)
        torch.manual_seed(5)
        train_logits = model.train()(input_ids)[0]
        torch.manual_seed(5)
        train_logits_again = model(input_ids)[0]
    assert (train_logits - eval_logits).abs().max().item() > 1e-2
    torch.testing.assert_close(train_logits, train_logits_again, rtol=0, atol=0)  # default generator drives it


def test_generate_is_deterministic_given_generator():
    model = tiny_model(attn_impl="sdpa").eval()
    prompt = random_ids(2, 5)
    samples = [model.generate(prompt, 12, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(seed))
               for seed in (7, 7, 8)]
    assert samples[0].shape == (2, 17) and samples[0].dtype == torch.long
    assert torch.equal(samples[0][:, :5], prompt)
    assert torch.equal(samples[0], samples[1])
    assert not torch.equal(samples[0], samples[2])
    assert samples[0].min() >= 0 and samples[0].max() < TINY["vocab_size"]


def test_generate_greedy_matches_forward_argmax_and_crops_context():
    model = tiny_model(attn_impl="sdpa").eval()
    prompt = random_ids(2, 60)  # 60 + 8 > n_positions = 64: the context must be cropped
    expected = prompt
    with torch.no_grad():
        for _ in range(8):
            logits = model(expected[:, -TINY["n_positions"]:])[0]
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    top_1 = model.generate(prompt, 8, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top_1, expected)
    assert torch.equal(model.generate(prompt, 8, temperature=0.0), expected)


@pytest.mark.parametrize("field, value", [
    ("attn_impl", "triton"), ("n_embd", 66), ("vocab_size", 0), ("n_positions", -1), ("n_layer", 0),
    ("n_head", 0), ("dropout", 1.0), ("attn_dropout", -0.1), ("layer_norm_eps", 0.0), ("vocab_multiple", 0),
    ("attn_window", -2), ("attn_softcap", -1.0), ("attn_softcap", float("inf")),
])
def test_bad_config_field_raises_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        GPT2Config(**(TINY | {field: value}))


def test_bad_inputs_raise_naming_the_argument():
    model = tiny_model(attn_impl="sdpa")
    with pytest.raises(ValueError, match="input_ids"):
        model(random_ids(1, TINY["n_positions"] + 1))
    with pytest.raises(ValueError, match="input_ids"):
        model(random_ids(1, 4)[0])
    with pytest.raises(ValueError, match="targets"):
        model(random_ids(2, 4), targets=random_ids(2, 3))
    with pytest.raises(ValueError, match="top_k"):
        model.generate(random_ids(1, 4), 2, top_k=0)


def test_config_is_a_structured_config_schema():
    schema = OmegaConf.structured(GPT2Config)
    config = OmegaConf.to_object(OmegaConf.merge(schema, {"n_layer": 2, "attn_impl": "sdpa"}))
    assert config == GPT2Config(n_layer=2, attn_impl="sdpa")
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(schema, {"n_layers": 2})  # misspelled key fails loudly
    with pytest.raises(ValueError, match="attn_impl"):
        OmegaConf.to_object(OmegaConf.merge(schema, {"attn_impl": "fast"}))


def test_parameter_names_tying_count_and_init():
    model = GPT2(GPT2Config(**TINY))
    names = {name for name, _ in model.named_parameters()}  # tied lm_head.weight is listed once, as wte
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.ln_1.weight",
            "transformer.h.1.attn.c_attn.weight", "transformer.h.1.attn.c_proj.weight",
            "transformer.h.1.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight", "transformer.ln_f.weight"} <= names
    assert model.lm_head.weight is model.transformer.wte.weight
    # the state dict keeps the tied tensor once, as safetensors files do: a checkpoint loads strictly
    assert "lm_head.weight" not in model.state_dict() and "transformer.wte.weight" in model.state_dict()
    reloaded = GPT2(GPT2Config(**TINY))
    reloaded.load_state_dict(model.state_dict(), strict=True)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    assert torch.equal(reloaded.lm_head.weight, model.transformer.wte.weight)
    untied = {**model.state_dict(), "lm_head.weight": model.transformer.wte.weight + 1.0}
    with pytest.raises(RuntimeError, match="lm_head.weight differs from transformer.wte.weight"):
        reloaded.load_state_dict(untied)
    hf_model = GPT2LMHeadModel(HFGPT2Config(**TINY, bos_token_id=0, eos_token_id=0))
    assert model.num_parameters() == hf_model.num_parameters() == 110_400
    assert model.num_parameters(exclude_embeddings=True) == hf_model.num_parameters(exclude_embeddings=True)
    # GPT-2 init: std 0.02, residual projections 0.02 / sqrt(2 * n_layer); 16k samples -> ~1% std error.
    c_fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    c_proj_std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    assert abs(c_fc_std - 0.02) < 0.001
    assert abs(c_proj_std - 0.02 / math.sqrt(2 * TINY["n_layer"])) < 0.0005
    assert model.transformer.h[0].attn.c_attn.bias.abs().max().item() == 0.0


@pytest.mark.parametrize("field, value", [("activation_function", "relu"), ("n_inner", 100), ("embd_pdrop", 0.0)])
def test_unsupported_hf_config_raises_naming_the_option(field, value):
    hf_config = HFGPT2Config(**TINY, bos_token_id=0, eos_token_id=0, **{field: value})
    with pytest.raises(ValueError, match=field):
        gpt2_config_from_hf(hf_config)


# ---- the loss without the logits (flashtrain.models.losses) -----------------------------------------------------

@pytest.mark.parametrize("chunk_elements", [1000, 7 * 512, 2**26])  # 1 row per chunk, 7 rows, everything at once
def test_linear_cross_entropy_equals_the_loss_of_the_full_logits(chunk_elements):
    torch.manual_seed(0)
    hidden = torch.randn(50, 32, dtype=torch.float64, requires_grad=True)
    weight = (0.3 * torch.randn(512, 32, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 512, (50,))
    targets[::6] = -100  # ignored, as F.cross_entropy's ignore_index
    expected = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)
    grads = torch.autograd.grad(3.0 * expected, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_elements=chunk_elements)
    assert loss.dtype == torch.float32 and float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    for got, want in zip(torch.autograd.grad(3.0 * loss, (hidden, weight)), grads):
        assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_linear_cross_entropy_with_every_target_ignored_is_zero_with_zero_gradients():
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((4,), -100))
    loss.backward()
    assert float(loss) == 0.0 and not hidden.grad.any() and not weight.grad.any()


def test_gpt2_training_loss_without_logits_matches_the_full_logits():
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2, attn_impl="reference"))
    x, y = torch.randint(0, 300, (3, 32)), torch.randint(0, 300, (3, 32))
    y[0, :5] = -100
    logits, full = model(x, y)
    full_grads = torch.autograd.grad(full, list(model.parameters()))
    model.config.chunked_loss = True
    none, chunked = model(x, y)
    assert none is None and float(chunked.detach()) == pytest.approx(float(full.detach()), rel=1e-6)
    for got, want in zip(torch.autograd.grad(chunked, list(model.parameters())), full_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)  # the tied token table too
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("multiple, bias", [(128, False), (64, True), (1, False), (5, True)])
def test_padded_logits_equal_the_linear_layer_in_value_and_gradient(multiple, bias):
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(301, 16, dtype=torch.float64, requires_grad=True)  # 301 rows: padded to 384 / 320 / 305
    b = torch.randn(301, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = [t for t in (hidden, weight, b) if t is not None]
    expected = F.linear(hidden, weight, b)
    upstream = torch.randn_like(expected)
    want = torch.autograd.grad(expected, inputs, upstream)
    padded = padded_logits(hidden, weight, multiple, b)
    assert padded.shape[-1] == (301 if multiple == 1 else -(-301 // multiple) * multiple)
    assert not padded[..., 301:].any()  # the padding columns are exactly 0
    got = padded[..., :301]
    assert got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, inputs, upstream), want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-12, atol=1e-12)


def test_gpt2_vocab_padding_keeps_parameters_logits_and_gradients():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2, attn_impl="reference",
                        vocab_multiple=1)
    model = GPT2(config)
    x, y = torch.randint(0, 300, (3, 32)), torch.randint(0, 300, (3, 32))
    logits, loss = model(x, y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.config.vocab_multiple = 128
    padded, padded_loss = model(x, y)
    assert model.lm_head.weight.shape == (300, 32) and padded.shape == (3, 32, 300)
    assert torch.allclose(padded, logits, rtol=1e-5, atol=1e-6)
    assert float(padded_loss.detach()) == pytest.approx(float(loss.detach()), rel=1e-6)
    for got, want in zip(torch.autograd.grad(padded_loss, list(model.parameters())), grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def _windowed_logits(window: int, softcap: float = 0.0, attn_impl: str = "reference", dtype=torch.float64):
    model = tiny_model(dtype, attn_window=window, attn_softcap=softcap, attn_impl=attn_impl)
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    return model(tokens)[0]


def test_sliding_window_attention_matches_sdpa_with_a_band_mask_and_changes_the_output():
    full = _windowed_logits(-1)
    assert torch.allclose(_windowed_logits(39), full, atol=1e-10)  # a window as long as the context: no change
    for window in (0, 5):
        windowed = _windowed_logits(window)
        assert torch.allclose(windowed, _windowed_logits(window, attn_impl="sdpa"), atol=1e-10)
        assert torch.allclose(windowed[:, :window + 1], full[:, :window + 1], atol=1e-10)  # tokens that see it all
        assert (windowed[:, window + 1:] - full[:, window + 1:]).abs().max() > 1e-3


def test_softcap_changes_scores_and_sdpa_refuses_it_by_name():
    capped = _windowed_logits(-1, softcap=0.05)  # scores of this tiny model are O(0.1): a cap this low matters
    assert (capped - _windowed_logits(-1)).abs().max() > 1e-4
    assert torch.allclose(_windowed_logits(-1, softcap=1e6), _windowed_logits(-1), atol=1e-8)
    with pytest.raises(ValueError, match="softcap"):
        _windowed_logits(-1, softcap=30.0, attn_impl="sdpa")


def test_windowed_generation_with_the_cache_matches_recomputing_everything():
    model = tiny_model(torch.float64, attn_window=6, attn_softcap=2.0)
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    cached = model.generate(prompt, 12, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 12, temperature=0.0, use_cache=False))


def test_attention_options_reach_the_backend_check_and_the_flops(monkeypatch):
    from flashtrain.kernels import interface
    from flashtrain.models.attention import backend

    monkeypatch.setattr(interface, "CUDA_FEATURES", frozenset())  # as for kernels that lack the options

    config = GPT2Config(**(TINY | {"attn_window": 7, "attn_softcap": 30.0}))
    assert config.attention_backend(torch.device("cpu"), torch.float32) == "flash -> reference"
    # on a CUDA device the kernels lack the options: attn_impl=flash stops at start-up naming them (no GPU needed:
    # the check comes before any CUDA call)
    with pytest.raises(RuntimeError, match="window_size / softcap run on impl='reference' only.*attn_impl=reference"):
        backend("flash", torch.device("cuda"), torch.bfloat16, 16, features=("window_size", "softcap"))
    with pytest.raises(ValueError, match="softcap: attn_impl=auto runs PyTorch SDPA"):
        backend("auto", torch.device("cuda"), torch.bfloat16, 16, features=("softcap",))
    assert backend("auto", torch.device("cuda"), torch.bfloat16, 16, features=("window_size",))[0] == "sdpa"
    # without a window or softcap a GPT-2 sets no option: the CUDA kernels and SDPA's is_causal run it as before
    from flashtrain.models.attention import attention_features

    assert attention_features(**GPT2Config(**TINY).attention_options, causal=True) == ()
    assert interface._check_features(dict(interface.OPTION_DEFAULTS, window_size=(-1, 0)), torch.zeros(1), 2, 1,
                                     causal=True) is None
    plain = GPT2(GPT2Config(**TINY)).flops_per_token()
    windowed = GPT2(config).flops_per_token()
    assert plain - windowed == pytest.approx(12 * 2 * 64 * 64 * (1 - 2 * 8 / 64))
    with pytest.raises(ValueError, match="attn_window"):
        from flashtrain.models.hf_convert import gpt2_config_to_hf
        gpt2_config_to_hf(config)
