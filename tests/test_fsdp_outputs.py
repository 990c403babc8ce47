"""Under FSDP2 every module that is its own FSDP unit (the model, and each of its _no_split_modules blocks, as
Accelerate's TRANSFORMER_BASED_WRAP wraps them) returns no view tensor that autograd tracks: torch warns about such
an output ("returned a view tensor ... can cause backward to fail or produce wrong gradients"), since an in-place op
on it would skip FSDP's all-gather. One CPU process over gloo, a training step of each model (tests/test_processes.py
runs the same through accelerate launch)."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from flashtrain.models.bert import BertConfig
from flashtrain.models.gpt2 import GPT2Config
from flashtrain.models.lra import LRAConfig

BERT = dict(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_length=64, pad_token_id=0)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('fsdp') / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as Accelerate applies it: each block of the model's _no_split_modules, then the model."""
    for module in model.modules():
        if type(module).__name__ in model._no_split_modules:
            fully_shard(module)
    return fully_shard(model)


def tokens(*shape: int) -> torch.Tensor:
    return torch.randint(1, 90, shape, generator=torch.Generator().manual_seed(0))


def step(model: torch.nn.Module, *args, **kwargs) -> tuple[torch.Tensor, list[str]]:
    """One training forward and backward -> (the model's first output, torch's FSDP view warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, loss = model(*args, **kwargs)
        loss.backward()
    return first, [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


# GPT-2's head runs on the vocabulary padded to a multiple of vocab_multiple: 100 -> 128 columns, its logits the first
# 100 of them; 128 needs no padding
@pytest.mark.parametrize("vocab_size", [100, 128])
def test_gpt2_returns_no_view(process_group, vocab_size):
    torch.manual_seed(0)
    model = sharded(GPT2Config(vocab_size=vocab_size, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                               attn_impl="reference").build())
    x = tokens(2, 16)
    logits, view_warnings = step(model, x, x)
    assert view_warnings == []
    # with targets: a padded vocabulary's logits (a slice) come back detached, an unpadded one's differentiable
    assert logits.shape == (2, 16, vocab_size) and logits.requires_grad == (vocab_size == 128)
    assert model.transformer.wte.weight.grad is not None


@pytest.mark.parametrize("config, call", [
    pytest.param(BertConfig(**BERT, head="masked_lm"),
                 lambda x: ((x, torch.ones_like(x)), dict(labels=torch.where(x % 5 == 0, x, -100))), id="bert-mlm"),
    pytest.param(BertConfig(**BERT, head="classification", num_labels=3),
                 lambda x: ((x, torch.ones_like(x)), dict(labels=torch.tensor([0, 2]))), id="bert-classifier"),
    pytest.param(LRAConfig(vocab_size=100, max_len=65, n_layer=1, n_head=2, d_model=16, d_ff=32, num_classes=10,
                           pad_id=0), lambda x: ((x, torch.tensor([1, 7])), {}), id="lra"),
])
def test_encoders_return_no_view(process_group, config, call):
    torch.manual_seed(0)
    model = sharded(config.build())
    args, kwargs = call(tokens(2, 16))
    assert step(model, *args, **kwargs)[1] == []
