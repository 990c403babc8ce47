"""Text corpora: which documents to read, in which order, and a fingerprint of them for the caches.

A corpus is named by one string:
  "stdlib"               this Python's standard-library `.py` sources (no download; exists wherever Python does)
  "python-site"          every `.py` file of this Python: the standard library plus every installed package
                         (site-packages), one document per file, files with the same content kept once, in the order
                         of their content's sha256 (so a cap takes an even sample of every package, not the first
                         ones alphabetically); hundreds of MB where torch and transformers are installed
  PATH | DIR | GLOB      local `.txt` (one document per file), `.jsonl` (one document per line, field `text_field`)
                         or `.parquet` (one document per row, column `text_field`) files, one format per corpus
  "hf:NAME[:CONFIG]"     a Hugging Face Hub dataset, split "train", column `text_field`: downloaded whole (datasets'
                         progress bars; num_proc-free, cached by `datasets`), or with streaming=True read row by row
                         up to max_bytes (a tqdm bar over bytes) into an Arrow copy under `hf_cache_dir`, so a
                         subset of OpenWebText (~40 GB of text) costs only what it reads

Every corpus is capped at `max_bytes` of UTF-8 text (0: no cap): documents are taken in order and the one that
crosses the cap is cut there. `open_corpus` is cheap (no tokenization, no copy of large files) so that a cache
hit costs next to nothing; `Corpus.documents()` does the reading.

Bad files. A local file that cannot be read, that is not UTF-8 (.txt, .jsonl), that has a line which is not a JSON
object with a string `text_field` (.jsonl), or that is not a parquet file with a `text_field` column (.parquet) is
skipped: a `CorpusFileSkippedWarning` names each one and why, with the count ("2 of 40 files skipped"), and the
token caches record them (meta.json's "skipped_files"), so a cache hit warns again. When every file is skipped, or
the corpus holds no text at all, `documents()` stops with a ValueError naming the corpus. The standard library's
few files in legacy encodings are skipped too; the corpus description counts them (python-site: a log line counts
them, with the duplicates and blank files left out).
"""

from __future__ import annotations

import codecs
import functools
import glob
import hashlib
import json
import logging
import os
import site
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import datasets
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

STDLIB = "stdlib"
PYTHON_SITE = "python-site"
HUB_PREFIX = "hf:"
# file suffix -> the `datasets` packaged builder that reads it
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
# stdlib directories that are not the standard library itself
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusFileSkippedWarning(UserWarning):
    """Local corpus files that cannot be read as text were left out (the module docstring's rule)."""


@dataclass(frozen=True)
class Corpus:
    """A fixed, ordered list of text documents."""

    spec: str  # the corpus string as configured
    description: str  # one line for logs and meta.json
    identity: str  # sha256 hex of everything that decides the documents (content, or file paths+sizes+mtimes)
    _load: Callable[[], datasets.Dataset] = field(repr=False, compare=False)
    # (file, why) of each local file that documents() left out; filled when documents() runs
    skipped: list[tuple[str, str]] = field(default_factory=list, compare=False)

    def documents(self) -> datasets.Dataset:
        """The documents as a Dataset with one column "text", in corpus order, capped at max_bytes. ValueError when
        there is no text at all."""
        documents = self._load()
        # stops at the first non-empty document: one batch read in any real corpus
        if not any(text.strip() for batch in documents.iter(batch_size=1000) for text in batch["text"]):
            raise ValueError(f"corpus={self.spec!r} ({self.description}) holds no text: "
                             f"{len(documents)} documents, all empty or blank")
        return documents


def warn_skipped(corpus: str, skipped: list, n_files: int | None = None, cached: bool = False) -> None:
    """One CorpusFileSkippedWarning naming the skipped (file, why) pairs (the first 10) and their count."""
    if not skipped:
        return
    listed = "\n  ".join(f"{path}: {why}" for path, why in skipped[:10])
    more = f"\n  ... and {len(skipped) - 10} more" if len(skipped) > 10 else ""
    of = f" of {n_files}" if n_files is not None else ""
    when = " when its token cache was built" if cached else ""
    warnings.warn(f"corpus={corpus!r}: {len(skipped)}{of} files skipped{when} (unreadable or not text; see "
                  f"flashtrain/data/corpus.py):\n  {listed}{more}", CorpusFileSkippedWarning, stacklevel=2)


