"""Language-model data: corpus -> byte-level BPE -> flat token files -> packed blocks -> resumable batches.

`prepare_lm_data(cfg)` runs once per corpus/tokenizer/split and caches everything under `cfg.cache_dir`:

    <cache_dir>/tokenizers/bpe-<key>/tokenizer.json   BPE trained on the train split (when tokenizer_path is None)
    <cache_dir>/tokens/<key>/train.bin, val.bin       every document's tokens followed by EOS, concatenated,
                                                      uint16 (uint32 when the vocabulary exceeds 65536)
    <cache_dir>/tokens/<key>/meta.json                vocab_size, eos_id, dtype, token and document counts
    <cache_dir>/hf_datasets/                          `datasets`' Arrow copy of local corpus files and streamed
                                                      Hub rows

Each key hashes everything that changes the bytes it names, so a second call with the same config is a cache hit
that reads no text; each directory is written under a temporary name and renamed into place, so a crash or a
concurrent writer never leaves a half-written cache behind.

Training reads the token file as non-overlapping blocks of seq_len + 1 tokens (`PackedLMDataset`), in an order that
is a pure function of (seed, epoch, rank) and can start at any batch (`ResumableBatchSampler`), so a resumed run
sees exactly the batches an uninterrupted one would.

Document-aware packing (both off by default; batches are then (x, y)). A block holds the end of one document, whole
documents and the start of another, each ended by EOS. `data.document_mask=true` keeps attention inside each of them:
the loader's collate function finds the documents of the batch on the host (a new one starts at each block's first
token and after each EOS: `document_offsets`) and hands the model their cu_seqlens, so attention runs through the
varlen API on the packed B * T tokens (no padding, no host sync in the step). `data.reset_positions=true` restarts
the position ids at each document start. Batches are then dicts {"input_ids", "targets"[, "cu_seqlens"]
[, "position_ids"]}, the model's keyword arguments.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from flashtrain.data.cache import DEFAULT_CACHE_DIR, resolve_cache_dir, write_token_files
from flashtrain.data.corpus import Corpus, fingerprint, open_corpus, warn_skipped
from flashtrain.data.samplers import ResumableBatchSampler, ordered_batches
from flashtrain.data.task import DataSpec, Task, check_processes, check_val_samples
from flashtrain.data.tokenizer import (bpe_as_hf_tokenizer, eos_id, encode_ordinary, load_tokenizer, save_tokenizer,
                                       tokenizer_fingerprint, train_bpe)
from flashtrain.kernels import check_cu_seqlens
from flashtrain.models.gpt2 import SAMPLING

logger = logging.getLogger(__name__)

# bump when the layout or content of the cached files changes: old caches are then ignored, never misread
CACHE_FORMAT_VERSION = 1
SPLITS = ("train", "val")


@dataclass
class LMDataConfig:
    # "stdlib" (this Python's .py sources) | a .txt/.jsonl/.parquet file, directory or glob | "hf:NAME[:CONFIG]"
    corpus: str = "stdlib"
    text_field: str = "text"  # the text column of .jsonl/.parquet/Hub corpora
    streaming: bool = False  # Hub corpora: read rows in order up to max_bytes instead of downloading the whole dataset
    max_bytes: int = 8_000_000  # cap on the raw UTF-8 corpus, documents taken in order; 0: no cap
    # tokenizer.json, or a directory with it or with GPT-2's vocab.json + merges.txt; None: train a BPE (cached)
    tokenizer_path: Optional[str] = None
    vocab_size: int = 8192  # size of the BPE trained when tokenizer_path is None
    seq_len: int = 1024  # tokens per training sequence
    val_fraction: float = 0.02  # share of documents held out for validation (whole documents, chosen by seed)
    seed: int = 1234  # seeds the train/val document split and the order of training batches
    num_proc: int = 2  # processes that tokenize the corpus
    cache_dir: str = DEFAULT_CACHE_DIR  # tokenizers and token files; left at the default, $FLASHTRAIN_CACHE_DIR wins
    num_workers: int = 0  # DataLoader worker processes (blocks are memmap slices: 0 is usually fast enough)
    sample_tokens: int = 120  # length of the text generated at the end of a run (0: none)
    sample_prompt: str = "def "  # prompt of that text
    # validation passes score the first val_samples sequences of the val split, for any micro-batch size and process
    # count (null: the whole split)
    val_samples: Optional[int] = 160
    # attention stays inside each document of a packed block (varlen attention, cu_seqlens from the EOS tokens); the
    # model's attn_impl must run packed inputs (flash, reference; auto where the CUDA kernel runs)
    document_mask: bool = False
    reset_positions: bool = False  # position ids restart at 0 at each document start (the token after an EOS)

    def build(self) -> "LMTask":
        """Prepare the data (or find it in the cache) and return its task."""
        return LMTask(self)

    def preview(self) -> DataSpec:
        """What build() provides, known without preparing the data: tokenizer_path's vocabulary (loaded, not trained),
        or data.vocab_size, the most a BPE trained here can have."""
        vocab_size = self.vocab_size if self.tokenizer_path is None else \
            load_tokenizer(Path(self.tokenizer_path).expanduser()).get_vocab_size(with_added_tokens=True)
        return DataSpec("causal_lm", vocab_size, self.seq_len, "data.seq_len", document_mask=self.document_mask)

    def __post_init__(self) -> None:
        if self.sample_tokens < 0:
            raise ValueError(f"data.sample_tokens must be >= 0, got {self.sample_tokens}")
        if not self.corpus:
            raise ValueError("data.corpus must name a corpus, got an empty string")
        if self.max_bytes < 0:
            raise ValueError(f"data.max_bytes must be >= 0 (0: no cap), got {self.max_bytes}")
        if self.vocab_size < 257:
            raise ValueError(f"data.vocab_size must be >= 257 (256 bytes + EOS), got {self.vocab_size}")
        if self.seq_len < 1:
            raise ValueError(f"data.seq_len must be >= 1, got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        check_processes(self.num_proc, self.num_workers)
        check_val_samples(self.val_samples)


@dataclass
class LMData:
    """A prepared corpus: where its token files are and how to read them."""

    train_path: Path  # flat token file of the training documents
    val_path: Path  # flat token file of the validation documents
    tokenizer: Tokenizer = field(repr=False)
    tokenizer_path: Path
    vocab_size: int  # tokenizer vocabulary, special tokens included; the model's vocab_size must be >= this
    eos_id: int  # ends every document in the token files
    seq_len: int  # tokens per training sequence (cfg.seq_len)
    seed: int  # seeds the batch order (cfg.seed)
    n_train_tokens: int
    n_val_tokens: int
    description: str  # the corpus, for messages


def split_documents(n_documents: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) document indices, each sorted: val is round(n * val_fraction) documents (at least 1 when
    val_fraction > 0) drawn by a permutation seeded with `seed`, so the split is fixed for a given seed."""
    n_val = round(n_documents * val_fraction)
    if val_fraction > 0:
        n_val = max(n_val, 1)
    if n_val >= n_documents:
        raise ValueError(f"val_fraction={val_fraction} of {n_documents} documents leaves no training document; "
                         f"lower val_fraction or use a corpus with more documents (a .txt file is one document)")
    order = np.random.default_rng(seed).permutation(n_documents)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def prepare_lm_data(cfg: LMDataConfig) -> LMData:
    """Tokenize `cfg.corpus` into train/val token files, or find them in the cache. Run it on one process first
    (e.g. under `accelerator.main_process_first()`) so the others hit the cache."""
    start = time.perf_counter()
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    corpus = open_corpus(cfg.corpus, cfg.text_field, cfg.max_bytes, hf_cache_dir=cache_dir / "hf_datasets",
                         streaming=cfg.streaming)
    documents = None  # read only on a cache miss

    if cfg.tokenizer_path is None:
        bpe_key = fingerprint({"version": CACHE_FORMAT_VERSION, "corpus": corpus.identity, "vocab_size": cfg.vocab_size,
                               "val_fraction": cfg.val_fraction, "seed": cfg.seed})
        tokenizer_path = cache_dir / "tokenizers" / f"bpe-{bpe_key[:16]}" / "tokenizer.json"
        if not tokenizer_path.is_file():
            documents = corpus.documents()
            train_idx, _ = split_documents(len(documents), cfg.val_fraction, cfg.seed)
            train_texts = documents.select(train_idx)
            logger.info("training a %d-token byte-level BPE on %d documents of %s", cfg.vocab_size, len(train_texts),
                        corpus.description)
            tokenizer = train_bpe((t for batch in train_texts.iter(batch_size=256) for t in batch["text"]),
                                  cfg.vocab_size, length=len(train_texts))
            save_tokenizer(tokenizer, tokenizer_path)
    else:
        tokenizer_path = Path(cfg.tokenizer_path).expanduser()
    tokenizer = load_tokenizer(tokenizer_path)

    tokens_key = fingerprint({"version": CACHE_FORMAT_VERSION, "corpus": corpus.identity,
                              "tokenizer": tokenizer_fingerprint(tokenizer), "val_fraction": cfg.val_fraction,
                              "seed": cfg.seed})
    tokens_dir = cache_dir / "tokens" / tokens_key[:16]
    if (tokens_dir / "meta.json").is_file():
        logger.info("token cache hit: %s", tokens_dir)
        warn_skipped(cfg.corpus, json.loads((tokens_dir / "meta.json").read_text()).get("skipped_files", []),
                     cached=True)
    else:
        if documents is None:
            documents = corpus.documents()
        _tokenize_documents(corpus, documents, tokenizer, tokenizer_path, cfg, tokens_dir)
    meta = json.loads((tokens_dir / "meta.json").read_text())
    logger.info("%s: %d train / %d val tokens, vocab %d (%.1f s)", corpus.description, meta["n_tokens"]["train"],
                meta["n_tokens"]["val"], meta["vocab_size"], time.perf_counter() - start)
    return LMData(
        train_path=tokens_dir / "train.bin",
        val_path=tokens_dir / "val.bin",
        tokenizer=tokenizer,
        tokenizer_path=tokenizer_path,
        vocab_size=meta["vocab_size"],
        eos_id=meta["eos_id"],
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        n_train_tokens=meta["n_tokens"]["train"],
        n_val_tokens=meta["n_tokens"]["val"],
        description=f"corpus={cfg.corpus!r} ({meta['corpus_description']})",
    )


