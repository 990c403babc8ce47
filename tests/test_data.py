"""The language-model data pipeline: tokenizer round trips, token files, the cache, packed blocks, resumable order."""

import itertools
import json
import math

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from flashtrain.data import corpus as corpus_module
from flashtrain.data import lm
from flashtrain.data.corpus import open_corpus
from flashtrain.data.cache import resolve_cache_dir
from flashtrain.data.lm import (LMDataConfig, PackedLMDataset, make_train_loader, make_val_loader, prepare_lm_data,
                                split_documents)
from flashtrain.data.samplers import ResumableBatchSampler
from flashtrain.data.tokenizer import (EOS_TOKEN, decode, encode_ordinary, eos_id, load_tokenizer, save_tokenizer,
                                       train_bpe)

SMALL = dict(corpus="stdlib", max_bytes=200_000, vocab_size=512, val_fraction=0.2, seq_len=64, num_proc=1)

AWKWARD_TEXTS = [
    "def f(x):\r\n\treturn x  # tabs, CRLF, trailing spaces   \n",
    "unicode: é ß 漢字 🙂 \u200b and a lone combining mark \u0301",
    f"a literal {EOS_TOKEN} inside a document is text, not a document end",
    "",
    " leading space and\n\n\nblank lines\n",
]


@pytest.fixture(scope="module")
def stdlib_small(tmp_path_factory):
    """The first 200 kB of the stdlib, BPE 512, tokenized with 2 processes (the multiprocess path)."""
    cfg = LMDataConfig(**{**SMALL, "num_proc": 2}, cache_dir=str(tmp_path_factory.mktemp("cache")))
    return cfg, prepare_lm_data(cfg)


def read_tokens(path) -> np.ndarray:
    meta = json.loads((path.parent / "meta.json").read_text())
    return np.fromfile(path, dtype=meta["dtype"])


# ---- tokenizer -------------------------------------------------------------------------------------------------

def test_tokenizer_round_trips_exactly_and_keeps_eos_literal_as_text(stdlib_small, tmp_path):
    _, data = stdlib_small
    tokenizer = data.tokenizer
    assert data.vocab_size == 512 and data.eos_id == eos_id(tokenizer) == 0
    ids = encode_ordinary(tokenizer, AWKWARD_TEXTS)
    assert [decode(tokenizer, doc) for doc in ids] == AWKWARD_TEXTS
    assert ids[3] == []
    assert data.eos_id not in ids[2]  # the literal string was split into ordinary byte-level tokens
    # EOS itself decodes to its string, so a decoded token file shows where documents end
    assert decode(tokenizer, ids[0] + [data.eos_id] + ids[1]) == AWKWARD_TEXTS[0] + EOS_TOKEN + AWKWARD_TEXTS[1]
    # encode_ordinary leaves the tokenizer as it found it: plain encode() still maps the string to EOS
    assert tokenizer.encode(EOS_TOKEN).ids == [data.eos_id]

    # saved and reloaded (tokenizer.json), and as GPT-2's vocab.json + merges.txt: the same ids
    save_tokenizer(tokenizer, tmp_path / "json" / "tokenizer.json")
    (tmp_path / "gpt2").mkdir()
    tokenizer.model.save(str(tmp_path / "gpt2"))  # writes vocab.json, merges.txt
    for path in (tmp_path / "json", tmp_path / "json" / "tokenizer.json", tmp_path / "gpt2"):
        reloaded = load_tokenizer(path)
        assert encode_ordinary(reloaded, AWKWARD_TEXTS) == ids, path
        assert eos_id(reloaded) == data.eos_id
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        load_tokenizer(tmp_path / "missing")


def test_bpe_vocab_size_and_missing_eos_are_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], vocab_size=100)
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="endoftext"):
        eos_id(Tokenizer(models.BPE()))


# ---- token files -----------------------------------------------------------------------------------------------