def open_corpus(corpus: str, text_field: str = "text", max_bytes: int = 0,
                hf_cache_dir: str | os.PathLike | None = None, streaming: bool = False) -> Corpus:
    """Resolve `corpus` (see the module docstring) without tokenizing anything.

    `hf_cache_dir` is where `datasets` keeps its Arrow copy of local files and of streamed Hub rows (None: the
    `datasets` default). Hub datasets loaded whole use the `datasets` default cache, shared with every other tool.
    `streaming` (Hub corpora only) reads the rows in order up to max_bytes instead of downloading the dataset.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 (0: no cap), got {max_bytes}")
    if streaming and not corpus.startswith(HUB_PREFIX):
        raise ValueError(f"streaming=True reads Hub corpora ('hf:NAME') only, got corpus={corpus!r}")
    if corpus == STDLIB:
        return _open_stdlib(max_bytes)
    if corpus == PYTHON_SITE:
        return _open_python_site(max_bytes)
    if corpus.startswith(HUB_PREFIX):
        if streaming:
            return _open_hub_streaming(corpus, text_field, max_bytes, hf_cache_dir)
        return _open_hub(corpus, text_field, max_bytes)
    return _open_local(corpus, text_field, max_bytes, hf_cache_dir)


def fingerprint(obj) -> str:
    """sha256 hex of a JSON-serialisable object (keys sorted, so dict order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


# ---- stdlib ----------------------------------------------------------------------------------------------------

def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Every `.py` file under the standard library directory, sorted by relative path, without installed packages."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked directories
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_stdlib(max_bytes: int) -> tuple[list[str], list[str], int]:
    """(relative paths, texts, files skipped as not UTF-8) of the stdlib files that fill max_bytes; the last text is
    cut at the cap."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names, texts, total, n_skipped = [], [], 0, 0
    for path in stdlib_files(root):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # test data in legacy encodings (test/encoded_modules/...)
            n_skipped += 1
            continue
        names.append(path.relative_to(root).as_posix())
        texts.append(text)
        total += len(text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            break
    n_whole, tail = _cap(texts, max_bytes)
    texts = texts[:n_whole] + ([tail] if tail else [])
    return names[:len(texts)], texts, n_skipped


def _open_stdlib(max_bytes: int) -> Corpus:
    names, texts, n_skipped = _read_stdlib(max_bytes)  # ~10 ms per MB: cheap enough to hash the content itself
    content = hashlib.sha256()
    for name, text in zip(names, texts):
        content.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return Corpus(
        spec=STDLIB,
        description=f"Python {sys.version.split()[0]} stdlib: {len(texts)} files, {n_bytes:,} bytes"
                    + (f" ({n_skipped} files in legacy encodings skipped)" if n_skipped else ""),
        identity=fingerprint({"kind": STDLIB, "content": content.hexdigest(), "max_bytes": max_bytes}),
        _load=functools.partial(_load_texts, texts),
    )


def _load_texts(texts: list[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": texts})


# ---- python-site -----------------------------------------------------------------------------------------------

def python_site_roots() -> list[Path]:
    """The directories of this Python's `.py` files: the standard library and every site-packages directory (in a
    virtual environment the base installation's standard library too), none inside another."""
    paths = sysconfig.get_paths()
    candidates = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")] + site.getsitepackages()
    roots = sorted({Path(p).resolve() for p in candidates if Path(p).is_dir()})
    return [root for root in roots if not any(other in root.parents for other in roots)]


def python_site_files(roots: list[Path]) -> list[Path]:
    """Every `.py` file under `roots`, sorted by path (symlinked directories not followed, __pycache__ skipped)."""
    files = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def _open_python_site(max_bytes: int, roots: list[Path] | None = None) -> Corpus:
    roots = python_site_roots() if roots is None else roots
    files = python_site_files(roots)
    if not files:
        raise FileNotFoundError(f"corpus={PYTHON_SITE!r}: no .py file under {[str(r) for r in roots]}")
    # file stats, not content: the content (hundreds of MB) is read and hashed only when the caches miss
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return Corpus(
        spec=PYTHON_SITE,
        description=f"Python {sys.version.split()[0]} stdlib + site-packages: {len(files)} .py files, "
                    f"{sum(s[1] for s in stats):,} bytes on disk before deduplication"
                    + (f", capped at {max_bytes:,} bytes" if max_bytes else ""),
        identity=fingerprint({"kind": PYTHON_SITE, "files": stats, "max_bytes": max_bytes}),
        _load=functools.partial(_load_python_site, files, max_bytes),
    )


def _load_python_site(files: list[Path], max_bytes: int) -> datasets.Dataset:
    """One document per distinct non-blank UTF-8 file, ordered by the sha256 of its bytes, capped at max_bytes."""
    by_hash, n_unreadable, n_blank = {}, 0, 0
    for path in tqdm(files, desc="reading .py files", unit="file", mininterval=2.0):
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):  # a broken link, legacy-encoded test data
            n_unreadable += 1
            continue
        if not text.strip():
            n_blank += 1
            continue
        by_hash.setdefault(hashlib.sha256(raw).hexdigest(), text)  # a duplicate keeps the first path's copy
    logger.info("corpus=%r: %d distinct documents of %d .py files (%d duplicates, %d blank, %d unreadable or not "
                "UTF-8 left out)", PYTHON_SITE, len(by_hash), len(files),
                len(files) - len(by_hash) - n_blank - n_unreadable, n_blank, n_unreadable)
    texts = [by_hash[key] for key in sorted(by_hash)]
    n_whole, tail = _cap(texts, max_bytes)
    return _load_texts(texts[:n_whole] + ([tail] if tail else []))


