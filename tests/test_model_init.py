"""Starting a run from other weights: a Hugging Face GPT-2 or a flashtrain checkpoint, with position extension."""

from dataclasses import replace

import pytest
import torch
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.train.checkpoint import write_manifest
from flashtrain.train.model_init import load_initial_weights


def tiny_hf(tmp_path, n_positions=64):
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFGPT2Config(vocab_size=97, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf


def our_config(n_positions):
    return GPT2Config(vocab_size=97, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2, attn_impl="reference")


@pytest.mark.parametrize("method", ["repeat", "interpolate"])
def test_init_from_hf_with_longer_context(tmp_path, method):
    hf = tiny_hf(tmp_path)
    model = GPT2(our_config(256)).eval()
    note = load_initial_weights(model, model.config, f"hf:{tmp_path / 'hf'}", method)
    assert "64 -> 256" in note and method in note
    wpe = model.transformer.wpe.weight.detach()
    hf_wpe = hf.transformer.wpe.weight.detach()
    assert wpe.shape == (256, 32)
    if method == "repeat":  # copies of the pretrained table, so short inputs see exactly GPT-2's positions
        torch.testing.assert_close(wpe, hf_wpe.repeat(4, 1), rtol=0, atol=0)
        ids = torch.randint(0, 97, (2, 64))
        with torch.no_grad():
            torch.testing.assert_close(model(ids)[0], hf(ids).logits, rtol=1e-5, atol=1e-5)
    else:  # linear interpolation keeps both ends of the table
        torch.testing.assert_close(wpe[0], hf_wpe[0])
        torch.testing.assert_close(wpe[-1], hf_wpe[-1])
    # every other weight is GPT-2's own
    torch.testing.assert_close(model.transformer.h[1].mlp.c_fc.weight, hf.transformer.h[1].mlp.c_fc.weight.T)


def test_init_from_flashtrain_checkpoint(tmp_path):
    from safetensors.torch import save_file

    source = GPT2(our_config(64))
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    # as Accelerate saves it: the tied lm_head is stored once, as the token embedding
    save_file({k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"},
              str(ckpt / "model.safetensors"))
    write_manifest(ckpt, 10, config={})  # init_from verifies a checkpoint against its manifest, as resume does
    model = GPT2(our_config(128))
    load_initial_weights(model, model.config, str(tmp_path / "run"), "repeat")  # a run dir: its newest checkpoint
    torch.testing.assert_close(model.transformer.wpe.weight[:64], source.transformer.wpe.weight, rtol=0, atol=0)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after loading
    torch.testing.assert_close(model.lm_head.weight, source.lm_head.weight, rtol=0, atol=0)

    smaller = GPT2(our_config(32))
    with pytest.raises(ValueError, match="more than model.n_positions=32"):
        load_initial_weights(smaller, smaller.config, str(ckpt), "repeat")
    wider = GPT2(replace(our_config(64), n_embd=64))
    with pytest.raises(RuntimeError, match=r"size mismatch for transformer.wte.weight: copying a param with shape "
                                           r"torch.Size\(\[97, 32\]\) from checkpoint"):
        load_initial_weights(wider, wider.config, str(ckpt), "repeat")
    with pytest.raises(FileNotFoundError, match="init_from"):
        load_initial_weights(model, model.config, str(tmp_path / "nothing"), "repeat")