def _tokenize_documents(corpus: Corpus, documents, tokenizer: Tokenizer, tokenizer_path: Path, cfg: LMDataConfig,
                        tokens_dir: Path) -> None:
    """Tokenize `documents` (a Dataset with column "text") and publish train.bin, val.bin, meta.json in tokens_dir."""
    tokenized = documents.map(
        _tokenize_batch,
        batched=True,
        batch_size=256,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        remove_columns=documents.column_names,
        fn_kwargs={"tokenizer": tokenizer, "eos_id": eos_id(tokenizer)},
        desc="tokenizing",
    )
    split_indices = dict(zip(SPLITS, split_documents(len(tokenized), cfg.val_fraction, cfg.seed)))
    write_token_files(tokenized, split_indices, tokenizer.get_vocab_size(with_added_tokens=True), tokens_dir, {
        "eos_id": eos_id(tokenizer), "tokenizer_path": str(tokenizer_path), "corpus": corpus.spec,
        "corpus_description": corpus.description, "val_fraction": cfg.val_fraction, "seed": cfg.seed,
        "skipped_files": corpus.skipped})


def _tokenize_batch(batch: dict, tokenizer: Tokenizer, eos_id: int) -> dict:
    ids = [np.array(doc + [eos_id], dtype=np.int32) for doc in encode_ordinary(tokenizer, batch["text"])]
    return {"ids": ids, "n_tokens": [len(doc) for doc in ids]}


