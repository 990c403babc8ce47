"""On-disk caches of prepared data, shared by every data module: where the cache lives, token files, publishing.

A cache directory is built under a temporary name and published by one rename, so a crash or a concurrent writer
never leaves a half-written cache behind (complete means: it holds meta.json).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

DEFAULT_CACHE_DIR = "~/.cache/flashtrain"
CACHE_ENV_VAR = "FLASHTRAIN_CACHE_DIR"


def resolve_cache_dir(cache_dir: str) -> Path:
    """`cache_dir`, except that the default gives way to $FLASHTRAIN_CACHE_DIR when that is set."""
    if cache_dir == DEFAULT_CACHE_DIR and os.environ.get(CACHE_ENV_VAR):
        cache_dir = os.environ[CACHE_ENV_VAR]
    return Path(cache_dir).expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype of a token file: uint16, or uint32 when the vocabulary exceeds 65536."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def temporary_dir(final_dir: Path) -> Path:
    """A fresh, empty directory next to `final_dir` to build it in (then `publish_dir`)."""
    tmp_dir = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a crashed run of this same pid
    tmp_dir.mkdir(parents=True)
    return tmp_dir


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished directory (complete once it holds meta.json) into place; if another process got there
    first, keep theirs."""
    if final_dir.exists() and not (final_dir / "meta.json").is_file():
        shutil.rmtree(final_dir)  # incomplete and not ours: only an interrupted copy by hand could leave this
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not (final_dir / "meta.json").is_file():
            raise
        shutil.rmtree(tmp_dir)


def write_flat(tokenized, path: Path, dtype: np.dtype) -> int:
    """Concatenate the "ids" lists of `tokenized` (a Dataset with columns "ids" and "n_tokens"), in order, into a flat
    file of `dtype`; return the token count."""
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


def write_token_files(tokenized, split_indices: dict[str, np.ndarray], vocab_size: int, tokens_dir: Path,
                      meta: dict) -> None:
    """Publish tokens_dir holding <split>.bin (the documents of each split, flat) and meta.json (`meta` plus
    vocab_size, dtype, n_tokens and n_documents per split)."""
    dtype = token_dtype(vocab_size)
    tmp_dir = temporary_dir(tokens_dir)
    n_tokens = {split: write_flat(tokenized.select(idx), tmp_dir / f"{split}.bin", dtype)
                for split, idx in split_indices.items()}
    meta = {"vocab_size": vocab_size, "dtype": dtype.name, "n_tokens": n_tokens,
            "n_documents": {split: len(idx) for split, idx in split_indices.items()}, **meta}
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    publish_dir(tmp_dir, tokens_dir)
