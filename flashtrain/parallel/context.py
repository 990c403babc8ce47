"""Context parallelism: each sequence of a batch split over N processes, attention as ring attention between them.

`parallel.context=N` turns the W processes of a run into a (W / N) x N device mesh with dimensions ("dp", "cp"):

    rank = dp_rank * N + cp_rank        W = 4, N = 2:   dp 0: ranks 0 1     dp 1: ranks 2 3      (rows: "cp" groups)

The N processes of one "cp" group read the same samples (the sampler deals by data-parallel rank) and each keeps its
share of every sequence: the positions `shard_positions(seq_len, cp_rank, N)` of flashtrain.parallel.ring_attention
gives it (zigzag: the sequence cut into 2N chunks, process i holding chunks i and 2N - 1 - i, so causal attention's
work is the same on every process). Its input ids, targets and position ids are those positions of the batch's
(flashtrain.data.lm.shard_lm_batch); the model reads the global positions (or the document-reset ones), and a packed
batch's `cu_seqlens` stays that of the full sequences, on the host, for ring attention's document masks.

The model code does not change. While a `ContextParallel` is active (`with context.active():`, held by the trainer
around every forward and backward pass, activation checkpointing's recomputation included),
flashtrain.models.attention.attention hands each self-attention call to `ContextParallel.attention`, ring attention
over the "cp" group. Everything else in a Transformer is per token (embeddings, norms, MLPs, the loss) and runs on the
local tokens as it is. Calls ring attention cannot run (non-causal attention, attention dropout, block masks,
key-padding masks, sliding windows, softcapping, a KV cache) raise, naming the setting; `check_model` finds them at
start-up from one forward pass of the model built out of fake tensors (no memory, no arithmetic).

Loss and gradients: each process's loss is the mean over its own tokens, weighted by their share of the global batch's
tokens (the trainer's host-side counts, summed over all processes), so the shares add up to the global mean. Ring
attention's backward returns every key's and value's gradient to the process that holds that token, and DDP over all W
processes (or FSDP2 sharded over all W: the flattened dp x cp mesh, which is the world in rank order) sums the
parameters' gradients: the step is the step of one process on the whole batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                           UnsupportedFakeTensorException, UnsupportedOperatorException)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flashtrain.parallel.ring_attention import ring_attention, shard_positions

LAYOUT = "zigzag"  # how a sequence is dealt to the context ranks (flashtrain.parallel.ring_attention)
MESH_DIMS = ("dp", "cp")
# what a forward pass on fake tensors raises where it needs values (check_model)
FAKE_TENSOR_ERRORS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
                      UnsupportedOperatorException)

_active: ContextParallel | None = None  # the context the attention entry routes to; set by `ContextParallel.active`


def active_context() -> ContextParallel | None:
    """The active context (flashtrain.models.attention.attention reads it at every call), or None."""
    return _active


class ContextParallel:
    """This process's place in a context-parallel run and the share of each sequence it holds.

    group: the process group of the `size` processes that share each sequence (ring attention's), this process its
    `rank`-th; dp_rank of dp_size: its data-parallel group; seq_len: the full sequence length (data.seq_len); device,
    dtype: the run's device and compute dtype (the autocast dtype, or float32), which decide what computes attention.
    `from_mesh` builds it from the ("dp", "cp") DeviceMesh; `mesh` is that mesh (None when built without one)."""

    def __init__(self, group, rank: int, size: int, dp_rank: int, dp_size: int, seq_len: int, device: torch.device,
                 dtype: torch.dtype, mesh: DeviceMesh | None = None):
        self.group, self.rank, self.size, self.dp_rank, self.dp_size = group, rank, size, dp_rank, dp_size
        self.seq_len, self.device, self.dtype, self.mesh = seq_len, torch.device(device), dtype, mesh
        self.local_len = seq_len // size
        # (local_len,) int64 on the host: the global positions this rank holds, in its local order
        self.positions = shard_positions(seq_len, self.rank, self.size, layout=LAYOUT)
        self.probing = False  # check_model: calls are checked and counted, not computed
        self.probed_calls = 0

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, seq_len: int, device: torch.device, dtype: torch.dtype) -> ContextParallel:
        """This process's context of the 2D mesh ("dp", "cp")."""
        return cls(mesh.get_group("cp"), mesh.get_local_rank("cp"), mesh.size(1), mesh.get_local_rank("dp"),
                   mesh.size(0), seq_len, device, dtype, mesh)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Route flashtrain's attention calls to ring attention over the "cp" group while inside."""
        global _active
        previous, _active = _active, self
        try:
            yield
        finally:
            _active = previous

    # ---- the attention entry's route ---------------------------------------------------------------------------

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, impl: str, causal: bool, dropout_p: float,
                  cu_seqlens: Tensor | None, key_padding_mask: Tensor | None, block_mask: Tensor | None,
                  features: tuple[str, ...]) -> Tensor:
        """One self-attention call of the model on this rank's tokens, as ring attention over the "cp" group.
        q, k, v (B, local_len, H, D), or packed (B * local_len, H, D) with the full sequences' cu_seqlens (a model's
        document-masked call); impl: "cuda" (flashtrain's kernel) or "reference", the attention entry's choice.
        -> the output in q's layout."""
        problems = self.unsupported(q, k, causal, dropout_p, key_padding_mask, block_mask, features)
        if problems:
            raise ValueError(f"parallel.context={self.size} runs the model's self-attention as ring attention "
                             f"(causal, over the {self.size} processes that share each sequence), which does not "
                             f"run {'; '.join(problems)}. Change those settings or train with parallel.context=1")
        if self.probing:
            self.probed_calls += 1
            return torch.empty_like(q)
        packed = q.dim() == 3
        if packed:  # (B * local_len, H, D) -> (B, local_len, H, D)
            q, k, v = (t.unflatten(0, (-1, self.local_len)) for t in (q, k, v))
        out = ring_attention(q, k, v, group=self.group, causal=True, cu_seqlens=cu_seqlens, layout=LAYOUT,
                             deterministic=torch.are_deterministic_algorithms_enabled(), impl=impl)
        return out.flatten(0, 1) if packed else out

    def unsupported(self, q: Tensor, k: Tensor, causal: bool, dropout_p: float, key_padding_mask: Tensor | None,
                    block_mask: Tensor | None, features: tuple[str, ...]) -> list[str]:
        """What in one attention call ring attention does not run, in words that name the setting."""
        problems = []
        if not causal:
            problems.append("non-causal attention (a bidirectional model: BERT, RoBERTa, the LRA encoder)")
        if dropout_p > 0:
            problems.append(f"attention dropout (dropout_p={dropout_p:g}: the model's attention dropout, "
                            f"model.attn_dropout; set it to 0)")
        if block_mask is not None:
            problems.append("a block mask (block-sparse attention)")
        if key_padding_mask is not None:
            problems.append("a key-padding mask (padded batches)")
        names = {"window_size": "a sliding window (model.attn_window)",
                 "softcap": "logit softcapping (model.attn_softcap)"}
        problems += [names[feature] for feature in features]
        if q.dim() == 4 and k.shape[1] != q.shape[1]:
            problems.append(f"keys longer than the queries ({k.shape[1]} vs {q.shape[1]}: a KV cache)")
        elif q.shape[-3] % self.local_len:
            problems.append(f"{q.shape[-3]} tokens, not the {self.local_len} of a {self.seq_len}-token sequence "
                            f"split {self.size} ways (data.seq_len)")
        return problems

    # ---- start-up ----------------------------------------------------------------------------------------------

    def check_model(self, model_cfg) -> None:
        """Start-up check (before any data is prepared): build the model out of fake tensors (shapes, dtypes and the
        run's device, no memory, no arithmetic: torch's FakeTensorMode) and run one training-mode forward pass of a
        local_len-token sequence under this context and the run's autocast, which checks every attention call the
        model makes (`unsupported`, and the attention entry's backend check) without computing it. Raises ValueError
        naming what ring attention cannot run, or when the model makes no call through
        flashtrain.models.attention.attention (its attention would not be split)."""
        self.probing, self.probed_calls = True, 0
        try:
            with FakeTensorMode(), self.device:
                model = model_cfg.build()
                model.train()  # attention dropout is a training-mode setting
                input_ids = torch.zeros(1, self.local_len, dtype=torch.long)
                with self.active(), torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32):
                    try:
                        model(input_ids)
                    except (NotImplementedError, *FAKE_TENSOR_ERRORS) as error:  # an op fake tensors cannot run
                        raise RuntimeError(f"parallel.context={self.size}: checking {type(model_cfg).__name__}'s "
                                           f"attention calls runs its forward pass on fake tensors, which failed: "
                                           f"{type(error).__name__}: {error}") from error
        finally:
            self.probing = False
        if self.probed_calls == 0:
            raise ValueError(f"parallel.context={self.size}: {type(model_cfg).__name__}'s forward pass makes no call "
                             f"to flashtrain.models.attention.attention, so its attention cannot be split over "
                             f"processes; train it with parallel.context=1")