def test_token_files_hold_each_document_then_eos_split_by_seed(stdlib_small):
    cfg, data = stdlib_small
    documents = open_corpus("stdlib", max_bytes=cfg.max_bytes).documents()["text"]
    n_bytes = sum(len(t.encode()) for t in documents)
    assert cfg.max_bytes - 4 < n_bytes <= cfg.max_bytes  # the last file is cut at the cap (on a char boundary)
    assert len(documents) >= 10

    doc_ids = [np.array(ids + [data.eos_id]) for ids in encode_ordinary(data.tokenizer, documents)]
    assert all(decode(data.tokenizer, ids[:-1]) == text for ids, text in zip(doc_ids, documents))
    train_idx, val_idx = split_documents(len(documents), cfg.val_fraction, cfg.seed)
    assert len(val_idx) == round(len(documents) * cfg.val_fraction)
    for path, idx, n_tokens in ((data.train_path, train_idx, data.n_train_tokens),
                                (data.val_path, val_idx, data.n_val_tokens)):
        tokens = read_tokens(path)
        assert tokens.dtype == np.uint16
        expected = np.concatenate([doc_ids[i] for i in idx])  # documents in corpus order, each ended by EOS
        assert len(tokens) == n_tokens == sum(len(doc_ids[i]) for i in idx)
        np.testing.assert_array_equal(tokens, expected)
    meta = json.loads((data.train_path.parent / "meta.json").read_text())
    assert meta["n_documents"] == {"train": len(train_idx), "val": len(val_idx)}
    assert meta["vocab_size"] == 512 and meta["eos_id"] == 0 and meta["dtype"] == "uint16"


def test_split_is_fixed_by_seed_disjoint_and_covering():
    train, val = split_documents(1000, 0.02, seed=7)
    train2, val2 = split_documents(1000, 0.02, seed=7)
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(val, val2)
    assert len(val) == 20 and not set(train) & set(val) and set(train) | set(val) == set(range(1000))
    _, val_other_seed = split_documents(1000, 0.02, seed=8)
    assert set(val_other_seed) != set(val)
    assert len(split_documents(10, 0.01, seed=0)[1]) == 1  # at least one val document when val_fraction > 0
    assert len(split_documents(10, 0.0, seed=0)[1]) == 0
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(1, 0.5, seed=0)


def test_second_prepare_is_a_cache_hit(stdlib_small, monkeypatch):
    cfg, data = stdlib_small
    mtimes = {p: p.stat().st_mtime_ns for p in (data.train_path, data.val_path, data.tokenizer_path)}

    def no_work(*args, **kwargs):
        raise AssertionError("cache miss: the second call did work")

    monkeypatch.setattr(lm, "train_bpe", no_work)
    monkeypatch.setattr(lm, "write_token_files", no_work)
    again = prepare_lm_data(cfg)
    assert (again.train_path, again.val_path, again.tokenizer_path) == (data.train_path, data.val_path,
                                                                        data.tokenizer_path)
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    # a given tokenizer_path with the same content finds the same token files: the key hashes content, not path
    given = prepare_lm_data(LMDataConfig(**{**SMALL, "tokenizer_path": str(data.tokenizer_path.parent)},
                                         cache_dir=cfg.cache_dir))
    assert given.train_path == data.train_path


def test_changing_the_seed_changes_the_split_and_the_cache_key(stdlib_small):
    cfg, data = stdlib_small
    n_documents = json.loads((data.train_path.parent / "meta.json").read_text())["n_documents"]
    n_documents = n_documents["train"] + n_documents["val"]
    val_idx = split_documents(n_documents, cfg.val_fraction, cfg.seed)[1]
    other_val_idx = split_documents(n_documents, cfg.val_fraction, cfg.seed + 1)[1]
    assert set(val_idx) != set(other_val_idx)
    other = prepare_lm_data(LMDataConfig(**{**SMALL, "seed": cfg.seed + 1}, cache_dir=cfg.cache_dir))
    assert other.train_path.parent != data.train_path.parent
    assert other.tokenizer_path != data.tokenizer_path  # the BPE is trained on the train split only
    assert other.n_train_tokens + other.n_val_tokens > 0
    assert not np.array_equal(read_tokens(other.val_path)[:100], read_tokens(data.val_path)[:100])


# ---- local corpora ---------------------------------------------------------------------------------------------

LOCAL_DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i + 1) + "é\n" for i in range(12)]