# ---- serving ---------------------------------------------------------------------------------------------------

class PackedLMDataset(Dataset):
    """Block i of a flat token file: x = tokens[i*L : i*L + L], y = tokens[i*L + 1 : i*L + L + 1] (L = seq_len).

    Blocks do not overlap (consecutive blocks share only the one token that is y's last and the next x's first)
    and ignore document boundaries: EOS inside a block is what tells the model a document ended. The tail that
    does not fill a block is dropped. `dtype` defaults to the one in the meta.json next to the file.
    """

    def __init__(self, tokens_path: str | os.PathLike, seq_len: int, dtype: Optional[str] = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens_path = Path(tokens_path)
        self.seq_len = seq_len
        if dtype is None:
            dtype = json.loads((self.tokens_path.parent / "meta.json").read_text())["dtype"]
        self.dtype = np.dtype(dtype)
        n_tokens = self.tokens_path.stat().st_size // self.dtype.itemsize
        self.n_blocks = max(n_tokens - 1, 0) // seq_len
        if self.n_blocks == 0:
            raise ValueError(f"{self.tokens_path} holds {n_tokens} tokens, not one block of seq_len + 1 = "
                             f"{seq_len + 1}: lower seq_len or use more data")
        self._tokens = None  # opened on first use, in each DataLoader worker (a memmap must not be pickled)

    def __len__(self) -> int:
        return self.n_blocks

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n_blocks:
            raise IndexError(f"block {index} out of range [0, {self.n_blocks})")
        if self._tokens is None:
            self._tokens = np.memmap(self.tokens_path, dtype=self.dtype, mode="r")
        start = index * self.seq_len
        block = torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))  # (seq_len + 1,)
        return block[:-1], block[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def document_offsets(input_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """input_ids (B, T) packed blocks -> (cu_seqlens (n + 1,) int32, position_ids (B, T) int64): the n documents of
    the flattened B * T tokens and each token's position in its document. A document starts at each block's first
    token and at each token after an EOS (the EOS ends the document before it); one cut by a block's end continues
    in the next block as a new sequence. Call it on the loader's CPU batch: no device sync."""
    B, T = input_ids.shape
    starts = torch.ones(B, T, dtype=torch.bool)  # (B, T): True where a document starts
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    cu_seqlens = F.pad(torch.nonzero(starts.flatten()).flatten().to(torch.int32), (0, 1), value=B * T)  # (n + 1,)
    index = torch.arange(T).expand(B, T)  # (B, T)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values  # (B, T): where each token's document starts
    return cu_seqlens, index - last_start


def collate_documents(samples: list[tuple[Tensor, Tensor]], eos_id: int, document_mask: bool,
                      reset_positions: bool) -> dict[str, Tensor]:
    """collate_fn of document-aware packing: the stacked (x, y) as {"input_ids", "targets"} plus "cu_seqlens"
    (document_mask) and "position_ids" (reset_positions) from document_offsets, built here on the host (cu_seqlens
    checked there too: flashtrain.kernels.check_cu_seqlens)."""
    input_ids = torch.stack([x for x, _ in samples])  # (B, T)
    batch = {"input_ids": input_ids, "targets": torch.stack([y for _, y in samples])}
    cu_seqlens, position_ids = document_offsets(input_ids, eos_id)
    if document_mask:  # checked on the host: on the GPU a bad one is a device-side assert that ends the process
        # (B * T packed rows; the model passes max_seqlen = T)
        check_cu_seqlens(cu_seqlens, input_ids.numel(), input_ids.shape[1], name="cu_seqlens")
        batch["cu_seqlens"] = cu_seqlens
    if reset_positions:
        batch["position_ids"] = position_ids
    return batch


def shard_lm_batch(batch, positions: Tensor) -> dict[str, Tensor]:
    """One context-parallel process's part of a batch (parallel.context > 1, flashtrain.parallel.context): the
    sequence positions `positions` ((T / N,) int64, the global positions the process holds in its local order) of
    input_ids, targets and position_ids, as the dict of the model's keyword arguments. The position ids are those
    positions, or the document-reset ones there (data.reset_positions); cu_seqlens (data.document_mask) stays that of
    the full sequences, for ring attention's document masks. (x, y) batches become dicts."""
    if not isinstance(batch, dict):
        batch = {"input_ids": batch[0], "targets": batch[1]}
    B = batch["input_ids"].shape[0]
    shard = {key: value[:, positions] for key, value in batch.items() if key != "cu_seqlens"}  # each (B, T / N)
    if "position_ids" not in shard:
        shard["position_ids"] = positions.expand(B, -1).contiguous()
    if "cu_seqlens" in batch:
        shard["cu_seqlens"] = batch["cu_seqlens"]
    return shard


def make_train_loader(data: LMData, batch_size: int, rank: int = 0, world_size: int = 1, start_batch: int = 0,
                      num_workers: int = 0, accum_steps: int = 1, collate_fn=None) -> DataLoader:
    """Endless (x, y) batches of (batch_size, seq_len) int64 from the train split, for this rank, starting after
    `start_batch` of this rank's batches (count micro-batches, not optimizer steps); accum_steps micro-batches per
    process make one optimizer step. collate_fn: None, or collate_documents with its settings bound."""
    dataset = PackedLMDataset(data.train_path, data.seq_len)
    sampler = ResumableBatchSampler(len(dataset), batch_size, data.seed, rank, world_size, start_batch, accum_steps)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_fn,
                      pin_memory=torch.cuda.is_available(), generator=_loader_generator(data.seed))


def make_val_loader(data: LMData, batch_size: int, max_samples: Optional[int] = None, rank: int = 0,
                    world_size: int = 1, num_workers: int = 0, collate_fn=None) -> DataLoader:
    """The first `max_samples` blocks of the validation split (None: all), in file order, the same every pass: batch
    b holds blocks [b * batch_size, (b + 1) * batch_size) (the last may be short), dealt round-robin over ranks
    (rank r gets batches r, r + world_size, ...): the same blocks for any batch size and number of ranks."""
    dataset = PackedLMDataset(data.val_path, data.seq_len)
    batches = ordered_batches(len(dataset), batch_size, rank, world_size, max_samples,
                              what=f"the validation split (blocks of seq_len={data.seq_len} tokens)")
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers, collate_fn=collate_fn,
                      pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
                      generator=_loader_generator(data.seed))


