"""Padding removal for the encoders: a right-padded batch (B, T, ...) <-> the packed real tokens (total, ...).

Every layer then runs on the packed tokens only and attention takes them with cu_seqlens (flash_attn_varlen_func),
so no work is spent on padding (flash-attention's bert_padding.py does the same). Finding the real tokens of a CUDA
mask costs one host sync (their number sizes the packed tensor); an `Unpadding` built from the host batch
(Unpadding.of on CPU tensors, then .to(device)) and passed to the model costs none.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flashtrain.kernels.interface import check_cu_seqlens


class Unpadding(NamedTuple):
    """Where the real tokens of a right-padded (B, T) batch are: what the model needs to run on them packed."""

    indices: Tensor  # (total,) int64: positions of the real tokens in the flattened (B * T) batch, row-major
    cu_seqlens: Tensor  # (B + 1,) int32: sequence b is packed rows cu_seqlens[b]:cu_seqlens[b + 1]
    max_seqlen: int  # T, a bound on every length (it only sizes the kernels' grid; the true maximum needs a sync)
    masked_rows: Tensor | None = None  # masked-LM: (n_masked,) int64 packed rows whose label is not -100

    @classmethod
    def of(cls, attention_mask: Tensor, labels: Tensor | None = None) -> "Unpadding":
        """attention_mask (B, T), nonzero at real tokens; labels (B, T) (masked LM) or None. No host sync on CPU
        tensors (the loader's batch); on CUDA tensors torch.nonzero syncs (the number of tokens is data)."""
        is_real = attention_mask.bool()
        seqlens = is_real.sum(dim=1, dtype=torch.int32)  # (B,)
        indices = torch.nonzero(is_real.flatten()).flatten()  # (total,)
        cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))  # (B + 1,)
        if cu_seqlens.device.type == "cpu":  # the loader's batch: checked before the copy to the GPU (there, a bad
            # one would be a device-side assert that ends the process; a CUDA mask is not read back: that syncs)
            check_cu_seqlens(cu_seqlens, indices.numel(), attention_mask.shape[1], name="cu_seqlens")
        masked_rows = None
        if labels is not None:
            masked_rows = torch.nonzero(labels.flatten()[indices] != -100).flatten()  # (n_masked,)
        return cls(indices, cu_seqlens, attention_mask.shape[1], masked_rows)

    def to(self, device: torch.device | str) -> "Unpadding":
        """The same on `device`, copied without waiting (the host batch's tensors stay alive until the copy ran)."""
        moved = [None if x is None else x.to(device, non_blocking=True)
                 for x in (self.indices, self.cu_seqlens, self.masked_rows)]
        return Unpadding(moved[0], moved[1], self.max_seqlen, moved[2])


def unpad_indices(attention_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """attention_mask (B, T), nonzero at real tokens -> (indices, cu_seqlens, max_seqlen) of Unpadding.of."""
    return Unpadding.of(attention_mask)[:3]


def check_values(valid: Tensor, message: str) -> None:
    """Raise ValueError(message) unless the bool scalar `valid` is True: at once on the CPU; on a GPU as a device
    assert (torch._assert_async) that stops the program at the next synchronisation, so a training step never waits
    on the check."""
    if valid.device.type == "cpu":
        if not bool(valid):
            raise ValueError(message)
    else:
        torch._assert_async(valid, message)


def pad_packed(packed: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """packed (total, ...) -> (batch, seqlen, ...) with zeros at pad positions; inverse of x.flatten(0, 1)[indices]."""
    padded = packed.new_zeros(batch * seqlen, *packed.shape[1:]).index_copy(0, indices, packed)
    return padded.view(batch, seqlen, *packed.shape[1:])
