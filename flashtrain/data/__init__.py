"""Data: corpora, tokenizers, cached token files, samplers, and the tasks each data config builds."""

from flashtrain.data.corpus import Corpus, open_corpus
from flashtrain.data.lm import LMData, LMDataConfig, PackedLMDataset, make_train_loader, make_val_loader, prepare_lm_data
from flashtrain.data.samplers import ResumableBatchSampler
from flashtrain.data.task import DataSpec, Task
from flashtrain.data.tokenizer import EOS_TOKEN, decode, encode_ordinary, eos_id, load_tokenizer, train_bpe

__all__ = [
    "EOS_TOKEN", "Corpus", "DataSpec", "LMData", "LMDataConfig", "PackedLMDataset", "ResumableBatchSampler", "Task",
    "decode", "encode_ordinary", "eos_id", "load_tokenizer", "make_train_loader", "make_val_loader", "open_corpus",
    "prepare_lm_data", "train_bpe",
]
