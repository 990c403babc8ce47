"""Long documents for LM data (long-context training): the python-site corpus, and document-aware packing
(data.document_mask, data.reset_positions) checked against running each document of a packed block on its own."""

import hashlib
import json

import numpy as np
import pytest
import torch

from flashtrain.data import corpus as corpus_module
from flashtrain.data.corpus import open_corpus, python_site_roots
from flashtrain.data.lm import LMDataConfig, collate_documents, document_offsets, prepare_lm_data
from flashtrain.data.task import DataSpec
from flashtrain.models.gpt2 import GPT2Config

EOS = 0

# ---- the python-site corpus --------------------------------------------------------------------------------------

LIB_FILES = {  # a fake standard library and site-packages: path -> bytes
    "lib/os.py": b"import sys\n\ndef walk(top):\n    return top\n",
    "lib/json/__init__.py": b"",  # blank: left out
    "lib/json/decoder.py": b"class JSONDecoder:\n    pass\n",
    "lib/legacy.py": "# coding: latin-1\nname = 'caf\xe9'\n".encode("latin-1"),  # not UTF-8: left out
    "lib/__pycache__/os.cpython-311.py": b"cached = True\n",  # never read
    "site/torch/nn.py": b"class Module:\n    def forward(self, x):\n        return x\n" * 3,
    "site/vendored/decoder.py": b"class JSONDecoder:\n    pass\n",  # the same content as lib/json/decoder.py
    "site/pkg/data.txt": b"not python",
}


@pytest.fixture()
def fake_site(tmp_path, monkeypatch):
    for name, content in LIB_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    monkeypatch.setattr(corpus_module, "python_site_roots", lambda: [tmp_path / "lib", tmp_path / "site"])
    return tmp_path


def test_python_site_is_every_distinct_py_file_in_content_hash_order(fake_site):
    kept = [LIB_FILES[name] for name in ("lib/os.py", "lib/json/decoder.py", "site/torch/nn.py")]
    kept.sort(key=lambda content: hashlib.sha256(content).hexdigest())
    corpus = open_corpus("python-site", max_bytes=0)
    assert "6 .py files" in corpus.description  # before deduplication; __pycache__ and data.txt not counted
    assert corpus.documents()["text"] == [content.decode() for content in kept]


def test_python_site_cap_cuts_the_documents_in_their_order(fake_site):
    texts = open_corpus("python-site", max_bytes=0).documents()["text"]
    cap = len(texts[0]) + 10
    assert open_corpus("python-site", max_bytes=cap).documents()["text"] == [texts[0], texts[1][:10]]


def test_python_site_identity_follows_the_files(fake_site):
    before = open_corpus("python-site", max_bytes=0).identity
    assert open_corpus("python-site", max_bytes=0).identity == before
    assert open_corpus("python-site", max_bytes=100).identity != before
    (fake_site / "site/torch/optim.py").write_text("lr = 0.1\n")
    assert open_corpus("python-site", max_bytes=0).identity != before


def test_python_site_splits_train_and_validation_by_whole_documents(fake_site, tmp_path):
    for i in range(20):  # more documents, so that a 20% split holds several
        (fake_site / f"site/pkg/module_{i}.py").write_text(f"def f_{i}(x):\n    return x * {i}\n")
    cfg = LMDataConfig(corpus="python-site", max_bytes=0, vocab_size=300, val_fraction=0.2, seq_len=8, num_proc=1,
                       cache_dir=str(tmp_path / "cache"))
    data = prepare_lm_data(cfg)
    meta = json.loads((data.train_path.parent / "meta.json").read_text())
    n_eos = {split: int((np.fromfile(path, dtype=meta["dtype"]) == data.eos_id).sum())
             for split, path in (("train", data.train_path), ("val", data.val_path))}
    assert n_eos == {"train": 18, "val": 5}  # 23 distinct documents, round(23 * 0.2) = 5 held out, each whole
    other_seed = prepare_lm_data(LMDataConfig(**{**cfg.__dict__, "seed": 7}))
    assert not np.array_equal(np.fromfile(other_seed.val_path, dtype=meta["dtype"]),
                              np.fromfile(data.val_path, dtype=meta["dtype"]))


def test_python_site_roots_hold_the_standard_library_once():
    import sysconfig
    from pathlib import Path

    roots = python_site_roots()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert any(root == stdlib or root in stdlib.parents for root in roots)
    assert not any(a != b and a in b.parents for a in roots for b in roots)  # none inside another


# ---- document-aware packing --------------------------------------------------------------------------------------

def test_document_offsets_split_at_block_starts_and_after_eos():
    input_ids = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4],
                              [EOS, 3, 3, 3, 3, EOS, EOS, 2]])
    cu_seqlens, position_ids = document_offsets(input_ids, EOS)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 3, 7, 8, 9, 14, 15, 16]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0],
                                     [0, 0, 1, 2, 3, 4, 0, 0]]


def tiny_gpt2(n_positions=32) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2, attn_impl="reference")
    return config.build().eval()


def per_document_logits(model, input_ids: torch.Tensor, reset_positions: bool) -> torch.Tensor:
    """The reference: every document of every block run through the model alone, at position 0 (reset_positions)
    or at its positions in the block."""
    rows = []
    for block in input_ids:
        starts = [0] + [t + 1 for t in range(len(block) - 1) if block[t] == EOS] + [len(block)]
        pieces = []
        for start, end in zip(starts, starts[1:]):
            positions = torch.arange(end - start) if reset_positions else torch.arange(start, end)
            positions = positions.to(block.device)
            pieces.append(model(block[None, start:end], position_ids=positions[None])[0][0])
        rows.append(torch.cat(pieces))
    return torch.stack(rows)  # (B, T, vocab)