# ---- local files -----------------------------------------------------------------------------------------------

def local_files(corpus: str) -> list[Path]:
    """The files a local corpus string names: one file, every supported file under a directory, or a glob."""
    path = Path(corpus).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_BUILDERS)
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise FileNotFoundError(
            f"corpus={corpus!r} is not 'stdlib', 'python-site', a Hub dataset ('hf:NAME'), nor a file, directory or glob that "
            f"matches any {'/'.join(LOCAL_BUILDERS)} file")
    suffixes = {p.suffix for p in files}
    if not suffixes <= LOCAL_BUILDERS.keys():
        raise ValueError(f"corpus={corpus!r}: unsupported file types {sorted(suffixes - LOCAL_BUILDERS.keys())}; "
                         f"supported: {sorted(LOCAL_BUILDERS)}")
    if len(suffixes) > 1:
        raise ValueError(f"corpus={corpus!r} mixes file types {sorted(suffixes)}; use one type per corpus")
    return [p.resolve() for p in files]


def _open_local(corpus: str, text_field: str, max_bytes: int, hf_cache_dir) -> Corpus:
    files = local_files(corpus)
    # file stats, not content: hashing gigabytes on every start would cost more than the cache saves
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    builder = LOCAL_BUILDERS[files[0].suffix]
    skipped: list[tuple[str, str]] = []
    return Corpus(
        spec=corpus,
        description=f"{len(files)} local {files[0].suffix} files, {sum(s[1] for s in stats):,} bytes on disk",
        identity=fingerprint({"kind": "files", "files": stats, "text_field": text_field, "max_bytes": max_bytes}),
        _load=functools.partial(_load_local, corpus, builder, [str(p) for p in files], text_field, max_bytes,
                                None if hf_cache_dir is None else str(hf_cache_dir), skipped),
        skipped=skipped,
    )


