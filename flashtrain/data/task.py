"""Tasks: what the trainer trains on and how it scores it. The trainer knows nothing else about data.

Each data config builds its task (`cfg.data.build()`): it prepares the data (or finds it in the cache) and says what
it provides in a `DataSpec`, which the model config checks itself against (`check_model_fits`) before a model is
built. `cfg.data.preview()` says beforehand, without preparing anything (no tokenizer training, no tokenizing, no
generating), what it can already know, so that a model that cannot fit stops the start before that work. A task turns into loaders of opaque batches (tuples or dicts of tensors), says how a model computes the
training loss of a batch, and reduces evaluation batches to metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from flashtrain.data.samplers import ResumableBatchSampler, ordered_batches

TASKS = ("causal_lm", "masked_lm", "classification", "document_classification")


@dataclass(frozen=True)
class DataSpec:
    """What prepared data gives a model; a model config's `check_data(spec)` raises ValueError on a mismatch.
    A preview (`cfg.data.preview()`, before the data is prepared) holds None where only the prepared data knows
    (max_length, num_classes); check_data skips those."""

    task: str  # one of TASKS: the batches' form and what is predicted
    vocab_size: int  # token ids are < vocab_size (a preview: at most vocab_size)
    max_length: Optional[int]  # longest sample in tokens (paired rows: each document)
    length_field: str  # the data config key that sets max_length, for messages ("data.seq_len")
    pad_id: Optional[int] = None  # the padding token; None: every token is real
    num_classes: Optional[int] = None  # classes or labels of classification tasks
    problem_type: str = "single_label"  # single_label | multi_label (document classification)
    paired: bool = False  # each row holds two documents side by side (LRA Retrieval)
    document_mask: bool = False  # causal_lm: batches carry cu_seqlens; attention must stay inside each document


def check_processes(num_proc: int, num_workers: int) -> None:
    """For data configs' __post_init__: data.num_proc (processes that tokenize) >= 1, data.num_workers (DataLoader
    worker processes) >= 0."""
    if num_proc < 1:
        raise ValueError(f"data.num_proc must be >= 1, got {num_proc}")
    if num_workers < 0:
        raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")


def check_val_samples(val_samples: int | None) -> None:
    """For data configs' __post_init__: val_samples is None (the whole split) or >= 1."""
    if val_samples is not None and val_samples < 1:
        raise ValueError(f"data.val_samples must be >= 1 (or null: the whole validation split), got {val_samples}")


def check_splits(source, labels: dict[str, np.ndarray], num_classes: int) -> None:
    """Raise ValueError naming `source` and the split when a split is empty or holds a label outside
    [0, num_classes): labels {split: (n,) class ids, or (n, num_classes) 0/1 rows of multi-label data}."""
    for split, values in labels.items():
        if len(values) == 0:
            raise ValueError(f"{source}: the {split} split is empty; every split ({', '.join(labels)}) needs samples")
        if values.ndim == 1:
            bad = values[(values < 0) | (values >= num_classes)]
            if len(bad):
                raise ValueError(f"{source}: the {split} split has {len(bad)} labels outside [0, {num_classes}) "
                                 f"(the number of classes), e.g. {int(bad[0])}")
        elif values.shape[1] != num_classes:
            raise ValueError(f"{source}: the {split} split has {values.shape[1]} label columns, not {num_classes}")


def model_data_misfit(model_schema: str, data_schema: str, reason: str) -> ValueError:
    """The error of a model config that cannot train on a data config, naming both (their schema classes)."""
    return ValueError(f"model config {model_schema} does not fit data config {data_schema}: {reason}")


def check_model_fits(model_cfg, data_cfg, spec: DataSpec) -> None:
    """Raise ValueError naming both configs when `model_cfg` cannot train on the data that `data_cfg` prepared."""
    try:
        model_cfg.check_data(spec)
    except ValueError as error:
        raise model_data_misfit(type(model_cfg).__name__, type(data_cfg).__name__, str(error)) from None


def check_model_fits_before_preparing(model_cfg, data_cfg) -> None:
    """The start-up check, before any data is prepared: `check_model_fits` on the data config's preview. A preview
    that cannot be made (it loads a tokenizer that is neither local nor reachable, say) stops the start with an error
    naming both configs and the preview's reason."""
    try:
        spec = data_cfg.preview()
    except (OSError, ValueError) as error:
        raise ValueError(f"model config {type(model_cfg).__name__} cannot be checked against data config "
                         f"{type(data_cfg).__name__}: the data config cannot say what it provides before it is "
                         f"prepared: {error}") from error
    check_model_fits(model_cfg, data_cfg, spec)


