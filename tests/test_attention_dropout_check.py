"""GPT-2's sliding window (model.attn_window) and logit softcapping (model.attn_softcap) with attention dropout
(model.attn_dropout > 0): flashtrain's CUDA kernels run the window and the softcap without dropout only, so where the
kernel would run the model's attention (attn_impl flash or auto on a GPU where it runs) the start stops, naming the
keys; the reference (any device) and SDPA (the window as a mask) run the combination. GPT-2 is the one model with
these keys (BERT and the LRA encoder have neither)."""

import pytest
import torch

from flashtrain.kernels import flash_attn_func
from flashtrain.models import attention
from flashtrain.models.gpt2 import GPT2Config
from hydra_config import compose_config

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
WINDOW_MESSAGE = ("model.attn_window=64 with model.attn_dropout=0.1: flashtrain's CUDA kernels (model.attn_impl={impl} "
                  "-> kernel) do not combine a sliding window with attention dropout; set model.attn_dropout=0, or "
                  "model.attn_impl=reference (the plain-PyTorch path, slow) or model.attn_impl=sdpa (the window as a "
                  "mask)")
SOFTCAP_MESSAGE = ("model.attn_softcap=30.0 with model.attn_dropout=0.1: flashtrain's CUDA kernels (model.attn_impl="
                   "{impl} -> kernel) do not combine logit softcapping with attention dropout; set model.attn_dropout=0, "
                   "or model.attn_impl=reference (the plain-PyTorch path, slow)")
BOTH_MESSAGE = ("model.attn_window=64, model.attn_softcap=30.0 with model.attn_dropout=0.1: flashtrain's CUDA kernels "
                "(model.attn_impl={impl} -> kernel) do not combine a sliding window or logit softcapping with attention "
                "dropout; set model.attn_dropout=0, or model.attn_impl=reference (the plain-PyTorch path, slow)")


@pytest.fixture
def kernel_runs(monkeypatch):
    """A CUDA device where flashtrain's kernel runs plain attention (what a GPU with cuda-python gives)."""
    real = attention.kernel_unavailable_reason
    monkeypatch.setattr(attention, "kernel_unavailable_reason", lambda device, dtype, head_dim, block_mask, features=():
                        None if device.type == "cuda" else real(device, dtype, head_dim, block_mask, features))


@pytest.mark.parametrize("impl", ["flash", "auto"])
@pytest.mark.parametrize("overrides, message", [
    (["model.attn_window=64"], WINDOW_MESSAGE),
    (["model.attn_softcap=30.0"], SOFTCAP_MESSAGE),
    (["model.attn_window=64", "model.attn_softcap=30.0"], BOTH_MESSAGE),
], ids=["window", "softcap", "window-and-softcap"])
def test_the_kernel_with_dropout_stops_the_start_naming_the_keys(kernel_runs, impl, overrides, message):
    cfg = compose_config(["name=x", f"model.attn_impl={impl}", "model.attn_dropout=0.1", *overrides])
    with pytest.raises(ValueError) as raised:
        cfg.model.attention_backend(CUDA, torch.bfloat16)
    assert str(raised.value) == message.format(impl=impl)


def test_what_runs_the_combination_is_not_stopped(kernel_runs):
    window = dict(attn_window=64, attn_dropout=0.1, n_embd=192, n_head=3)
    assert GPT2Config(attn_impl="sdpa", **window).attention_backend(CUDA, torch.bfloat16) == "sdpa -> sdpa"
    assert GPT2Config(attn_impl="reference", **window, attn_softcap=30.0).attention_backend(
        CUDA, torch.bfloat16) == "reference -> reference"
    # without dropout, or without window and softcap, the kernel runs
    assert GPT2Config(attn_impl="flash", **{**window, "attn_dropout": 0.0}).attention_backend(
        CUDA, torch.bfloat16) == "flash -> kernel"
    assert GPT2Config(attn_impl="flash", attn_dropout=0.1).attention_backend(CUDA, torch.bfloat16) == "flash -> kernel"
    # on the CPU flash is the reference and auto SDPA: both run the window with dropout
    assert GPT2Config(attn_impl="flash", **window).attention_backend(CPU, torch.float32) == "flash -> reference"
    assert GPT2Config(attn_impl="auto", **window).attention_backend(CPU, torch.float32).startswith("auto -> sdpa")


@pytest.mark.parametrize("attn_impl", ["flash", "reference"])
def test_the_reference_trains_a_window_and_softcap_with_dropout(attn_impl):
    torch.manual_seed(0)
    model = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, attn_impl=attn_impl,
                       attn_window=4, attn_softcap=30.0, attn_dropout=0.1).build().train()
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(tokens, tokens)[1]
    loss.backward()
    assert torch.isfinite(loss) and model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("options", [dict(window_size=(8, 0)), dict(softcap=30.0)])
def test_the_cuda_kernels_refuse_the_combination(options):
    """What the start-up check guards against: the first training step's attention call."""
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(RuntimeError, match="with dropout run on impl='reference' only"):
        flash_attn_func(q, k, v, 0.1, causal=True, impl="cuda", **options)