def file_problem(path: Path, builder: str, text_field: str) -> str | None:
    """Why a local corpus file cannot be read as documents (the module docstring's rule), or None."""
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq  # datasets' own dependency

            try:
                names = pq.ParquetFile(path).schema_arrow.names
            except Exception as error:  # pyarrow raises ArrowInvalid and others for a file that is not parquet
                return f"is not a parquet file ({type(error).__name__}: {error})"
            return None if text_field in names else f"has no column text_field={text_field!r} (columns: {names})"
        with open(path, "rb") as f:
            if builder == "text":
                decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
                while chunk := f.read(1 << 22):
                    try:
                        decoder.decode(chunk)
                    except UnicodeDecodeError as error:
                        return f"is not UTF-8 text (byte {offset + error.start}: {error.reason})"
                    offset += len(chunk)
                try:
                    decoder.decode(b"", final=True)
                except UnicodeDecodeError as error:
                    return f"is not UTF-8 text (it ends inside a character: {error.reason})"
                return None
            for number, line in enumerate(f, start=1):  # builder "json": JSON lines
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as error:
                    return f"line {number} is not UTF-8 ({error.reason})"
                except ValueError as error:
                    return f"line {number} is not JSON ({error})"
                if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                    return f"line {number} is not a JSON object with a string text_field={text_field!r}"
            return None
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"


def _load_local(corpus: str, builder: str, files: list[str], text_field: str, max_bytes: int, cache_dir,
                skipped: list) -> datasets.Dataset:
    skipped[:] = [(path, why) for path in files if (why := file_problem(Path(path), builder, text_field))]
    if len(skipped) == len(files):
        raise ValueError(f"corpus={corpus!r}: none of its {len(files)} files can be read as text:\n  "
                         + "\n  ".join(f"{path}: {why}" for path, why in skipped[:10]))
    warn_skipped(corpus, skipped, len(files))
    files = [path for path in files if path not in {p for p, _ in skipped}]
    if builder == "text":  # a whole file is one document: EOS marks where a text ends, not where a line does
        ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document", cache_dir=cache_dir)
        return _cap_dataset(ds, max_bytes)
    ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir)
    return _cap_dataset(_text_column(ds, text_field), max_bytes)


# ---- Hugging Face Hub ------------------------------------------------------------------------------------------

def _parse_hub(corpus: str) -> tuple[str, str]:
    """"hf:NAME[:CONFIG]" -> (NAME, CONFIG or "")."""
    name, _, config = corpus[len(HUB_PREFIX):].partition(":")
    if not name:
        raise ValueError(f"corpus={corpus!r}: expected 'hf:NAME' or 'hf:NAME:CONFIG'")
    return name, config


def _open_hub(corpus: str, text_field: str, max_bytes: int) -> Corpus:
    name, config = _parse_hub(corpus)
    ds = _load_hub(name, config or None)
    # the cache files' names carry the dataset revision's hash; their sizes pin the content
    stats = [(Path(f["filename"]).as_posix().split("/")[-4:], os.path.getsize(f["filename"])) for f in ds.cache_files]
    return Corpus(
        spec=corpus,
        description=f"Hub dataset {name}{':' + config if config else ''} (train split, {len(ds)} rows)",
        identity=fingerprint({"kind": "hub", "name": name, "config": config, "cache_files": stats,
                              "text_field": text_field, "max_bytes": max_bytes}),
        _load=functools.partial(_load_hub_documents, name, config or None, text_field, max_bytes),
    )


def _load_hub(name: str, config: str | None) -> datasets.Dataset:
    return datasets.load_dataset(name, config, split="train")


def _load_hub_documents(name: str, config: str | None, text_field: str, max_bytes: int) -> datasets.Dataset:
    return _cap_dataset(_text_column(_load_hub(name, config), text_field), max_bytes)


