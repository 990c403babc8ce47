"""Which samples each process reads, in which order: endless resumable training batches, fixed evaluation batches.

`rank` and `world_size` are data-parallel ones: with context parallelism (parallel.context=N) the N processes of a
group share each sequence, so they are given the group's rank among W / N groups and read the same samples.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableBatchSampler(Sampler[list[int]]):
    """Endless batches of sample indices for one rank, resumable at any batch without replaying the ones before; each
    optimizer step is the same set of samples however it is split into processes and micro-batches.

    Epoch e shuffles all samples with a torch.Generator seeded from (seed, e). Optimizer step s of the epoch takes the
    next global batch of that permutation, batch_size * world_size * accum_steps indices, and micro-batch m of the
    step on rank r gets its (m * world_size + r)-th batch_size of them: ranks are disjoint, and 2 processes x 8 samples
    read the same 16 samples in a step as 1 process x 8 x 2 micro-batches (the loss of a step is then the same, up to
    float summation order). The remainder that does not fill a step is dropped (every rank sees full batches, the same
    number). `start_batch` counts this rank's micro-batches already consumed: the sampler jumps straight to epoch
    start_batch // batches_per_epoch at that offset. A run resumed with another number of processes or another
    micro-batch continues at the same sample when the global batch is unchanged (start_batch = samples consumed /
    (batch_size * world_size)).
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 start_batch: int = 0, accum_steps: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")
        global_batch = batch_size * world_size * accum_steps
        if num_samples < global_batch:
            raise ValueError(f"num_samples={num_samples} is fewer than batch_size * world_size * accum_steps = "
                             f"{batch_size} * {world_size} * {accum_steps} = {global_batch}: not one full step of data")
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.accum_steps = accum_steps
        self.start_batch = start_batch
        self.steps_per_epoch = num_samples // global_batch
        self.batches_per_epoch = self.steps_per_epoch * accum_steps  # this rank's micro-batches per epoch

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        """(num_samples,) int64: the shuffled sample order of `epoch`, the same on every rank."""
        # one 63-bit seed per (seed, epoch) pair: no two pairs share a stream, unlike seed + epoch
        digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, first_batch = divmod(self.start_batch, self.batches_per_epoch)
        while True:
            order = self.epoch_permutation(epoch)
            for batch in range(first_batch, self.batches_per_epoch):
                # micro-batch `batch` of this rank = micro-batch m of step s; slot m * world_size + rank of the step
                step, micro = divmod(batch, self.accum_steps)
                slot = step * self.accum_steps * self.world_size + micro * self.world_size + self.rank
                yield order[slot * self.batch_size:(slot + 1) * self.batch_size].tolist()
            epoch, first_batch = epoch + 1, 0


def ordered_batches(n_samples: int, batch_size: int, rank: int, world_size: int, max_samples: int | None,
                    what: str) -> list[list[int]]:
    """This process's share of the first `max_samples` samples of a split (None: all), read in order, the same every
    pass: batches of batch_size consecutive sample indices (the last may be short) dealt round-robin over ranks (rank
    r gets batches r, r + world_size, ...). Every process count and batch size scores the same samples. `what` names
    the split in errors."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"{what}: max_samples must be >= 1 (or None: all), got {max_samples}")
    n_scored = n_samples if max_samples is None else min(n_samples, max_samples)
    n_batches = math.ceil(n_scored / batch_size)
    if n_batches < world_size:
        raise ValueError(f"{what} has {n_samples} samples: {n_scored} scored make {n_batches} batches of "
                         f"batch_size={batch_size}, fewer than the {world_size} processes")
    return [list(range(b * batch_size, min((b + 1) * batch_size, n_scored))) for b in range(rank, n_batches, world_size)]


class NumberedBatches(Sampler[list[tuple[int, int]]]):
    """Each batch of `batches` as [(number, index), ...] for datasets whose samples depend on the batch they are served
    in (dynamically masked ones): batch i is numbered (first_batch + i) // batches_per_number. With a
    ResumableBatchSampler's micro-batches, first_batch = its start_batch and batches_per_number = its accum_steps, the
    number is the optimizer step, the same for a sample whatever the number of processes and micro-batches."""

    def __init__(self, batches, first_batch: int = 0, batches_per_number: int = 1):
        self.batches, self.first_batch, self.batches_per_number = batches, first_batch, batches_per_number

    def __iter__(self):
        for i, batch in enumerate(self.batches, start=self.first_batch):
            number = i // self.batches_per_number
            yield [(number, index) for index in batch]

    def __len__(self) -> int:
        return len(self.batches)
