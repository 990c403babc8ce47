"""Every dropout site of every model runs in training, drops about p of its input, and none runs in eval mode; the
attention-probability dropout is on in training only (a guard: a removed embedding or residual dropout site once
went unnoticed). Sites are counted per call: a module used for two residual branches must be called twice."""

import math
from collections import Counter

import pytest
import torch
from torch import nn

from flashtrain.models import GPT2, BertConfig, BertForMaskedLM, BertForSequenceClassification, GPT2Config
from flashtrain.models.lra import LRAClassifier, LRAConfig

P = 0.5  # drops half: the kept fraction of n values is 0.5 +- 0.5 / sqrt(n)


def gpt2(dropout=P, attn_dropout=0.0):
    return GPT2(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2, dropout=dropout,
                           attn_dropout=attn_dropout, attn_impl="reference"))


def bert(model_class, flavor, dropout=P, attn_dropout=0.0):
    return model_class(BertConfig(flavor=flavor, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=48,
                                  max_position_embeddings=40 if flavor == "bert" else 42,
                                  pad_token_id=0 if flavor == "bert" else 1, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=attn_dropout, num_labels=3, attn_impl="reference"))


def lra(dual=False, dropout=P, attn_dropout=0.0):
    return LRAClassifier(LRAConfig(vocab_size=50, max_len=40 if dual else 24, n_layer=2, n_head=2, d_model=16,
                                   d_ff=24, dropout=dropout, attn_dropout=attn_dropout, positions="learned",
                                   pooling="mean", num_classes=3, pad_id=0, dual=dual, attn_impl="reference"))


def gpt2_batch():
    return (torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0)),)


def bert_batch(flavor):
    pad = 0 if flavor == "bert" else 1
    ids = torch.randint(5, 99, (4, 20), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(20)[None, :] < torch.tensor([20, 15, 9, 20])[:, None]).long()
    return ids.masked_fill(mask == 0, pad), mask


def lra_batch(dual=False):
    length = 40 if dual else 24
    return (torch.randint(1, 50, (16, length), generator=torch.Generator().manual_seed(0)),)  # the head sees 16 rows


# model name -> (model, batch, {dropout module: calls per forward}); layers L = 2
CASES = {
    "gpt2": (gpt2, gpt2_batch, {"transformer.drop": 1,  # embeddings
                                **{f"transformer.h.{i}.{site}": 1 for i in range(2)
                                   for site in ("attn.resid_dropout", "mlp.dropout")}}),
    "bert-mlm": (lambda **kw: bert(BertForMaskedLM, "bert", **kw), lambda: bert_batch("bert"),
                 {"encoder.embeddings.dropout": 1, "encoder.layers.0.dropout": 2, "encoder.layers.1.dropout": 2}),
    "bert-classifier": (lambda **kw: bert(BertForSequenceClassification, "bert", **kw), lambda: bert_batch("bert"),
                        {"encoder.embeddings.dropout": 1, "encoder.layers.0.dropout": 2,
                         "encoder.layers.1.dropout": 2, "dropout": 1}),
    "roberta-classifier": (lambda **kw: bert(BertForSequenceClassification, "roberta", **kw),
                           lambda: bert_batch("roberta"),
                           {"encoder.embeddings.dropout": 1, "encoder.layers.0.dropout": 2,
                            "encoder.layers.1.dropout": 2, "classifier.dropout": 2}),  # before and after dense
    "lra": (lra, lra_batch, {"drop": 1, **{f"blocks.{i}.{site}": n for i in range(2)
                                           for site, n in (("dropout", 2), ("mlp.2", 1))}, "head.2": 1}),
    "lra-dual": (lambda **kw: lra(dual=True, **kw), lambda: lra_batch(dual=True),
                 {"drop": 1, **{f"blocks.{i}.{site}": n for i in range(2) for site, n in (("dropout", 2), ("mlp.2", 1))},
                  "head.2": 1, "head.5": 1}),
}


def record_dropout_calls(model):
    """Forward hooks on every nn.Dropout: a list of (module name, kept fraction of the nonzero inputs, their number,
    whether the kept values are the inputs / (1 - p), whether the output is the input)."""
    calls, handles = [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            def hook(module, inputs, output, name=name):
                x = inputs[0]
                nonzero = x != 0
                kept = (output != 0) & nonzero
                scaled = torch.allclose(output[kept], x[kept] / (1 - module.p))
                calls.append((name, kept.sum().item() / max(nonzero.sum().item(), 1), nonzero.sum().item(), scaled,
                              torch.equal(output, x)))
            handles.append(module.register_forward_hook(hook))
    return calls, handles


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_dropout_site_runs_in_training_only(case):
    build, batch, expected_calls = CASES[case]
    torch.manual_seed(0)
    model = build()
    assert {name for name, m in model.named_modules() if isinstance(m, nn.Dropout)} == set(expected_calls)
    calls, handles = record_dropout_calls(model)
    model.train()(*batch())
    assert Counter(name for name, *_ in calls) == Counter(expected_calls)
    for name, kept_fraction, n, scaled, _ in calls:
        assert n >= 90 and abs(kept_fraction - (1 - P)) < 5 * math.sqrt(P * (1 - P) / n), (name, kept_fraction, n)
        assert scaled, name
    calls.clear()
    model.eval()(*batch())
    assert Counter(name for name, *_ in calls) == Counter(expected_calls)  # called, and the identity
    assert all(identity for *_, identity in calls)
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_dropout_in_training_only(case):
    """attn_dropout alone: training outputs differ from the same model without it; eval outputs are equal."""
    build, batch, _ = CASES[case]
    kwargs = {"dropout": 0.0, "attn_dropout": 0.0}
    torch.manual_seed(0)
    plain = build(**kwargs)
    torch.manual_seed(0)
    dropped = build(**{**kwargs, "attn_dropout": P})
    dropped.load_state_dict(plain.state_dict())
    torch.manual_seed(1)
    out_plain, out_dropped = plain.train()(*batch())[0], dropped.train()(*batch())[0]
    assert (out_plain - out_dropped).abs().max() > 1e-3 * out_plain.abs().max()
    assert torch.equal(plain.eval()(*batch())[0], dropped.eval()(*batch())[0])