def packed_block(seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks of 24 tokens: documents of 1, 5, 11, 7 and 24 tokens (a block's end cuts some)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 50, (2, 25), generator=generator)
    for t in (0, 5, 16):
        x[0, t] = EOS
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("reset_positions", [False, True])
def test_document_mask_logits_equal_each_document_run_alone(reset_positions):
    model = tiny_gpt2()
    x, y = packed_block()
    batch = collate_documents(list(zip(x, y)), EOS, document_mask=True, reset_positions=reset_positions)
    assert batch["cu_seqlens"].tolist() == [0, 1, 6, 17, 24, 48]
    with torch.no_grad():
        packed, loss = model(**batch)
        reference = per_document_logits(model, x, reset_positions)
        unmasked = model(x)[0]
    assert (packed - reference).abs().max().item() < 1e-5
    # the mask matters: without it, every document after the first sees the ones before it
    assert (unmasked - reference)[0, 1:].abs().amax(dim=-1).min().item() > 1e-3
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(reference.flatten(0, 1), y.flatten()),
                               rtol=0, atol=1e-6)


def test_reset_positions_alone_changes_positions_not_attention():
    model = tiny_gpt2()
    x, y = packed_block()
    batch = collate_documents(list(zip(x, y)), EOS, document_mask=False, reset_positions=True)
    assert set(batch) == {"input_ids", "targets", "position_ids"}
    with torch.no_grad():
        logits = model(**batch)[0]
        # the second block has one document: positions 0..23 are its indices, so nothing changes there
        torch.testing.assert_close(logits[1], model(x)[0][1], rtol=0, atol=1e-6)
        assert (logits[0, 1:] - model(x)[0][0, 1:]).abs().max().item() > 1e-3


def test_document_mask_gradients_equal_the_per_document_ones():
    x, y = packed_block(seed=2)
    grads = []
    for packed in (True, False):
        model = tiny_gpt2().train()
        if packed:
            batch = collate_documents(list(zip(x, y)), EOS, document_mask=True, reset_positions=True)
            loss = model(**batch)[1]
        else:
            logits = per_document_logits(model, x, reset_positions=True)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max().item() < 1e-5


def test_lm_task_serves_document_batches(tmp_path):
    cfg = LMDataConfig(corpus="stdlib", max_bytes=60_000, vocab_size=300, val_fraction=0.2, seq_len=64, num_proc=1,
                       cache_dir=str(tmp_path), document_mask=True, reset_positions=True, val_samples=4)
    task = cfg.build()
    assert task.spec.document_mask
    batch = next(iter(task.train_loader(4, 0, 1, 0)))
    x = batch["input_ids"]
    n_documents = 4 + int((x[:, :-1] == task.data.eos_id).sum())
    assert batch["cu_seqlens"].shape == (n_documents + 1,) and batch["cu_seqlens"][-1] == 4 * 64
    assert batch["position_ids"].max() < 64
    model = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2, attn_impl="reference").build()
    sums = task.eval_sums(model, next(iter(task.eval_loader("val", 4))))
    assert sums["tokens"].item() == 4 * 64 and np.isfinite(sums["loss"].item())
    assert task.tokens(batch) == task.loss_count(batch) == 4 * 64


def test_document_mask_with_sdpa_stops_at_the_data_check():
    spec = DataSpec("causal_lm", 300, 64, "data.seq_len", document_mask=True)
    GPT2Config(vocab_size=300, n_positions=64, attn_impl="auto").check_data(spec)
    with pytest.raises(ValueError, match="document_mask=true .* attn_impl=sdpa"):
        GPT2Config(vocab_size=300, n_positions=64, attn_impl="sdpa").check_data(spec)


@pytest.mark.cuda
def test_document_mask_through_the_cuda_kernel_matches_each_document_alone():
    """The CUDA varlen kernel in bf16 on a packed block (documents of 1, 17, 97 and 397 tokens, then one that fills
    the second block): its error against the fp32 per-document reference is at most twice the error of the same
    per-document runs in bf16."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_positions=512, n_embd=128, n_layer=2, n_head=2, attn_impl="flash")
    model = config.build().cuda().eval()
    x = torch.randint(1, 50, (2, 512))
    for t in (0, 17, 114):
        x[0, t] = EOS
    batch = {key: value.cuda() for key, value in
             collate_documents(list(zip(x, x)), EOS, document_mask=True, reset_positions=True).items()}
    del batch["targets"]

    def use(attn_impl):
        for block in model.transformer.h:
            block.attn.attn_impl = attn_impl

    with torch.no_grad():
        use("sdpa")  # the per-document runs, in fp32 (the reference) and in bf16 (the precision the kernel is held to)
        reference = per_document_logits(model, x.cuda(), reset_positions=True)
        with torch.autocast("cuda", torch.bfloat16):
            bf16_alone = per_document_logits(model, x.cuda(), reset_positions=True).float()
            use("flash")
            packed = model(**batch)[0].float()
    assert (packed - reference).abs().max().item() <= 2 * (bf16_alone - reference).abs().max().item() + 1e-3
