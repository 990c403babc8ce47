"""Long Range Arena tasks read through `datasets`: Text (IMDB, bytes), Retrieval (AAN document pairs), Image (CIFAR-10).

Each loader reads its source once, turns every sample into uint8 tokens and writes them in the cache layout of
`flashtrain.data.lra_cache` (<split>.tokens.bin / .offsets.npy / .labels.npy / meta.json, published by one rename),
so `ClassificationTask` serves them exactly as the generated ListOps and Pathfinder sets.

Sources (`source` field): "hf:NAME" reads the Hub (online, or from the `datasets` cache when offline); a directory
reads local files:
    Text       DIR/train.{parquet,jsonl,csv} and DIR/test.* with columns text, label      (Hub: stanfordnlp/imdb)
    Retrieval  DIR/new_aan_pairs.{train,eval,test}.tsv, LRA's release format, no header:   (Hub: OpenNLPLab/lra,
               label \\t id1 \\t id2 \\t text1 \\t text2; texts are plain or Python bytes      data/aan/*.tsv)
               literals (b'...'), as in LRA's files
    Image      DIR/train.parquet and DIR/test.parquet with an image column and label       (Hub: uoft-cs/cifar10)

Tokens as LRA: Text and Retrieval are bytes of the UTF-8 text (LRA's ByteTextEncoder), cut at max_length; token =
byte + 1 and 0 is padding. UTF-8 never holds the bytes 0xFE or 0xFF, so ids stay below 256 (a stray 0xFF shares id
255 with 0xFE). Image is LRA's grayscale of the RGB pixels, tf.image.rgb_to_grayscale then uint8:
floor((0.2989 R + 0.5870 G + 0.1140 B) / 255 * 255.5), flattened row by row into 1024 tokens 0-255 (no padding).

Splits as LRA: Text validates on the IMDB test set (IMDB has no validation split; LRA does the same); Retrieval uses
the eval file; Image holds out the last val_fraction (10%) of the CIFAR-10 training set.
Retrieval pairs are stored as one row of 2 L tokens: document 1 right-padded to L, then document 2 right-padded to L,
L = the longest document kept (<= max_length); the dual-tower model (LRAConfig.dual) splits the row in halves.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

import datasets
import numpy as np

from flashtrain.data.cache import publish_dir
from flashtrain.data.task import ClassificationTask, DataSpec, check_val_samples
from flashtrain.data.corpus import fingerprint
from flashtrain.data.cache import DEFAULT_CACHE_DIR, resolve_cache_dir
from flashtrain.data.lra_cache import SPLITS, CachedSplits, default_num_proc

HUB_PREFIX = "hf:"
PAD_ID = 0
BYTE_VOCAB_SIZE = 256  # byte + 1, capped at 255; 0 is padding
PIXEL_VOCAB_SIZE = 256
AAN_COLUMNS = ("label", "id1", "id2", "text1", "text2")
AAN_FILES = {"train": "train", "val": "eval", "test": "test"}  # our split -> LRA's file name part
AAN_HUB_DIR = "data/aan"  # where OpenNLPLab/lra keeps LRA's AAN files
GRAY_WEIGHTS = (0.2989, 0.5870, 0.1140)  # tf.image.rgb_to_grayscale
CACHE_FORMAT_VERSION = 1


@dataclass
class LRATextConfig:
    source: str = "hf:stanfordnlp/imdb"  # hf:NAME (splits train, test) | DIR with train.* and test.* files
    text_field: str = "text"
    label_field: str = "label"
    max_length: int = 4000  # bytes kept of each review (LRA: 4K)
    num_classes: int = 2
    num_proc: int = 0  # tokenizing processes (0: every CPU)
    cache_dir: str = DEFAULT_CACHE_DIR  # left at the default, $FLASHTRAIN_CACHE_DIR wins
    seed: int = 0  # the order of the training batches
    # validation passes score the first val_samples samples of the val split, for any batch size and process count
    # (null: the whole split)
    val_samples: Optional[int] = 1600

    def build(self) -> ClassificationTask:
        """Byte tokens (byte + 1; 0 pads) of each review, cached; its classification task."""
        return ClassificationTask(prepare_lra_text(self), BYTE_VOCAB_SIZE, self.num_classes, PAD_ID, self.seed,
                                  val_samples=self.val_samples)

    def preview(self) -> DataSpec:
        """What build() provides, known before reading the source (the longest review is known only after)."""
        return DataSpec("classification", BYTE_VOCAB_SIZE, None, "data.max_length", PAD_ID, self.num_classes)

    def __post_init__(self) -> None:
        _check_common("lra_text", self, self.max_length)


@dataclass
class LRARetrievalConfig:
    source: str = "hf:OpenNLPLab/lra"  # hf:NAME (data/aan/new_aan_pairs.*.tsv) | DIR with new_aan_pairs.*.tsv
    max_length: int = 4000  # bytes kept of each document (LRA: 4K each)
    num_classes: int = 2
    num_proc: int = 0
    cache_dir: str = DEFAULT_CACHE_DIR
    seed: int = 0
    # validation passes score the first val_samples samples of the val split, for any batch size and process count
    # (null: the whole split)
    val_samples: Optional[int] = 1600

    def build(self) -> ClassificationTask:
        """Rows of two byte-token documents, each right-padded to half the row (model.dual splits it), cached."""
        return ClassificationTask(prepare_lra_retrieval(self), BYTE_VOCAB_SIZE, self.num_classes, PAD_ID, self.seed,
                                  paired=True, val_samples=self.val_samples)

    def preview(self) -> DataSpec:
        """What build() provides, known before reading the source (the longest document is known only after)."""
        return DataSpec("classification", BYTE_VOCAB_SIZE, None, "data.max_length", PAD_ID, self.num_classes,
                        paired=True)

    def __post_init__(self) -> None:
        _check_common("lra_retrieval", self, self.max_length)


@dataclass
class LRAImageConfig:
    source: str = "hf:uoft-cs/cifar10"  # hf:NAME (splits train, test) | DIR with train.parquet and test.parquet
    image_field: str = "img"  # uoft-cs/cifar10 calls it img; other copies call it image
    label_field: str = "label"
    val_fraction: float = 0.1  # the last 10% of the training set validates (LRA: train[90%:])
    num_classes: int = 10
    num_proc: int = 0
    cache_dir: str = DEFAULT_CACHE_DIR
    seed: int = 0
    # validation passes score the first val_samples samples of the val split, for any batch size and process count
    # (null: the whole split)
    val_samples: Optional[int] = None

    def build(self) -> ClassificationTask:
        """Grayscale pixel values (0..255, no padding) of each image, cached; its classification task."""
        return ClassificationTask(prepare_lra_image(self), PIXEL_VOCAB_SIZE, self.num_classes, None, self.seed,
                                  length_field="the image size", val_samples=self.val_samples)

    def preview(self) -> DataSpec:
        """What build() provides, known before reading the source (the image size is known only after)."""
        return DataSpec("classification", PIXEL_VOCAB_SIZE, None, "the image size", None, self.num_classes)

    def __post_init__(self) -> None:
        _check_common("lra_image", self)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"lra_image.val_fraction must be in (0, 1), got {self.val_fraction}")


def _check_common(name: str, cfg, max_length: int = 1) -> None:
    if not cfg.source:
        raise ValueError(f"{name}.source must be 'hf:NAME' or a directory, got {cfg.source!r}")
    if max_length < 1:
        raise ValueError(f"{name}.max_length must be >= 1, got {max_length}")
    if cfg.num_proc < 0:
        raise ValueError(f"{name}.num_proc must be >= 0 (0: every CPU), got {cfg.num_proc}")
    if cfg.num_classes < 2:
        raise ValueError(f"{name}.num_classes must be >= 2, got {cfg.num_classes}")
    check_val_samples(cfg.val_samples)


# ---- tokens ------------------------------------------------------------------------------------------------------

def encode_bytes(text: str | bytes, max_length: int) -> np.ndarray:
    """UTF-8 bytes of `text` (bytes as they are), the first max_length, as ids byte + 1: uint8 (<= max_length,)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    ids = np.frombuffer(raw[:max_length], dtype=np.uint8).astype(np.int16) + 1
    return np.minimum(ids, 255).astype(np.uint8)


