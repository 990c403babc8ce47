"""Data: text corpora, byte-level BPE tokenizers, packed language-model token files and resumable loaders."""

from flashtrain.data.corpus import Corpus, open_corpus
from flashtrain.data.lm import (LMData, LMDataConfig, PackedLMDataset, ResumableBatchSampler, make_train_loader,
                                make_val_loader, prepare_lm_data)
from flashtrain.data.tokenizer import EOS_TOKEN, decode, encode_ordinary, eos_id, load_tokenizer, train_bpe

__all__ = [
    "EOS_TOKEN", "Corpus", "LMData", "LMDataConfig", "PackedLMDataset", "ResumableBatchSampler", "decode",
    "encode_ordinary", "eos_id", "load_tokenizer", "make_train_loader", "make_val_loader", "open_corpus",
    "prepare_lm_data", "train_bpe",
]