def _loader_generator(seed: int) -> torch.Generator:
    """A DataLoader draws its workers' base seed each time it is iterated, from the global torch RNG unless given
    a generator: that draw would shift dropout masks between a resumed run and an uninterrupted one."""
    return torch.Generator().manual_seed(seed)


# ---- the task ----------------------------------------------------------------------------------------------------

class LMTask(Task):
    """Next-token prediction on packed blocks of a token file (GPT-style): batches (x, y) (B, seq_len) int64, or
    with document-aware packing the dicts of collate_documents. Metrics: val_loss (mean cross-entropy per token) and
    val_ppl."""

    def __init__(self, cfg: LMDataConfig):
        self.cfg, self.val_samples = cfg, cfg.val_samples
        self.data = prepare_lm_data(cfg)
        block = cfg.seq_len + 1
        for split, n_tokens, knob in (("training", self.data.n_train_tokens, "1 - data.val_fraction"),
                                      ("validation", self.data.n_val_tokens, "data.val_fraction")):
            if n_tokens < block:
                raise ValueError(f"{self.data.description}: the {split} split holds {n_tokens} tokens, fewer than one "
                                 f"sequence of data.seq_len + 1 = {block}; every run needs a training and a validation "
                                 f"sequence: use a larger corpus (data.max_bytes, data.corpus), a smaller "
                                 f"data.seq_len, or change {knob}")
        self.spec = DataSpec("causal_lm", self.data.vocab_size, self.data.seq_len, "data.seq_len",
                             document_mask=cfg.document_mask)
        self.collate_fn = None  # default collation: (x, y)
        if cfg.document_mask or cfg.reset_positions:
            self.collate_fn = functools.partial(collate_documents, eos_id=self.data.eos_id,
                                                document_mask=cfg.document_mask, reset_positions=cfg.reset_positions)

    def train_loader(self, batch_size, rank, world_size, start_batch, accum_steps=1):
        return make_train_loader(self.data, batch_size, rank=rank, world_size=world_size, start_batch=start_batch,
                                 num_workers=self.cfg.num_workers, accum_steps=accum_steps, collate_fn=self.collate_fn)

    def eval_loader(self, split, batch_size, rank=0, world_size=1, max_samples=None):
        if split != "val":
            raise ValueError(f"split: language-model data has a val split only, got {split!r}")
        return make_val_loader(self.data, batch_size, max_samples=max_samples, rank=rank, world_size=world_size,
                               collate_fn=self.collate_fn)

    @staticmethod
    def _forward(model, batch) -> tuple[Tensor, Tensor]:
        """(logits, mean loss) of a batch: (x, y), or collate_documents' dict of the model's keyword arguments."""
        return model(**batch) if isinstance(batch, dict) else model(*batch)

    @staticmethod
    def _targets(batch) -> Tensor:
        return batch["targets"] if isinstance(batch, dict) else batch[1]

    def loss(self, model, batch) -> Tensor:
        return self._forward(model, batch)[1]

    def loss_count(self, batch) -> int:
        return self._targets(batch).numel()  # packed blocks: every target token is predicted

    def eval_sums(self, model, batch) -> dict[str, Tensor]:
        n_targets = self._targets(batch).numel()
        return {"loss": self._forward(model, batch)[1].float() * n_targets, "tokens": torch.tensor(float(n_targets))}

    def eval_metrics(self, sums):
        val_loss = sums["loss"] / sums["tokens"]
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def tokens(self, batch) -> int:
        return self._targets(batch).numel()

    def hf_tokenizer(self):
        return bpe_as_hf_tokenizer(self.data.tokenizer)

    @torch.no_grad()
    def sample(self, model, device, seed) -> str:
        """data.sample_tokens tokens generated after data.sample_prompt ("" when sample_tokens is 0), sampled as
        `python -m flashtrain.generate` samples (flashtrain.models.gpt2.SAMPLING)."""
        if self.cfg.sample_tokens == 0:
            return ""
        model.eval()  # no dropout while sampling
        ids = self.data.tokenizer.encode(self.cfg.sample_prompt).ids or [self.data.eos_id]
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        out = model.generate(idx, max_new_tokens=self.cfg.sample_tokens, generator=generator, **SAMPLING)
        return self.data.tokenizer.decode(out[0].tolist())
