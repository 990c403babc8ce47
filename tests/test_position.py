"""Position-table extension: what each method preserves, for BERT, RoBERTa and GPT-2; HF export after extending."""

import pytest
import torch
import transformers

from flashtrain.models import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel, GPT2,
                               GPT2Config, extend_position_embeddings)
from flashtrain.models.hf_convert import to_hf_state_dict

OLD_MAX, NEW_MAX = 24, 60  # tokens; 60 is not a multiple of 24, so the last tile is partial
BERT_TINY = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40)


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model.eval()


def tiny_model(kind: str) -> torch.nn.Module:
    """kind: "bert" | "roberta" (BertForMaskedLM) | "gpt2"; each takes inputs of up to OLD_MAX tokens."""
    torch.manual_seed(0)
    if kind == "gpt2":
        return perturbed(GPT2(GPT2Config(vocab_size=50, n_positions=OLD_MAX, n_embd=24, n_layer=2, n_head=2)), 1)
    offset = 2 if kind == "roberta" else 0
    config = BertConfig(flavor=kind, **BERT_TINY, max_position_embeddings=OLD_MAX + offset,
                        pad_token_id=offset // 2, attn_impl="reference")
    return perturbed(BertForMaskedLM(config), 1)


def position_table(model: torch.nn.Module) -> torch.Tensor:
    if isinstance(model, GPT2):
        return model.transformer.wpe.weight.detach().clone()
    return model.encoder.embeddings.position_embeddings.weight.detach().clone()


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids)[0]


def random_ids(seqlen: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, 50, (2, seqlen), generator=torch.Generator().manual_seed(seed))  # no pad id (0, 1)


@pytest.mark.parametrize("kind", ["bert", "roberta", "gpt2"])
def test_repeat_tiles_rows_and_keeps_outputs_on_short_inputs(kind):
    model = tiny_model(kind)
    offset = 2 if kind == "roberta" else 0
    old_table = position_table(model)
    short_ids = random_ids(OLD_MAX)
    before = logits(model, short_ids)
    extend_position_embeddings(model, NEW_MAX, method="repeat")

    new_table = position_table(model)
    assert new_table.shape == (offset + NEW_MAX, old_table.shape[1])
    assert torch.equal(new_table[:offset], old_table[:offset])  # RoBERTa's rows 0-1: copied, not left uninitialised
    for position in range(NEW_MAX):
        assert torch.equal(new_table[offset + position], old_table[offset + position % OLD_MAX]), position
    max_positions = model.config.n_positions if kind == "gpt2" else model.config.max_position_embeddings
    assert max_positions == offset + NEW_MAX
    assert torch.equal(logits(model, short_ids), before)  # bit-identical on inputs that fit the old table
    assert logits(model, random_ids(NEW_MAX)).shape == (2, NEW_MAX, 50)  # and now takes the long ones


@pytest.mark.parametrize("kind", ["bert", "roberta", "gpt2"])
def test_interpolate_matches_manual_formula_and_keeps_endpoints(kind):
    model = tiny_model(kind)
    offset = 2 if kind == "roberta" else 0
    old_table = position_table(model).double()
    one_token = random_ids(1)
    before = logits(model, one_token)
    extend_position_embeddings(model, NEW_MAX, method="interpolate")

    new_table = position_table(model)
    assert torch.equal(new_table[:offset], old_table[:offset].float())
    pretrained = old_table[offset:]  # (OLD_MAX, C)
    for position in range(NEW_MAX):
        source = position * (OLD_MAX - 1) / (NEW_MAX - 1)  # endpoints aligned
        below = min(int(source), OLD_MAX - 2)
        fraction = source - below
        expected = (1 - fraction) * pretrained[below] + fraction * pretrained[below + 1]
        assert (new_table[offset + position].double() - expected).abs().max().item() <= 1e-6, position
    assert torch.equal(new_table[offset], pretrained[0].float())
    assert torch.equal(new_table[-1], pretrained[-1].float())
    # Only position 0 is guaranteed: a one-token input is unchanged, a longer one is not.
    assert torch.equal(logits(model, one_token), before)


def test_roberta_extended_model_still_matches_hf_beyond_the_old_maximum():
    """Positions past the old table follow HF's semantics: export to a RobertaModel with the new table size."""
    torch.manual_seed(3)
    config = BertConfig(flavor="roberta", **BERT_TINY, max_position_embeddings=OLD_MAX + 2, pad_token_id=1,
                        attn_impl="reference")
    model = perturbed(BertModel(config), 4)
    extend_position_embeddings(model, NEW_MAX, method="repeat")
    hf_model = transformers.RobertaModel(transformers.RobertaConfig(
        **BERT_TINY, max_position_embeddings=NEW_MAX + 2, pad_token_id=1, attn_implementation="eager")).eval()
    hf_model.load_state_dict(to_hf_state_dict(model), strict=True)
    input_ids = random_ids(NEW_MAX).clone()
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 40:], attention_mask[1, 40:] = 1, 0  # padded row
    with torch.no_grad():
        hidden = model(input_ids, attention_mask)[0]
        hf_hidden = hf_model(input_ids, attention_mask=attention_mask).last_hidden_state
    is_real = attention_mask.bool()
    assert (hidden[is_real] - hf_hidden[is_real]).abs().max().item() <= 1e-5


def test_extension_reaches_the_encoder_of_a_classifier():
    config = BertConfig(flavor="bert", **BERT_TINY, max_position_embeddings=OLD_MAX, attn_impl="reference")
    model = BertForSequenceClassification(config)
    extend_position_embeddings(model, NEW_MAX)
    assert model.encoder.embeddings.position_embeddings.num_embeddings == NEW_MAX
    assert model.config.max_seqlen == model.encoder.config.max_seqlen == NEW_MAX


def test_bad_arguments_raise_naming_them():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="method"):
        extend_position_embeddings(model, NEW_MAX, method="nearest")
    with pytest.raises(ValueError, match="new_max"):
        extend_position_embeddings(model, OLD_MAX)
    with pytest.raises(TypeError, match="model"):
        extend_position_embeddings(torch.nn.Linear(2, 2), NEW_MAX)