class Task:
    """Interface. Batches are whatever the task's loaders yield; the trainer only moves them to the device."""

    spec: DataSpec
    eval_splits: tuple[str, ...] = ("val",)  # splits eval_loader reads; the trainer scores those after "val" at the end
    # validation passes score the first val_samples samples of "val" (None: all), whatever the batch size and the
    # number of processes (the data config's val_samples): curves of runs on one data configuration compare
    val_samples: int | None = None

    def train_loader(self, batch_size: int, rank: int, world_size: int, start_batch: int,
                     accum_steps: int = 1) -> Iterable:
        """Endless batches for this process, skipping its first `start_batch` (resume); `accum_steps` micro-batches
        per process make one optimizer step (a ResumableBatchSampler: each step the same samples for any split)."""
        raise NotImplementedError

    def eval_loader(self, split: str, batch_size: int, rank: int = 0, world_size: int = 1,
                    max_samples: int | None = None) -> Iterable:
        """This process's batches of the first `max_samples` samples of `split` (None: the whole split), in order
        (samplers.ordered_batches)."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch) -> Tensor:
        """Mean training loss of one batch (a scalar the trainer back-propagates)."""
        raise NotImplementedError

    def loss_count(self, batch) -> int:
        """How many terms `loss` averages over in this batch (predicted tokens, samples, labels), read on the host batch:
        the trainer weights each micro-batch's mean by it, so that a step's loss is the mean over every term of the
        global batch, whatever the number of processes and micro-batches."""
        raise NotImplementedError

    def eval_sums(self, model: torch.nn.Module, batch) -> dict[str, Tensor]:
        """Additive statistics of one evaluation batch (summed over batches and processes)."""
        raise NotImplementedError

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the summed statistics, named "val_*"; "val_loss" is the one the trainer tracks."""
        raise NotImplementedError

    def tokens(self, batch) -> int:
        """Tokens in one batch, for throughput; called on the batch as the loader yields it (CPU tensors)."""
        raise NotImplementedError

    def sample(self, model: torch.nn.Module, device: torch.device, seed: int) -> str:
        """Something to show a person at the end of a run ("" if the task has nothing to show)."""
        return ""

    def hf_tokenizer(self):
        """The data's tokenizer as a new transformers fast tokenizer (saved beside the model: RUN_DIR/hf/, export), or
        None when the data is not text read through one (LRA's bytes, pixels and symbols)."""
        return None


class ClassificationTask(Task):
    """One label per token row (Long Range Arena: ListOps, Pathfinder, Text, Retrieval, Image): batches
    (tokens (B, T) int64, labels (B,)).

    `splits` is a generated or converted data set cached on disk (flashtrain.data.lra_cache.CachedSplits). Every sample
    is right-padded with pad_id to the longest sample of all splits, so every batch has one shape; the model removes
    the padding. pad_id None: the samples all have one length and no token is padding (Pathfinder's pixel 0 is black).
    Retrieval (paired): each row is two documents, each right-padded to half the row.
    """

    eval_splits = ("val", "test")

    def __init__(self, splits, vocab_size: int, num_classes: int, pad_id: int | None, seed: int, paired: bool = False,
                 length_field: str = "data.max_length", val_samples: int | None = None):
        self.splits, self.seed, self.pad_id, self.val_samples = splits, seed, pad_id, val_samples
        check_splits(splits.directory, {split: np.load(splits.directory / f"{split}.labels.npy")
                                        for split in ("train", *self.eval_splits)}, num_classes)
        self.seq_len = splits.meta["max_length"]
        self.spec = DataSpec("classification", vocab_size, self.seq_len // 2 if paired else self.seq_len,
                             length_field, pad_id, num_classes, paired=paired)

    def dataset(self, split: str):
        """One split as (tokens (seq_len,) int64, label) samples."""
        return self.splits.dataset(split, self.seq_len, pad_id=0 if self.pad_id is None else self.pad_id)

    def train_loader(self, batch_size, rank, world_size, start_batch, accum_steps=1):
        dataset = self.dataset("train")
        sampler = ResumableBatchSampler(len(dataset), batch_size, self.seed, rank, world_size, start_batch, accum_steps)
        return DataLoader(dataset, batch_sampler=sampler, pin_memory=torch.cuda.is_available())

    def eval_loader(self, split, batch_size, rank=0, world_size=1, max_samples=None):
        dataset = self.dataset(split)
        batches = ordered_batches(len(dataset), batch_size, rank, world_size, max_samples, what=f"the {split} split")
        return DataLoader(dataset, batch_sampler=batches, pin_memory=torch.cuda.is_available())

    def loss(self, model, batch) -> Tensor:
        tokens, labels = batch
        return model(tokens, labels)[1]

    def loss_count(self, batch) -> int:
        return batch[1].numel()  # the mean cross-entropy over the batch's samples

    def eval_sums(self, model, batch) -> dict[str, Tensor]:
        tokens, labels = batch
        logits, loss = model(tokens, labels)
        return {"loss": loss.float() * labels.numel(), "correct": (logits.argmax(dim=-1) == labels).sum().float(),
                "samples": torch.tensor(float(labels.numel()))}

    def eval_metrics(self, sums):
        return {"val_loss": sums["loss"] / sums["samples"], "val_accuracy": sums["correct"] / sums["samples"]}

    def tokens(self, batch) -> int:
        tokens = batch[0]
        return tokens.numel() if self.pad_id is None else int(tokens.ne(self.pad_id).sum())