def test_local_txt_jsonl_parquet_give_the_same_tokens(tmp_path):
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(LOCAL_DOCS):  # zero-padded names: sorted path order is document order
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n"
                                                 for i, d in enumerate(LOCAL_DOCS)))
    pq.write_table(pa.table({"body": LOCAL_DOCS}), tmp_path / "docs.parquet")

    tokens = {}
    for corpus, text_field in ((str(tmp_path / "txt"), "text"), (str(tmp_path / "txt" / "*.txt"), "text"),
                               (str(tmp_path / "docs.jsonl"), "body"), (str(tmp_path / "docs.parquet"), "body")):
        cfg = LMDataConfig(corpus=corpus, text_field=text_field, max_bytes=0, vocab_size=300, val_fraction=0.25,
                           seq_len=8, num_proc=1, cache_dir=str(tmp_path / "cache"))
        data = prepare_lm_data(cfg)
        train_idx, val_idx = split_documents(len(LOCAL_DOCS), cfg.val_fraction, cfg.seed)
        doc_ids = encode_ordinary(data.tokenizer, LOCAL_DOCS)
        expected_train = np.concatenate([doc_ids[i] + [data.eos_id] for i in train_idx])
        np.testing.assert_array_equal(read_tokens(data.train_path), expected_train)
        assert data.n_val_tokens == sum(len(doc_ids[i]) + 1 for i in val_idx)
        tokens[corpus] = read_tokens(data.train_path)
    assert len({t.tobytes() for t in tokens.values()}) == 1


def test_local_corpus_cap_cuts_the_crossing_document(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in LOCAL_DOCS))
    sizes = np.cumsum([len(d.encode()) for d in LOCAL_DOCS])
    max_bytes = int(sizes[4]) + 10  # 5 whole documents and 10 bytes of the 6th
    documents = open_corpus(str(tmp_path / "docs.jsonl"), max_bytes=max_bytes,
                            hf_cache_dir=tmp_path / "hf").documents()["text"]
    assert documents[:5] == LOCAL_DOCS[:5] and documents[5] == LOCAL_DOCS[5][:10]


def test_hub_corpus_parses_name_and_config_and_picks_the_text_field(monkeypatch):
    # offline: stand in for datasets.load_dataset(name, config, split="train") with an in-memory dataset
    calls = []

    def fake_load_hub(name, config):
        calls.append((name, config))
        return datasets.Dataset.from_dict({"id": list(range(len(LOCAL_DOCS))), "content": LOCAL_DOCS})

    monkeypatch.setattr(corpus_module, "_load_hub", fake_load_hub)
    corpus = open_corpus("hf:someone/web-text:en", text_field="content", max_bytes=len(LOCAL_DOCS[0].encode()) + 3)
    assert corpus.documents()["text"] == [LOCAL_DOCS[0], LOCAL_DOCS[1][:3]]
    assert calls == [("someone/web-text", "en")] * 2
    assert open_corpus("hf:someone/web-text", text_field="content").documents()["text"] == LOCAL_DOCS
    assert calls[-1] == ("someone/web-text", None)
    with pytest.raises(ValueError, match="text_field='text'"):
        open_corpus("hf:someone/web-text").documents()


def test_bad_corpus_names_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus="):
        open_corpus(str(tmp_path / "nothing-here-*.txt"))
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n')
    with pytest.raises(ValueError, match="mixes file types"):
        open_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="text_field='body'"):
        open_corpus(str(tmp_path / "b.jsonl"), text_field="body", hf_cache_dir=tmp_path / "hf").documents()


