"""Generate a procedural classification data set in parallel, once, and serve it from a memory-mapped cache.

The Long Range Arena generators (ListOps, Pathfinder) describe a sample by a pure function

    sample_fn(cfg, split, index, attempt) -> (tokens: uint8 (length,), label: int)

that seeds its own random generator with `sample_seed(cfg.seed, split, index, attempt)`. Sample `index` of a split
therefore does not depend on which process made it, on how the indices were dealt out, or on the split sizes: the
data set is the same for any number of workers, and a smaller data set is a prefix of a larger one. With
`unique=True` a sample whose tokens repeat an earlier one (in any split; splits in the order train, val, test) is
drawn again with attempt + 1, by the parent process, in index order, so that rule is deterministic too.

`build_cached` writes, under <cache_dir>/lra/<task>-<key>/ (key: sha256 of the task name, format version and the
fields of the config that change the data):

    <split>.tokens.bin    every sample's tokens, concatenated, uint8 (ListOps ids < 16, pixels 0-255)
    <split>.offsets.npy   (n + 1,) int64: sample i is tokens[offsets[i]:offsets[i + 1]]
    <split>.labels.npy    (n,) int64
    meta.json             written last: the config, sizes, label counts, generation time

The directory is written under a temporary name and renamed into place, so a crash or a concurrent writer never
leaves a half-written cache behind, and a second call with the same config reads nothing but meta.json.
`TokenClassificationDataset` serves one split as (tokens padded to seq_len, label) from memory maps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from flashtrain.data.cache import publish_dir, resolve_cache_dir
from flashtrain.data.corpus import fingerprint

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
# bump when the layout of the cached files changes: old caches are then ignored, never misread
CACHE_FORMAT_VERSION = 1

SampleFn = Callable[[Any, str, int, int], tuple[np.ndarray, int]]


def sample_seed(seed: int, split: str, index: int, attempt: int = 0) -> int:
    """A 64-bit seed that is a pure function of (seed, split, index, attempt); SeedSequence mixes the four
    numbers so that neighbouring indices get unrelated streams."""
    if seed < 0 or index < 0 or attempt < 0:
        raise ValueError(f"seed, index and attempt must be >= 0, got {seed}, {index}, {attempt}")
    words = np.random.SeedSequence([seed, SPLITS.index(split), index, attempt]).generate_state(2, np.uint32)
    return int(words[0]) << 32 | int(words[1])


def default_num_proc() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class CachedSplits:
    """A generated data set on disk."""

    directory: Path  # <cache_dir>/lra/<task>-<key>
    meta: dict  # meta.json: task, config, sizes, label counts, max_length, generation seconds

    def dataset(self, split: str, seq_len: Optional[int] = None, pad_id: int = 0) -> "TokenClassificationDataset":
        return TokenClassificationDataset(self.directory, split, seq_len, pad_id)


def build_cached(task: str, cfg, sizes: dict[str, int], sample_fn: SampleFn, *, cache_dir: str, num_proc: int,
                 unique: bool, chunk_size: int, key_exclude: tuple[str, ...] = ("num_proc", "cache_dir", "val_samples")
                 ) -> CachedSplits:
    """Generate `sizes[split]` samples of each split with `sample_fn(cfg, split, index, attempt)`, or find them in
    the cache. `cfg` is a dataclass; its fields except `key_exclude` form the cache key. `num_proc` worker
    processes (0: every CPU) each make `chunk_size` consecutive samples at a time; neither changes the result (nor
    does val_samples, how much of the val split a validation pass scores)."""
    if set(sizes) != set(SPLITS) or any(n < 0 for n in sizes.values()):
        raise ValueError(f"sizes must give a count >= 0 for each of {SPLITS}, got {sizes}")
    if num_proc < 0:
        raise ValueError(f"num_proc must be >= 0 (0: every CPU), got {num_proc}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in key_exclude}
    key = fingerprint({"version": CACHE_FORMAT_VERSION, "task": task, "config": config})
    directory = resolve_cache_dir(cache_dir) / "lra" / f"{task}-{key[:16]}"
    if (directory / "meta.json").is_file():
        logger.info("%s cache hit: %s", task, directory)
    else:
        _generate(task, cfg, config, sizes, sample_fn, directory, num_proc or default_num_proc(), unique, chunk_size)
    return CachedSplits(directory, json.loads((directory / "meta.json").read_text()))


def _generate(task: str, cfg, config: dict, sizes: dict[str, int], sample_fn: SampleFn, directory: Path,
              num_proc: int, unique: bool, chunk_size: int) -> None:
    start = time.perf_counter()
    tmp_dir = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a crashed run of this same pid
    tmp_dir.mkdir(parents=True)
    chunks = [(split, lo, min(lo + chunk_size, sizes[split])) for split in SPLITS
              for lo in range(0, sizes[split], chunk_size)]
    jobs = [(sample_fn, cfg, split, lo, hi) for split, lo, hi in chunks]
    seen = set()  # digests of every sample kept so far, when unique
    n_redrawn = 0
    files = {split: open(tmp_dir / f"{split}.tokens.bin", "wb") for split in SPLITS}
    lengths = {split: [] for split in SPLITS}
    labels = {split: [] for split in SPLITS}
    pool = _pool(num_proc) if num_proc > 1 and len(jobs) > 1 else None
    try:
        results = pool.imap(_make_chunk, jobs) if pool is not None else map(_make_chunk, jobs)
        with tqdm(total=sum(sizes.values()), desc=f"generating {task}", unit="sample", dynamic_ncols=True) as bar:
            for (split, lo, _), samples in zip(chunks, results):
                for index, (tokens, label) in enumerate(samples, start=lo):
                    attempt = 0
                    while unique and _digest(tokens) in seen:
                        attempt += 1
                        n_redrawn += 1
                        tokens, label = sample_fn(cfg, split, index, attempt)
                    if unique:
                        seen.add(_digest(tokens))
                    files[split].write(np.ascontiguousarray(tokens, dtype=np.uint8).tobytes())
                    lengths[split].append(len(tokens))
                    labels[split].append(label)
                bar.update(len(samples))
    finally:
        if pool is not None:
            pool.terminate()
        for f in files.values():
            f.close()
    seconds = time.perf_counter() - start
    for split in SPLITS:
        offsets = np.zeros(sizes[split] + 1, dtype=np.int64)
        np.cumsum(lengths[split], out=offsets[1:])
        np.save(tmp_dir / f"{split}.offsets.npy", offsets)
        np.save(tmp_dir / f"{split}.labels.npy", np.asarray(labels[split], dtype=np.int64))
    meta = {
        "task": task,
        "config": config,
        "sizes": sizes,
        "max_length": max((max(v) for v in lengths.values() if v), default=0),
        "label_counts": {split: {str(k): int(v) for k, v in zip(*np.unique(labels[split], return_counts=True))}
                         for split in SPLITS},
        "n_redrawn_duplicates": n_redrawn,
        "num_proc": num_proc,
        "seconds": round(seconds, 2),
    }
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    publish_dir(tmp_dir, directory)
    logger.info("%s: %s samples in %.1f s with %d processes -> %s", task, sizes, seconds, num_proc, directory)


def _make_chunk(job) -> list[tuple[np.ndarray, int]]:
    sample_fn, cfg, split, lo, hi = job
    return [sample_fn(cfg, split, index, 0) for index in range(lo, hi)]


def _digest(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.uint8).tobytes(), digest_size=16).digest()


def _pool(num_proc: int):
    # fork starts workers in milliseconds and they inherit the imported modules; they only run numpy and Python
    # (no torch, no threads), the case fork is safe for. Elsewhere, spawn.
    method = "fork" if sys.platform == "linux" else "spawn"
    return multiprocessing.get_context(method).Pool(num_proc)


# ---- serving ---------------------------------------------------------------------------------------------------

def load_split(directory: str | os.PathLike, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens (total,) uint8 memmap, offsets (n + 1,) int64, labels (n,) int64) of one cached split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    directory = Path(directory)
    offsets = np.load(directory / f"{split}.offsets.npy")
    labels = np.load(directory / f"{split}.labels.npy")
    path = directory / f"{split}.tokens.bin"
    # np.memmap cannot map an empty file
    tokens = np.memmap(path, dtype=np.uint8, mode="r") if offsets[-1] > 0 else np.zeros(0, dtype=np.uint8)
    return tokens, offsets, labels


class TokenClassificationDataset(Dataset):
    """Sample i of a cached split: (tokens (seq_len,) int64, right-padded with pad_id, label () int64).

    seq_len None: the longest sample of the split. A sample longer than seq_len is an error, not a truncation.
    """

    def __init__(self, directory: str | os.PathLike, split: str, seq_len: Optional[int] = None, pad_id: int = 0):
        self.directory = Path(directory)
        self.split = split
        self.pad_id = pad_id
        tokens, offsets, labels = load_split(self.directory, split)
        del tokens  # opened on first use, in each DataLoader worker (a memmap must not be pickled)
        self.offsets = offsets
        self.labels = torch.from_numpy(labels)
        longest = int(np.max(np.diff(offsets), initial=0))
        self.seq_len = longest if seq_len is None else seq_len
        if self.seq_len < longest:
            raise ValueError(f"seq_len={seq_len} is shorter than the longest {split} sample of {directory} "
                             f"({longest} tokens)")
        self._tokens = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range [0, {len(self)})")
        if self._tokens is None:
            self._tokens = load_split(self.directory, self.split)[0]
        lo, hi = self.offsets[index], self.offsets[index + 1]
        tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        tokens[:hi - lo] = torch.from_numpy(self._tokens[lo:hi].astype(np.int64))
        return tokens, self.labels[index]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}