def decode_bytes(ids) -> str:
    """Inverse of encode_bytes (padding dropped); bytes that are not UTF-8 become U+FFFD."""
    ids = np.asarray(ids)
    return bytes((ids[ids != PAD_ID] - 1).astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def aan_text(field: str) -> bytes:
    """A text field of LRA's AAN files: a Python bytes literal (b'...', as LRA wrote them) or plain text."""
    if len(field) >= 3 and field[0] == "b" and field[1] in "'\"" and field[-1] == field[1]:
        return ast.literal_eval(field)
    return field.encode("utf-8")


def grayscale(rgb: np.ndarray) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (H, W), as tf.image.rgb_to_grayscale on a uint8 image (float32 math, then the
    float -> uint8 conversion of tf.image.convert_image_dtype: x * 255.5, truncated)."""
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"rgb must be (height, width, 3), got shape {rgb.shape}")
    luminance = (rgb.astype(np.float32) / np.float32(255.0)) @ np.asarray(GRAY_WEIGHTS, dtype=np.float32)
    return np.clip(np.floor(luminance * np.float32(255.5)), 0, 255).astype(np.uint8)


# ---- sources -----------------------------------------------------------------------------------------------------

def _local_split_file(directory: Path, split: str, suffixes: tuple[str, ...]) -> Path:
    for suffix in suffixes:
        path = directory / f"{split}{suffix}"
        if path.is_file():
            return path
    raise FileNotFoundError(f"source={str(directory)!r}: no {split}{{{','.join(suffixes)}}} file")


def _builder(path: Path) -> str:
    return {".parquet": "parquet", ".jsonl": "json", ".csv": "csv"}[path.suffix]


def _identity(source: str, files: Iterable[Path]) -> dict:
    """What decides the data: the Hub name (a revised Hub dataset needs a fresh cache_dir), or the local files' paths,
    sizes and modification times."""
    if source.startswith(HUB_PREFIX):
        return {"hub": source}
    return {"files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def _source_dir(name: str, source: str) -> Path:
    directory = Path(source).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{name}.source={source!r} is neither 'hf:NAME' nor a directory")
    return directory


def _text_or_image_files(name: str, source: str, suffixes: tuple[str, ...]) -> dict[str, Path]:
    directory = _source_dir(name, source)
    files = {split: _local_split_file(directory, split, suffixes) for split in ("train", "test")}
    for split, path in files.items():
        if path.stat().st_size == 0:
            raise ValueError(f"{name}.source={source!r}: {path} is empty; the {split} split needs samples")
    return files


def _load_train_test(source: str, files: dict[str, Path] | None) -> datasets.DatasetDict:
    if files is None:
        data = datasets.load_dataset(source[len(HUB_PREFIX):])
        missing = [split for split in ("train", "test") if split not in data]
        if missing:
            raise ValueError(f"source={source!r} has no {' and no '.join(missing)} split (its splits: {list(data)})")
        return data
    builders = {_builder(p) for p in files.values()}
    if len(builders) != 1:
        raise ValueError(f"source: train and test files must have one format, got {sorted(map(str, files.values()))}")
    return datasets.load_dataset(builders.pop(), data_files={k: str(p) for k, p in files.items()})


def _aan_files(source: str) -> dict[str, str]:
    if source.startswith(HUB_PREFIX):
        repo = source[len(HUB_PREFIX):]
        return {split: f"hf://datasets/{repo}/{AAN_HUB_DIR}/new_aan_pairs.{name}.tsv"
                for split, name in AAN_FILES.items()}
    directory = _source_dir("lra_retrieval", source)
    files = {split: directory / f"new_aan_pairs.{name}.tsv" for split, name in AAN_FILES.items()}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"lra_retrieval.source={source!r}: missing {missing}")
    return {split: str(p) for split, p in files.items()}


# ---- the three tasks ---------------------------------------------------------------------------------------------

def prepare_lra_text(cfg: LRATextConfig) -> CachedSplits:
    """IMDB reviews as byte tokens (val = test, as LRA); `.dataset(split, seq_len)` serves (tokens, label)."""
    files = None if cfg.source.startswith(HUB_PREFIX) else _text_or_image_files(
        "lra_text", cfg.source, (".parquet", ".jsonl", ".csv"))

    def build() -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
        raw = _load_train_test(cfg.source, files)
        encoded = {}
        for split in ("train", "test"):
            ds = _require_columns(raw[split], "lra_text", (cfg.text_field, cfg.label_field))
            ds = ds.map(lambda batch: {"ids": [encode_bytes(t, cfg.max_length).tobytes()
                                               for t in batch[cfg.text_field]]},
                        batched=True, num_proc=_num_proc(cfg.num_proc, len(ds)), desc=f"bytes of {split}")
            encoded[split] = ([np.frombuffer(b, dtype=np.uint8) for b in ds["ids"]],
                              np.asarray(ds[cfg.label_field], dtype=np.int64))
        return {"train": encoded["train"], "val": encoded["test"], "test": encoded["test"]}

    return _cached("lra_text", cfg, _identity(cfg.source, (files or {}).values()), build)


def prepare_lra_retrieval(cfg: LRARetrievalConfig) -> CachedSplits:
    """AAN citation pairs as two byte-token documents in one row of 2 L tokens (see the module docstring)."""
    files = _aan_files(cfg.source)

    def build() -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
        features = datasets.Features({"label": datasets.Value("float32"), "id1": datasets.Value("string"),
                                      "id2": datasets.Value("string"), "text1": datasets.Value("string"),
                                      "text2": datasets.Value("string")})
        raw = datasets.load_dataset("csv", data_files=files, delimiter="\t", column_names=list(AAN_COLUMNS),
                                    quoting=csv.QUOTE_NONE, features=features)

        def encode(batch):
            return {f"ids{i}": [encode_bytes(aan_text(t), cfg.max_length).tobytes() for t in batch[f"text{i}"]]
                    for i in (1, 2)}

        docs, labels = {}, {}
        for split in SPLITS:
            ds = raw[split].map(encode, batched=True, num_proc=_num_proc(cfg.num_proc, len(raw[split])),
                                desc=f"bytes of {split}")
            docs[split] = [(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
                           for a, b in zip(ds["ids1"], ds["ids2"])]
            labels[split] = np.asarray(ds["label"], dtype=np.float64).astype(np.int64)
        pair_length = max((max(len(a), len(b)) for split in SPLITS for a, b in docs[split]), default=1)
        return {split: ([_pad_pair(a, b, pair_length) for a, b in docs[split]], labels[split]) for split in SPLITS}

    local = [] if cfg.source.startswith(HUB_PREFIX) else [Path(f) for f in files.values()]
    return _cached("lra_retrieval", cfg, _identity(cfg.source, local), build)


def prepare_lra_image(cfg: LRAImageConfig) -> CachedSplits:
    """CIFAR-10 in LRA's grayscale, 1024 pixel tokens per image; val = the last val_fraction of train."""
    files = None if cfg.source.startswith(HUB_PREFIX) else _text_or_image_files("lra_image", cfg.source, (".parquet",))

    def build() -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
        raw = _load_train_test(cfg.source, files)
        pixels = {}
        for split in ("train", "test"):
            ds = _require_columns(raw[split], "lra_image", (cfg.image_field, cfg.label_field))
            ds = ds.map(lambda batch: {"ids": [grayscale(np.asarray(im.convert("RGB"))).tobytes()
                                               for im in batch[cfg.image_field]]},
                        batched=True, num_proc=_num_proc(cfg.num_proc, len(ds)), desc=f"grayscale {split}",
                        remove_columns=[cfg.image_field])
            pixels[split] = ([np.frombuffer(b, dtype=np.uint8) for b in ds["ids"]],
                             np.asarray(ds[cfg.label_field], dtype=np.int64))
        n_train = round(len(pixels["train"][0]) * (1.0 - cfg.val_fraction))
        (images, labels) = pixels["train"]
        return {"train": (images[:n_train], labels[:n_train]), "val": (images[n_train:], labels[n_train:]),
                "test": pixels["test"]}

    return _cached("lra_image", cfg, _identity(cfg.source, (files or {}).values()), build)


def _pad_pair(first: np.ndarray, second: np.ndarray, length: int) -> np.ndarray:
    row = np.full(2 * length, PAD_ID, dtype=np.uint8)  # (2 L,): [document 1, pads | document 2, pads]
    row[:len(first)], row[length:length + len(second)] = first, second
    return row


def _require_columns(ds: datasets.Dataset, name: str, columns: tuple[str, ...]) -> datasets.Dataset:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise ValueError(f"{name}: columns {missing} not in the data (columns: {ds.column_names}); set "
                         f"{name}.text_field / image_field / label_field")
    return ds


def _num_proc(num_proc: int, n_rows: int) -> int | None:
    """datasets.map's num_proc: None (in this process) for small sets, where starting workers costs more."""
    n = num_proc or default_num_proc()
    return n if n > 1 and n_rows >= 1000 * n else None


# ---- cache -------------------------------------------------------------------------------------------------------

def _cached(task: str, cfg, identity: dict, build) -> CachedSplits:
    """The cache of `task` for `cfg` (fields except num_proc, cache_dir, seed and val_samples) and `identity`, built
    by `build() -> {split: (token arrays, labels)}` on a miss."""
    config = {k: v for k, v in asdict(cfg).items() if k not in ("num_proc", "cache_dir", "seed", "val_samples")}
    key = fingerprint({"version": CACHE_FORMAT_VERSION, "task": task, "config": config, "identity": identity})
    directory = resolve_cache_dir(cfg.cache_dir) / "lra" / f"{task}-{key[:16]}"
    if not (directory / "meta.json").is_file():
        start = time.perf_counter()
        splits = build()
        _write(directory, task, config, splits, time.perf_counter() - start)
    return CachedSplits(directory, json.loads((directory / "meta.json").read_text()))


def _write(directory: Path, task: str, config: dict, splits: dict, seconds: float) -> None:
    tmp_dir = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    lengths = {}
    for split in SPLITS:
        tokens, labels = splits[split]
        with open(tmp_dir / f"{split}.tokens.bin", "wb") as f:
            for row in tokens:
                f.write(np.ascontiguousarray(row, dtype=np.uint8).tobytes())
        offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum([len(row) for row in tokens], out=offsets[1:])
        np.save(tmp_dir / f"{split}.offsets.npy", offsets)
        np.save(tmp_dir / f"{split}.labels.npy", np.asarray(labels, dtype=np.int64))
        lengths[split] = np.diff(offsets)
    meta = {
        "task": task,
        "config": config,
        "sizes": {split: len(splits[split][1]) for split in SPLITS},
        "max_length": int(max((v.max() for v in lengths.values() if len(v)), default=0)),
        "label_counts": {split: {str(k): int(v) for k, v in zip(*np.unique(splits[split][1], return_counts=True))}
                         for split in SPLITS},
        "seconds": round(seconds, 2),
    }
    (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    publish_dir(tmp_dir, directory)
