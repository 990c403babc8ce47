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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from flashtrain.data.cache import publish_dir
from flashtrain.data.corpus import Corpus, fingerprint, open_corpus
from flashtrain.data.tokenizer import (eos_id, encode_ordinary, load_tokenizer, save_tokenizer, tokenizer_fingerprint,
                                       train_bpe)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/flashtrain"
CACHE_ENV_VAR = "FLASHTRAIN_CACHE_DIR"
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

    def __post_init__(self) -> None:
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
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc must be >= 1, got {self.num_proc}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")


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


def resolve_cache_dir(cache_dir: str) -> Path:
    """`cache_dir`, except that the default gives way to $FLASHTRAIN_CACHE_DIR when that is set."""
    if cache_dir == DEFAULT_CACHE_DIR and os.environ.get(CACHE_ENV_VAR):
        cache_dir = os.environ[CACHE_ENV_VAR]
    return Path(cache_dir).expanduser()


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
    else:
        if documents is None:
            documents = corpus.documents()
        write_token_files(corpus, documents, tokenizer, tokenizer_path, cfg, tokens_dir)
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
    )


def write_token_files(corpus: Corpus, documents, tokenizer: Tokenizer, tokenizer_path: Path, cfg: LMDataConfig,
                      tokens_dir: Path) -> None:
    """Tokenize `documents` (a Dataset with column "text") and publish train.bin, val.bin, meta.json in tokens_dir."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    tokenized = documents.map(
        _tokenize_batch,
        batched=True,
        batch_size=256,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        remove_columns=documents.column_names,
        fn_kwargs={"tokenizer": tokenizer, "eos_id": eos_id(tokenizer)},
        desc="tokenizing",
    )
    split_idx = dict(zip(SPLITS, split_documents(len(tokenized), cfg.val_fraction, cfg.seed)))

    tmp_dir = tokens_dir.with_name(f".{tokens_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a crashed run of this same pid
    tmp_dir.mkdir(parents=True)
    n_tokens = {split: _write_flat(tokenized.select(idx), tmp_dir / f"{split}.bin", dtype)
                for split, idx in split_idx.items()}
    meta = {
        "vocab_size": vocab_size,
        "eos_id": eos_id(tokenizer),
        "dtype": dtype.name,
        "n_tokens": n_tokens,
        "n_documents": {split: len(idx) for split, idx in split_idx.items()},
        "tokenizer_path": str(tokenizer_path),
        "corpus": corpus.spec,
        "corpus_description": corpus.description,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
    }
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    publish_dir(tmp_dir, tokens_dir)


def _tokenize_batch(batch: dict, tokenizer: Tokenizer, eos_id: int) -> dict:
    ids = [np.array(doc + [eos_id], dtype=np.int32) for doc in encode_ordinary(tokenizer, batch["text"])]
    return {"ids": ids, "n_tokens": [len(doc) for doc in ids]}


def _write_flat(tokenized, path: Path, dtype: np.dtype) -> int:
    """Concatenate the "ids" lists of `tokenized`, in order, into a flat file of `dtype`; return the token count."""
    n_tokens = int(np.sum(tokenized.with_format("numpy")["n_tokens"], dtype=np.int64))
    if n_tokens == 0:  # np.memmap cannot map an empty file
        path.write_bytes(b"")
        return 0
    tokens = np.memmap(path, dtype=dtype, mode="w+", shape=(n_tokens,))
    pos = 0
    for batch in tokenized.with_format("arrow").iter(batch_size=1024):
        flat = batch["ids"].combine_chunks().flatten().to_numpy()  # (tokens in this batch,) int32
        tokens[pos:pos + len(flat)] = flat
        pos += len(flat)
    assert pos == n_tokens, (pos, n_tokens)
    tokens.flush()
    del tokens
    return n_tokens


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


class ResumableBatchSampler(Sampler[list[int]]):
    """Endless batches of sample indices for one rank, resumable at any batch without replaying the ones before.

    Epoch e shuffles all samples with a torch.Generator seeded from (seed, e). Each step of an epoch takes the next
    batch_size * world_size indices of that permutation, and rank r gets the r-th batch_size of them, so ranks are
    disjoint; the remainder that does not fill a step is dropped (every rank sees full batches, the same number).
    `start_batch` counts this rank's batches already consumed: the sampler jumps straight to epoch
    start_batch // batches_per_epoch at that offset. Resuming with a different world_size gives a different order.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 start_batch: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if num_samples < batch_size * world_size:
            raise ValueError(f"num_samples={num_samples} is fewer than batch_size * world_size = "
                             f"{batch_size * world_size}: not one full step of data")
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.batches_per_epoch = num_samples // (batch_size * world_size)

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        """(num_samples,) int64: the shuffled sample order of `epoch`, the same on every rank."""
        # one 63-bit seed per (seed, epoch) pair: no two pairs share a stream, unlike seed + epoch
        digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, first_step = divmod(self.start_batch, self.batches_per_epoch)
        while True:
            order = self.epoch_permutation(epoch)
            for step in range(first_step, self.batches_per_epoch):
                start = (step * self.world_size + self.rank) * self.batch_size
                yield order[start:start + self.batch_size].tolist()
            epoch, first_step = epoch + 1, 0


def make_train_loader(data: LMData, batch_size: int, rank: int = 0, world_size: int = 1, start_batch: int = 0,
                      num_workers: int = 0) -> DataLoader:
    """Endless (x, y) batches of (batch_size, seq_len) int64 from the train split, for this rank, starting after
    `start_batch` of this rank's batches (count micro-batches, not optimizer steps)."""
    dataset = PackedLMDataset(data.train_path, data.seq_len)
    sampler = ResumableBatchSampler(len(dataset), batch_size, data.seed, rank, world_size, start_batch)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      pin_memory=torch.cuda.is_available(), generator=_loader_generator(data.seed))


def make_val_loader(data: LMData, batch_size: int, max_batches: Optional[int] = None, rank: int = 0,
                    world_size: int = 1, num_workers: int = 0) -> DataLoader:
    """The validation split as full batches of consecutive blocks, in file order, the same every pass: batch b
    holds blocks [b * batch_size, (b + 1) * batch_size). The first `max_batches` batches (None: all) are dealt
    round-robin over ranks (rank r gets batches r, r + world_size, ...)."""
    dataset = PackedLMDataset(data.val_path, data.seq_len)
    n_batches = len(dataset) // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    if n_batches < world_size:
        raise ValueError(f"the validation split has {len(dataset)} blocks of seq_len={data.seq_len} tokens: "
                         f"{n_batches} full batches of batch_size={batch_size}, fewer than the {world_size} "
                         f"processes; lower batch_size or seq_len, or raise val_fraction")
    batches = [list(range(b * batch_size, (b + 1) * batch_size)) for b in range(rank, n_batches, world_size)]
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                      pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
                      generator=_loader_generator(data.seed))


def _loader_generator(seed: int) -> torch.Generator:
    """A DataLoader draws its workers' base seed each time it is iterated, from the global torch RNG unless given
    a generator: that draw would shift dropout masks between a resumed run and an uninterrupted one."""
    return torch.Generator().manual_seed(seed)
