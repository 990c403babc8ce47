"""Tasks: what the trainer trains on and how it scores it. The trainer knows nothing else about data.

A task turns a data config into loaders of opaque batches (tuples or dicts of tensors), says how a model computes the
training loss on a batch, and reduces evaluation batches to metrics. The data config's type picks the task (as the
model config's type picks the model), so a recipe selects both by naming config files.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import Tensor

from torch.utils.data import DataLoader

from flashtrain.data import listops
from flashtrain.data.listops import ListOpsConfig, prepare_listops
from flashtrain.data.lm import LMDataConfig, ResumableBatchSampler, make_train_loader, make_val_loader, prepare_lm_data
from flashtrain.data import lra_hf
from flashtrain.data.lra_hf import LRAImageConfig, LRARetrievalConfig, LRATextConfig
from flashtrain.data.pathfinder import PathfinderConfig, prepare_pathfinder
from flashtrain.data.documents import (EcthrConfig, LongDocConfig, MimicConfig, load_tokenizer, pad_collate,
                                       prepare_documents)
from flashtrain.data.mlm import MaskedLMDataConfig, make_mlm_train_loader, make_mlm_val_loader, prepare_mlm_data
from flashtrain.models.bert import BertConfig


class Task:
    """Interface. Batches are whatever the task's loaders yield; the trainer only moves them to the device."""

    def check_model(self, model_cfg: Any) -> None:
        """Raise ValueError when the model config cannot run this task (vocabulary, lengths, labels)."""

    def train_loader(self, batch_size: int, rank: int, world_size: int, start_batch: int) -> Iterable:
        """Endless batches for this process, skipping the first `start_batch` (resume)."""
        raise NotImplementedError

    def eval_loader(self, batch_size: int, rank: int, world_size: int, max_batches: int) -> Iterable:
        """A fixed, finite set of validation batches for this process."""
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch) -> Tensor:
        """Mean training loss of one batch (a scalar the trainer back-propagates)."""
        raise NotImplementedError

    def eval_sums(self, model: torch.nn.Module, batch) -> dict[str, Tensor]:
        """Additive statistics of one validation batch (summed over batches and processes)."""
        raise NotImplementedError

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the summed statistics; "val_loss" is the one the trainer tracks."""
        raise NotImplementedError

    def tokens(self, batch) -> int:
        """Tokens in one batch, for throughput; called on the batch as the loader yields it (CPU tensors)."""
        raise NotImplementedError

    def sample(self, model: torch.nn.Module, device: torch.device, seed: int, n_tokens: int, prompt: str) -> str:
        """Something to show a person at the end of a run ("" if the task has nothing to show)."""
        return ""

    def final_metrics(self, model: torch.nn.Module, device: torch.device, batch_size: int) -> dict[str, float]:
        """Metrics computed once at the end of training, in the main process (e.g. test-split accuracy); {} if none."""
        return {}


class LMTask(Task):
    """Next-token prediction on packed blocks of a token file (GPT-style)."""

    def __init__(self, cfg: LMDataConfig):
        self.data = prepare_lm_data(cfg)
        self.num_workers = cfg.num_workers

    def check_model(self, model_cfg) -> None:
        if model_cfg.vocab_size < self.data.vocab_size:
            raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                             f"({self.data.vocab_size})")
        if self.data.seq_len > model_cfg.n_positions:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.n_positions={model_cfg.n_positions}")

    def train_loader(self, batch_size, rank, world_size, start_batch):
        return make_train_loader(self.data, batch_size, rank=rank, world_size=world_size, start_batch=start_batch,
                                 num_workers=self.num_workers)

    def eval_loader(self, batch_size, rank, world_size, max_batches):
        return make_val_loader(self.data, batch_size, max_batches=max_batches, rank=rank, world_size=world_size)

    def loss(self, model, batch) -> Tensor:
        x, y = batch
        return model(x, y)[1]

    def eval_sums(self, model, batch) -> dict[str, Tensor]:
        x, y = batch
        return {"loss": model(x, y)[1].float() * y.numel(), "tokens": torch.tensor(float(y.numel()))}

    def eval_metrics(self, sums):
        val_loss = sums["loss"] / sums["tokens"]
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}

    def tokens(self, batch) -> int:
        return batch[0].numel()

    @torch.no_grad()
    def sample(self, model, device, seed, n_tokens, prompt) -> str:
        model.eval()  # no dropout while sampling
        ids = self.data.tokenizer.encode(prompt).ids or [self.data.eos_id]
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        out = model.generate(idx, max_new_tokens=n_tokens, temperature=0.8, top_k=50, generator=generator)
        return self.data.tokenizer.decode(out[0].tolist())


def ordered_batches(n_samples: int, split: str, batch_size: int, rank: int, world_size: int,
                    max_batches: int | None) -> list[list[int]]:
    """This process's share of a split read in order: batches of consecutive sample indices (the last may be short),
    the first `max_batches` (None: all) dealt round-robin over ranks (rank r gets batches r, r + world_size, ...)."""
    n_batches = math.ceil(n_samples / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    if n_batches < world_size:
        raise ValueError(f"the {split} split has {n_samples} samples: {n_batches} batches of batch_size={batch_size}, "
                         f"fewer than the {world_size} processes")
    return [list(range(b * batch_size, min((b + 1) * batch_size, n_samples))) for b in range(rank, n_batches, world_size)]


class ClassificationTask(Task):
    """One label per sequence (Long Range Arena: ListOps, Pathfinder): batches (tokens (B, T) int64, labels (B,)).

    The generated data set is cached on disk (flashtrain.data.lra_cache). Every sample is right-padded with pad_id to
    the longest sample of all splits, so every batch has one shape; the model removes the padding. pad_id None: the
    samples all have one length and no token is padding (Pathfinder's pixel 0 is black).
    """

    def __init__(self, data_cfg: ListOpsConfig | PathfinderConfig):
        if isinstance(data_cfg, ListOpsConfig):
            self.splits = prepare_listops(data_cfg)
            self.vocab_size, self.num_classes, self.pad_id = listops.VOCAB_SIZE, listops.NUM_CLASSES, listops.PAD_ID
        elif isinstance(data_cfg, PathfinderConfig):
            self.splits = prepare_pathfinder(data_cfg)
            self.vocab_size, self.num_classes, self.pad_id = 256, 2, None  # pixel values; connected or not
        elif isinstance(data_cfg, (LRATextConfig, LRARetrievalConfig)):  # bytes + 1, 0 pads
            prepare = lra_hf.prepare_lra_text if isinstance(data_cfg, LRATextConfig) else lra_hf.prepare_lra_retrieval
            self.splits = prepare(data_cfg)
            self.vocab_size, self.num_classes, self.pad_id = lra_hf.BYTE_VOCAB_SIZE, data_cfg.num_classes, lra_hf.PAD_ID
        elif isinstance(data_cfg, LRAImageConfig):
            self.splits = lra_hf.prepare_lra_image(data_cfg)
            self.vocab_size, self.num_classes, self.pad_id = lra_hf.PIXEL_VOCAB_SIZE, data_cfg.num_classes, None
        else:
            raise TypeError(f"data: ClassificationTask takes ListOpsConfig, PathfinderConfig or an LRA*Config of "
                            f"flashtrain.data.lra_hf, got {type(data_cfg).__name__}")
        # Retrieval: each row is two documents, each right-padded to half the row (model.dual splits it)
        self.paired = isinstance(data_cfg, LRARetrievalConfig)
        self.seed = data_cfg.seed
        self.seq_len = self.splits.meta["max_length"]

    def dataset(self, split: str):
        """One split as (tokens (seq_len,) int64, label) samples."""
        return self.splits.dataset(split, self.seq_len, pad_id=0 if self.pad_id is None else self.pad_id)

    def check_model(self, model_cfg) -> None:
        if model_cfg.vocab_size < self.vocab_size:
            raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the data's vocabulary "
                             f"({self.vocab_size})")
        if model_cfg.num_classes != self.num_classes:
            raise ValueError(f"model.num_classes={model_cfg.num_classes} differs from the data's {self.num_classes}")
        if model_cfg.pad_id != self.pad_id:
            raise ValueError(f"model.pad_id={model_cfg.pad_id} differs from the data's padding id {self.pad_id}")
        if model_cfg.dual != self.paired:
            raise ValueError(f"model.dual={model_cfg.dual}, but the data's rows are "
                             f"{'document pairs' if self.paired else 'single sequences'}")
        longest = self.seq_len // 2 if self.paired else self.seq_len
        if longest > model_cfg.max_tokens:
            raise ValueError(f"the data's longest sample has {longest} tokens, more than the model takes "
                             f"({model_cfg.max_tokens}: model.max_len={model_cfg.max_len}, "
                             f"pooling={model_cfg.pooling!r}); raise model.max_len")

    def train_loader(self, batch_size, rank, world_size, start_batch):
        dataset = self.dataset("train")
        sampler = ResumableBatchSampler(len(dataset), batch_size, self.seed, rank, world_size, start_batch)
        return DataLoader(dataset, batch_sampler=sampler, pin_memory=torch.cuda.is_available())

    def eval_loader(self, batch_size, rank, world_size, max_batches):
        return self.split_loader("val", batch_size, rank, world_size, max_batches)

    def split_loader(self, split: str, batch_size: int, rank: int = 0, world_size: int = 1,
                     max_batches: int | None = None) -> DataLoader:
        """`split` in order, the same every pass, as batches of consecutive samples (the last may be short); the
        first `max_batches` (None: all) are dealt round-robin over ranks (rank r gets batches r, r + world_size...)."""
        dataset = self.dataset(split)
        batches = ordered_batches(len(dataset), split, batch_size, rank, world_size, max_batches)
        return DataLoader(dataset, batch_sampler=batches, pin_memory=torch.cuda.is_available())

    def loss(self, model, batch) -> Tensor:
        tokens, labels = batch
        return model(tokens, labels)[1]

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

    def final_metrics(self, model, device, batch_size) -> dict[str, float]:
        test = evaluate_split(model, self, "test", batch_size, device)
        return {"test_loss": test["loss"], "test_accuracy": test["accuracy"]}


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, task: ClassificationTask, split: str, batch_size: int,
                   device: torch.device | str = "cpu") -> dict[str, float]:
    """Loss and accuracy of `model` over every sample of `split` ("val", "test"), in one process:
    {"loss", "accuracy", "samples"}."""
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    for tokens, labels in task.split_loader(split, batch_size):
        for key, value in task.eval_sums(model, (tokens.to(device), labels.to(device))).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    model.train(was_training)
    return {"loss": sums["loss"] / sums["samples"], "accuracy": sums["correct"] / sums["samples"],
            "samples": int(sums["samples"])}


class MaskedLMTask(Task):
    """BERT masked-LM pretraining (flashtrain.data.mlm): batches {"input_ids", "attention_mask", "labels"} (B, T),
    dynamically masked, labels -100 where nothing is predicted. Metrics: val_loss (mean cross-entropy over the
    predicted tokens) and val_mlm_accuracy (share of predicted tokens whose argmax is the original)."""

    def __init__(self, cfg: MaskedLMDataConfig):
        self.data = prepare_mlm_data(cfg)
        self.num_workers = cfg.num_workers

    def check_model(self, model_cfg) -> None:
        if not isinstance(model_cfg, BertConfig) or model_cfg.head != "masked_lm":
            raise ValueError("masked-LM data needs a BERT/RoBERTa model with model.head=masked_lm")
        _check_bert_tokens(model_cfg, self.data.vocab_size, self.data.pad_id, self.data.seq_len, "data.seq_len")

    def train_loader(self, batch_size, rank, world_size, start_batch):
        return make_mlm_train_loader(self.data, batch_size, rank, world_size, start_batch, self.num_workers)

    def eval_loader(self, batch_size, rank, world_size, max_batches):
        return make_mlm_val_loader(self.data, batch_size, max_batches, rank, world_size)

    def loss(self, model, batch) -> Tensor:
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])[1]

    def eval_sums(self, model, batch) -> dict[str, Tensor]:
        logits, loss = model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])
        targets = batch["labels"][batch["labels"] != -100]  # (n_masked,): the order of the logits' rows
        return {"loss": loss.float() * targets.numel(), "correct": (logits.argmax(-1) == targets).sum().float(),
                "masked": torch.tensor(float(targets.numel()))}

    def eval_metrics(self, sums):
        return {"val_loss": sums["loss"] / sums["masked"], "val_mlm_accuracy": sums["correct"] / sums["masked"]}

    def tokens(self, batch) -> int:
        return int(batch["attention_mask"].sum())


class DocumentClassificationTask(Task):
    """Long documents -> one label (single_label) or a set of labels (multi_label): ECtHR, MIMIC-III top-50, the
    embedded long-document task (flashtrain.data.documents). Batches {"input_ids", "attention_mask"} (B, T),
    right-padded to the longest document of the batch (the model removes the padding), "labels" (B,) class ids or
    (B, num_labels) 0/1. Every document is cut to data.max_length tokens, [CLS]/[SEP] included.

    Metrics: val_loss, and val_accuracy (single_label) or val_micro_f1 / val_macro_f1 (multi_label: a label is
    predicted when its logit is > 0, i.e. probability > 0.5; micro-F1 from the true/false positives and false
    negatives summed over labels, macro-F1 the mean of the per-label F1s, a label with none of them counting 0, as
    scikit-learn's f1_score(zero_division=0) that LexGLUE reports).
    """

    def __init__(self, cfg: EcthrConfig | MimicConfig | LongDocConfig):
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.splits = prepare_documents(cfg, self.tokenizer)
        self.max_length, self.seed, self.num_workers = cfg.max_length, cfg.seed, cfg.num_workers
        self.problem_type, self.num_labels = self.splits.problem_type, self.splits.num_labels
        self.pad_id = self.tokenizer.pad_token_id

    def dataset(self, split: str):
        return self.splits.dataset(split, self.max_length, self.tokenizer.cls_token_id, self.tokenizer.sep_token_id)

    def check_model(self, model_cfg) -> None:
        if not isinstance(model_cfg, BertConfig) or model_cfg.head != "classification":
            raise ValueError("document classification needs a BERT/RoBERTa model with model.head=classification")
        if (model_cfg.num_labels, model_cfg.problem_type) != (self.num_labels, self.problem_type):
            raise ValueError(f"model.num_labels={model_cfg.num_labels}, model.problem_type={model_cfg.problem_type!r}"
                             f" differ from the data's {self.num_labels}, {self.problem_type!r}")
        _check_bert_tokens(model_cfg, len(self.tokenizer), self.pad_id, self.max_length, "data.max_length")

    def train_loader(self, batch_size, rank, world_size, start_batch):
        dataset = self.dataset("train")
        sampler = ResumableBatchSampler(len(dataset), batch_size, self.seed, rank, world_size, start_batch)
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate(self.pad_id),
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def eval_loader(self, batch_size, rank, world_size, max_batches):
        return self.split_loader("val", batch_size, rank, world_size, max_batches)

    def split_loader(self, split: str, batch_size: int, rank: int = 0, world_size: int = 1,
                     max_batches: int | None = None) -> DataLoader:
        """`split` in order, batches of consecutive documents (the last may be short); the first max_batches (None:
        all) dealt round-robin over ranks."""
        dataset = self.dataset(split)
        batches = ordered_batches(len(dataset), split, batch_size, rank, world_size, max_batches)
        return DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate(self.pad_id),
                          pin_memory=torch.cuda.is_available())

    def loss(self, model, batch) -> Tensor:
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"])[1]

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

    @torch.no_grad()
    def final_metrics(self, model, device, batch_size) -> dict[str, float]:
        """The same metrics on the whole test split, once at the end of training (test_loss, test_accuracy or
        test_micro_f1 / test_macro_f1); bf16 autocast on a GPU, as training."""
        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        for batch in self.split_loader("test", batch_size):
            with autocast:
                batch_sums = self.eval_sums(model, {k: v.to(device) for k, v in batch.items()})
            for key, value in batch_sums.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        model.train(was_training)
        return {"test_" + key.removeprefix("val_"): value for key, value in self.eval_metrics(sums).items()}

    def tokens(self, batch) -> int:
        return int(batch["attention_mask"].sum())


def _check_bert_tokens(model_cfg: BertConfig, vocab_size: int, pad_id: int, length: int, length_name: str) -> None:
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({vocab_size})")
    if model_cfg.pad_token_id != pad_id:
        raise ValueError(f"model.pad_token_id={model_cfg.pad_token_id} differs from the tokenizer's pad id {pad_id}")
    if length > model_cfg.max_seqlen:
        raise ValueError(f"{length_name}={length} exceeds the model's longest input, {model_cfg.max_seqlen} tokens "
                         f"(model.max_length / max_position_embeddings)")


def build_task(data_cfg) -> Task:
    """The data config's type decides the task."""
    if isinstance(data_cfg, LMDataConfig):
        return LMTask(data_cfg)
    if isinstance(data_cfg, (ListOpsConfig, PathfinderConfig, LRATextConfig, LRARetrievalConfig, LRAImageConfig)):
        return ClassificationTask(data_cfg)
    if isinstance(data_cfg, MaskedLMDataConfig):
        return MaskedLMTask(data_cfg)
    if isinstance(data_cfg, (EcthrConfig, MimicConfig, LongDocConfig)):
        return DocumentClassificationTask(data_cfg)
    raise TypeError(f"data: no task is registered for config type {type(data_cfg).__name__}")