# ---- serving ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, seq_len", [("uint16", 7), ("uint32", 1), ("uint32", 97)])
def test_packed_blocks_are_contiguous_shifted_slices(tmp_path, dtype, seq_len):
    tokens = (np.arange(1000, dtype=np.int64) * 7919 % 70_000).astype(dtype)  # distinct-looking, > 65535 in uint32
    tokens.tofile(tmp_path / "train.bin")
    dataset = PackedLMDataset(tmp_path / "train.bin", seq_len, dtype=dtype)
    assert len(dataset) == (1000 - 1) // seq_len
    xs = []
    for i in range(len(dataset)):
        x, y = dataset[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (seq_len,)
        np.testing.assert_array_equal(x.numpy(), tokens[i * seq_len:(i + 1) * seq_len])
        np.testing.assert_array_equal(y.numpy(), tokens[i * seq_len + 1:(i + 1) * seq_len + 1])
        xs.append(x)
    # the blocks tile the file from its start, without overlap or gaps
    np.testing.assert_array_equal(torch.cat(xs).numpy(), tokens[:len(dataset) * seq_len])
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    with pytest.raises(ValueError, match="seq_len"):
        PackedLMDataset(tmp_path / "train.bin", 1000, dtype=dtype)


def take(iterator, start, n):
    return list(itertools.islice(iterator, start, start + n))


def test_sampler_is_seeded_sharded_and_resumes_at_any_batch():
    num_samples, batch_size, world_size = 60, 4, 3  # 5 steps per epoch, all 60 samples used
    sampler = ResumableBatchSampler(num_samples, batch_size, seed=11)
    assert take(iter(sampler), 0, 40) == take(iter(ResumableBatchSampler(num_samples, batch_size, seed=11)), 0, 40)
    assert take(iter(sampler), 0, 5) != take(iter(ResumableBatchSampler(num_samples, batch_size, seed=12)), 0, 5)
    first_epochs = take(iter(sampler), 0, 30)
    assert all(len(b) == batch_size for b in first_epochs)
    # 15 batches of 4 = one epoch: every sample exactly once, and the next epoch in a different order
    assert sorted(i for b in first_epochs[:15] for i in b) == list(range(num_samples))
    assert first_epochs[:15] != first_epochs[15:30]

    ranks = [ResumableBatchSampler(num_samples, batch_size, seed=11, rank=r, world_size=world_size)
             for r in range(world_size)]
    assert ranks[0].batches_per_epoch == 5
    for epoch in range(2):
        seen = [i for r in ranks for b in take(iter(r), epoch * 5, 5) for i in b]
        assert sorted(seen) == list(range(num_samples))  # disjoint and covering, every epoch

    for rank in (0, 2):
        uninterrupted = take(iter(ranks[rank]), 0, 20)
        for start in (1, 4, 5, 6, 13):  # inside epoch 0, its last batch, the boundary, and later epochs
            resumed = ResumableBatchSampler(num_samples, batch_size, seed=11, rank=rank, world_size=world_size,
                                            start_batch=start)
            assert take(iter(resumed), 0, 20 - start) == uninterrupted[start:], (rank, start)


def test_sampler_steps_are_the_same_samples_for_any_split_and_resume_across_splits():
    """An optimizer step of 24 samples reads the same 24 whether 1 process takes 3 micro-batches of 8, 3 processes one
    each, or 2 processes 2 micro-batches of 6; a run resumed after k steps with another split continues with step
    k + 1's samples (start_batch = samples consumed / (batch_size x world_size))."""
    num_samples, seed = 100, 5  # 4 steps of 24 per epoch, 4 samples dropped

    def steps(batch_size, world_size, accum_steps, n_steps, start_step=0):
        """[{sample indices of step s}, ...] for steps start_step .. start_step + n_steps - 1."""
        start_batch = start_step * 24 // (batch_size * world_size)
        ranks = [iter(ResumableBatchSampler(num_samples, batch_size, seed, rank, world_size, start_batch, accum_steps))
                 for rank in range(world_size)]
        return [sorted(i for rank in ranks for _ in range(accum_steps) for i in next(rank)) for _ in range(n_steps)]

    one_process = steps(8, 1, 3, 10)  # 2.5 epochs
    assert all(len(set(step)) == 24 for step in one_process)
    assert sorted(i for step in one_process[:4] for i in step) == sorted(
        ResumableBatchSampler(num_samples, 8, seed).epoch_permutation(0)[:96].tolist())  # epoch 0's first 96
    assert steps(8, 3, 1, 10) == steps(6, 2, 2, 10) == steps(24, 1, 1, 10) == one_process
    for start_step in (1, 3, 4, 7):  # inside epoch 0, its last step, the boundary, epoch 1
        assert steps(6, 2, 2, 10 - start_step, start_step) == one_process[start_step:], start_step
        assert steps(8, 3, 1, 10 - start_step, start_step) == one_process[start_step:], start_step


def test_sampler_drops_the_remainder_and_validates():
    sampler = ResumableBatchSampler(10, 3, seed=0, rank=1, world_size=2)  # 6 indices per step: 1 step, 4 unused
    assert sampler.batches_per_epoch == 1
    order = sampler.epoch_permutation(0)
    assert next(iter(sampler)) == order[3:6].tolist()
    with pytest.raises(ValueError, match="batch_size"):
        ResumableBatchSampler(5, 3, seed=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        ResumableBatchSampler(10, 1, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="start_batch"):
        ResumableBatchSampler(10, 1, seed=0, start_batch=-1)
    with pytest.raises(ValueError, match="batch_size \\* world_size \\* accum_steps = 3 \\* 2 \\* 2 = 12"):
        ResumableBatchSampler(10, 3, seed=0, world_size=2, accum_steps=2)


def test_train_loader_batches_and_resume(stdlib_small):
    _, data = stdlib_small
    dataset = PackedLMDataset(data.train_path, data.seq_len)
    loader = make_train_loader(data, batch_size=3)
    batches = take(iter(loader), 0, 6)
    sampler = ResumableBatchSampler(len(dataset), 3, seed=data.seed)
    for (x, y), indices in zip(batches, iter(sampler)):
        assert x.shape == y.shape == (3, data.seq_len) and x.dtype == torch.int64
        torch.testing.assert_close(x, torch.stack([dataset[i][0] for i in indices]))
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
    # resumed at batch 4, with worker processes: the same batches as the uninterrupted loader
    resumed = take(iter(make_train_loader(data, batch_size=3, start_batch=4, num_workers=2)), 0, 2)
    for (x, y), (x_ref, y_ref) in zip(resumed, batches[4:]):
        torch.testing.assert_close(x, x_ref)
        torch.testing.assert_close(y, y_ref)


def test_val_loader_is_fixed_ordered_and_finite(stdlib_small):
    _, data = stdlib_small
    dataset = PackedLMDataset(data.val_path, data.seq_len)
    batch_size = 2
    passes = [list(make_val_loader(data, batch_size)) for _ in range(2)]
    assert len(passes[0]) == math.ceil(len(dataset) / batch_size) >= 4  # max_samples None: every block
    for (x0, y0), (x1, y1) in zip(*passes):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    for b, (x, _) in enumerate(passes[0]):
        assert torch.equal(x, torch.stack([dataset[i][0] for i in range(b * batch_size,
                                                                        min((b + 1) * batch_size, len(dataset)))]))
    with pytest.raises(ValueError, match="the validation split .* fewer than the 2 processes"):
        make_val_loader(data, batch_size=len(dataset), world_size=2)


@pytest.mark.parametrize("max_samples", [5, 7])
def test_val_loader_scores_the_same_blocks_for_any_batch_size_and_process_count(stdlib_small, max_samples):
    """Validation scores the first max_samples blocks, whatever the micro-batch size and the number of processes:
    rank r's batches are r, r + world_size, ... of one sequence of batches of consecutive blocks."""
    _, data = stdlib_small
    dataset = PackedLMDataset(data.val_path, data.seq_len)
    assert len(dataset) > max_samples + 2
    expected = torch.stack([dataset[i][0] for i in range(max_samples)])  # (max_samples, seq_len)
    for batch_size in (1, 2, 3, 4, 8):
        for world_size in (1, 2, 3):
            n_batches = math.ceil(max_samples / batch_size)
            if n_batches < world_size:
                with pytest.raises(ValueError, match=f"fewer than the {world_size} processes"):
                    make_val_loader(data, batch_size, max_samples, rank=0, world_size=world_size)
                continue
            per_rank = [[x for x, _ in make_val_loader(data, batch_size, max_samples, rank=r, world_size=world_size)]
                        for r in range(world_size)]
            in_order = [per_rank[b % world_size][b // world_size] for b in range(n_batches)]
            assert torch.equal(torch.cat(in_order), expected), (batch_size, world_size)


def test_loaders_leave_the_global_rng_alone(stdlib_small):
    # resuming restores the global RNG (dropout) from a checkpoint; starting a loader must not draw from it
    _, data = stdlib_small
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(iter(make_train_loader(data, batch_size=2, start_batch=5)))
    for _ in range(2):
        next(iter(make_val_loader(data, batch_size=2)))
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


# ---- config ----------------------------------------------------------------------------------------------------

def test_config_is_a_structured_schema_and_validates(monkeypatch, tmp_path):
    schema = OmegaConf.structured(LMDataConfig)
    assert OmegaConf.to_object(OmegaConf.merge(schema, {"seq_len": 256})).seq_len == 256
    with pytest.raises(ConfigKeyError, match="vocab_sise"):
        OmegaConf.merge(schema, {"vocab_sise": 1})
    for bad in ({"val_fraction": 1.0}, {"vocab_size": 100}, {"seq_len": 0}, {"num_proc": 0}, {"max_bytes": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LMDataConfig(**bad)
    monkeypatch.setenv("FLASHTRAIN_CACHE_DIR", str(tmp_path))
    assert resolve_cache_dir(LMDataConfig().cache_dir) == tmp_path
    assert resolve_cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"  # an explicit value wins
