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

from flashtrain.data.lm import LMDataConfig, make_train_loader, make_val_loader, prepare_lm_data


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
        """Tokens in one batch, for throughput."""
        raise NotImplementedError

    def sample(self, model: torch.nn.Module, device: torch.device, seed: int, n_tokens: int, prompt: str) -> str:
        """Something to show a person at the end of a run ("" if the task has nothing to show)."""
        return ""


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


def build_task(data_cfg) -> Task:
    """The data config's type decides the task."""
    if isinstance(data_cfg, LMDataConfig):
        return LMTask(data_cfg)
    raise TypeError(f"data: no task is registered for config type {type(data_cfg).__name__}")