def check_shape(context: int, num_processes: int, seq_len: int | None, length_field: str) -> None:
    """parallel.context must divide the number of processes and 2 x parallel.context the sequence length (the zigzag
    layout's 2N chunks): a ValueError naming parallel.context, the process count and the length's key otherwise."""
    if num_processes % context:
        raise ValueError(f"parallel.context={context} does not divide the {num_processes} process(es): the processes "
                         f"form (processes / parallel.context) data-parallel groups of parallel.context processes "
                         f"that share each sequence of {length_field}={seq_len} tokens; launch a multiple of "
                         f"{context} processes or change parallel.context")
    if seq_len is None or seq_len % (2 * context):
        raise ValueError(f"{length_field}={seq_len} is not a multiple of 2 x parallel.context = {2 * context} "
                         f"({num_processes} processes): the zigzag layout cuts each sequence into 2 x "
                         f"parallel.context chunks, two for each of the {context} processes that share it")


def build_context_parallel(context: int, num_processes: int, device: torch.device, dtype: torch.dtype,
                           data_cfg) -> ContextParallel | None:
    """The ContextParallel of this process for parallel.context=`context` (None for 1): the mesh of all
    `num_processes` processes (the default process group must be up: Accelerate's), after checking the shape
    (`check_shape`) and that the data config (its preview: nothing prepared) gives causal-LM data. device, dtype: the
    run's device and compute dtype."""
    if context == 1:
        return None
    spec = data_cfg.preview()
    if spec.task != "causal_lm":
        raise ValueError(f"parallel.context={context} splits the sequences of causal language-model data (task "
                         f"causal_lm) over processes; {type(data_cfg).__name__} gives {spec.task} data (bidirectional "
                         f"models and padded batches are not split): train it with parallel.context=1")
    seq_len = spec.max_length
    check_shape(context, num_processes, seq_len, spec.length_field)
    if not dist.is_initialized():
        raise RuntimeError(f"parallel.context={context}: no process group; launch {num_processes} processes with "
                           f"accelerate launch or torchrun")
    mesh = init_device_mesh(torch.device(device).type, (num_processes // context, context), mesh_dim_names=MESH_DIMS)
    return ContextParallel.from_mesh(mesh, seq_len, device, dtype)
