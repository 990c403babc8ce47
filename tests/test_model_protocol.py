"""The model protocol of init_from and position extension: a model defines load_pretrained(init_from,
position_extension) and extend_positions(new_max, method), and model_init / flashtrain.models.position call them; a
model without them gets the defaults (hf: through its registered Hugging Face adapter, a checkpoint of its own shapes)
or an error naming the method it lacks. The plugin models of tests/toy_model.py, in process (test_toy_model.py runs
them through launch.py)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models.hf_convert import to_hf_state_dict
from flashtrain.models.position import extend_position_embeddings
from flashtrain.train.checkpoint import write_manifest
from flashtrain.train.model_init import load_initial_weights
from toy_model import LongToyLM, ToyConfig, ToyLM, toy_config_to_hf

CONFIG = ToyConfig(vocab_size=50, n_positions=16, d_model=16, n_head=2, attn_impl="reference")


def toy(model_class=ToyLM, seed=0, **fields):
    torch.manual_seed(seed)
    return model_class(replace(CONFIG, **fields)).eval()


@pytest.fixture
def source(tmp_path):
    """A 16-position ToyLM saved both ways: as a transformers GPT-2 (tmp_path/hf, through the toy's adapter) and as a
    flashtrain checkpoint (tmp_path/run/checkpoints/step_00000010, the tied head saved once)."""
    model = toy(seed=1)
    hf = GPT2LMHeadModel(toy_config_to_hf(model.config, SimpleNamespace(eos_token_id=0)))
    hf.load_state_dict(to_hf_state_dict(model))
    hf.save_pretrained(tmp_path / "hf")
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    write_manifest(ckpt, 10, {})  # complete, as a run writes it
    return model


def assert_same_weights(model, source, skip=()):
    theirs = source.state_dict()
    for key, value in model.state_dict().items():
        if key not in skip:
            assert torch.equal(value, theirs[key]), key


def test_a_model_without_load_pretrained_starts_from_hf_through_its_adapter(tmp_path, source):
    model = toy(seed=2)
    note = load_initial_weights(model, model.config, f"hf:{tmp_path / 'hf'}", "repeat")
    assert note == f"initialised from hf:{tmp_path / 'hf'}"
    assert_same_weights(model, source)
    assert model.head.weight is model.tok_emb.weight  # still tied


def test_a_model_without_load_pretrained_starts_from_a_checkpoint_of_its_shapes(tmp_path, source):
    model = toy(seed=2)
    assert load_initial_weights(model, model.config, str(tmp_path / "run"), "repeat") == \
        f"initialised from {tmp_path / 'run' / 'checkpoints' / 'step_00000010'}"
    assert_same_weights(model, source)
    longer = toy(n_positions=32)
    with pytest.raises(RuntimeError, match=r"size mismatch for pos_emb.weight(.|\n)*ToyLM defines no "
                                           r"load_pretrained\(init_from, position_extension\)"):
        load_initial_weights(longer, longer.config, str(tmp_path / "run"), "repeat")


def test_a_model_without_extend_positions_asked_to_extend_names_the_method(tmp_path, source):
    longer = toy(n_positions=32)
    with pytest.raises(TypeError, match=r"model ToyLM defines no extend_positions\(new_max, method\).*32 asked"):
        load_initial_weights(longer, longer.config, f"hf:{tmp_path / 'hf'}", "repeat")
    with pytest.raises(TypeError, match=r"model ToyLM defines no extend_positions\(new_max, method\)"):
        extend_position_embeddings(longer, 64)
    assert longer.pos_emb.weight.shape == (32, 16)


def test_a_model_with_neither_adapter_nor_loader_names_the_method_for_hf(tmp_path):
    class Unregistered(torch.nn.Module):  # no Hugging Face adapter, no load_pretrained
        config = CONFIG

    with pytest.raises(ValueError, match=r"Unregistered has no Hugging Face adapter .*register_hf_adapter.* defines "
                                         r"no load_pretrained\(init_from, position_extension\)"):
        load_initial_weights(Unregistered(), CONFIG, f"hf:{tmp_path / 'hf'}", "repeat")


@pytest.mark.parametrize("kind", ["hf", "checkpoint"])
def test_a_model_that_defines_the_methods_starts_from_fewer_positions(tmp_path, source, kind):
    """LongToyLM's own load_pretrained: hf:DIR through the adapter's loader, or a toy checkpoint; both extend the
    16-position table to 32 with LongToyLM.extend_positions."""
    model = toy(LongToyLM, seed=2, n_positions=32)
    init_from = f"hf:{tmp_path / 'hf'}" if kind == "hf" else str(tmp_path / "run" / "checkpoints" / "step_00000010")
    note = load_initial_weights(model, model.config, init_from, "repeat")
    assert note == f"initialised from {init_from.removeprefix('hf:') if kind == 'checkpoint' else init_from}, " \
                   "positions extended 16 -> 32 (repeat)"
    assert model.config.n_positions == 32
    assert torch.equal(model.pos_emb.weight, source.pos_emb.weight.repeat(2, 1))
    assert_same_weights(model, source, skip={"pos_emb.weight"})
    ids = torch.randint(0, 50, (2, 16))
    with torch.no_grad():  # inputs that fit the old table: the source's logits
        torch.testing.assert_close(model(ids)[0], source(ids)[0], rtol=0, atol=0)
    interpolated = toy(LongToyLM, n_positions=32)
    assert "16 -> 32 (interpolate)" in load_initial_weights(interpolated, interpolated.config, init_from, "interpolate")
    torch.testing.assert_close(interpolated.pos_emb.weight[[0, -1]], source.pos_emb.weight[[0, -1]])


def test_extension_dispatches_to_the_model(tmp_path):
    """extend_position_embeddings calls the model's extend_positions (LongToyLM's here, no isinstance)."""
    model = toy(LongToyLM)
    before = model.pos_emb.weight.detach().clone()
    extend_position_embeddings(model, 40, method="repeat")
    assert model.config.n_positions == 40
    assert torch.equal(model.pos_emb.weight, torch.cat([before, before, before[:8]]))
    with pytest.raises(ValueError, match="new_max must exceed the current maximum of 40 tokens, got 40"):
        extend_position_embeddings(model, 40)


def test_a_subclass_of_gpt2_inherits_its_loader(tmp_path):
    """The loader is a method, so a subclass of GPT2 (as FSDP's fully_shard makes) starts from hf: GPT-2 as GPT2
    does, positions extended 32 -> 64."""
    class MyGPT2(GPT2):
        pass

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFGPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    model = MyGPT2(GPT2Config(vocab_size=61, n_positions=64, n_embd=16, n_layer=1, n_head=2, attn_impl="reference"))
    note = load_initial_weights(model, model.config, f"hf:{tmp_path / 'gpt2'}", "repeat")
    assert note == f"initialised from hf:{tmp_path / 'gpt2'}, positions extended 32 -> 64 (repeat)"
    assert torch.equal(model.transformer.wpe.weight, hf.transformer.wpe.weight.repeat(2, 1))
    assert model.config.n_positions == 64