def _open_hub_streaming(corpus: str, text_field: str, max_bytes: int, hf_cache_dir) -> Corpus:
    name, config = _parse_hub(corpus)
    # nothing is read here: the identity is the request itself, so a Hub dataset that is revised in place (public
    # pretraining corpora such as OpenWebText are frozen) needs a fresh cache_dir
    cap = f"first {max_bytes:,} bytes" if max_bytes else "all rows"
    return Corpus(
        spec=corpus,
        description=f"Hub dataset {name}{':' + config if config else ''} (train split, streamed, {cap})",
        identity=fingerprint({"kind": "hub-stream", "name": name, "config": config, "text_field": text_field,
                              "max_bytes": max_bytes}),
        _load=functools.partial(_load_hub_stream_documents, name, config or None, text_field, max_bytes,
                                None if hf_cache_dir is None else str(hf_cache_dir)),
    )


def _stream_hub(name: str, config: str | None) -> Iterable[dict]:
    return datasets.load_dataset(name, config, split="train", streaming=True)


def _stream_texts(name: str, config: str | None, text_field: str, max_bytes: int) -> Iterator[dict]:
    """{"text": ...} rows of the streamed dataset, in order, the one that crosses max_bytes cut there."""
    total = 0
    with tqdm(total=max_bytes or None, unit="B", unit_scale=True, desc=f"streaming {name}") as progress:
        for row in _stream_hub(name, config):
            if text_field not in row:
                raise ValueError(f"text_field={text_field!r} is not a column of the corpus; columns: {list(row)}")
            text = row[text_field]
            n_bytes = len(text.encode("utf-8"))
            if max_bytes and total + n_bytes > max_bytes:
                _, tail = _cap([text], max_bytes - total)
                if tail:
                    yield {"text": tail}
                progress.update(max_bytes - total)
                return
            total += n_bytes
            progress.update(n_bytes)
            yield {"text": text}


def _load_hub_stream_documents(name: str, config: str | None, text_field: str, max_bytes: int,
                               cache_dir) -> datasets.Dataset:
    try:
        return datasets.Dataset.from_generator(
            _stream_texts, features=datasets.Features({"text": datasets.Value("string")}), cache_dir=cache_dir,
            gen_kwargs={"name": name, "config": config, "text_field": text_field, "max_bytes": max_bytes})
    except datasets.exceptions.DatasetGenerationError as error:
        if isinstance(error.__cause__, ValueError):  # ours (a missing text_field): show it, not datasets' wrapper
            raise error.__cause__ from None
        raise


# ---- shared ----------------------------------------------------------------------------------------------------

def _text_column(ds: datasets.Dataset, text_field: str) -> datasets.Dataset:
    if text_field not in ds.column_names:
        raise ValueError(f"text_field={text_field!r} is not a column of the corpus; columns: {ds.column_names}")
    ds = ds.select_columns([text_field])
    return ds if text_field == "text" else ds.rename_column(text_field, "text")


def _cap(texts: Iterable[str], max_bytes: int) -> tuple[int, str]:
    """(number of whole documents within max_bytes, the next document cut to fill the cap or "")."""
    total = n_whole = 0
    for text in texts:
        n = len(text.encode("utf-8"))
        if max_bytes and total + n > max_bytes:
            # cut on a character boundary: "ignore" drops only a multi-byte character split by the cut
            return n_whole, text.encode("utf-8")[:max_bytes - total].decode("utf-8", errors="ignore")
        total += n
        n_whole += 1
    return n_whole, ""


def _cap_dataset(ds: datasets.Dataset, max_bytes: int) -> datasets.Dataset:
    """The first documents of `ds` up to max_bytes; reads only as far as the cap."""
    if not max_bytes:
        return ds
    texts = (text for batch in ds.iter(batch_size=1000) for text in batch["text"])
    n_whole, tail = _cap(texts, max_bytes)
    if n_whole == len(ds):
        return ds
    head = ds.select(range(n_whole))
    if not tail:
        return head
    return datasets.concatenate_datasets([head, datasets.Dataset.from_dict({"text": [tail]}, features=ds.features)])
