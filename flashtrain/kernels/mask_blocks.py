"""The GPU side of MaskMod.block_states: launches csrc/mask_blocks.cu, the mask expression compiled in (mask_mod)."""

from __future__ import annotations

import torch
from torch import Tensor


def mask_mod_params(mask, error: Tensor):
    """launch.MaskModParams of a MaskMod's tensors (in the order given: FT_MASK_DECLS reads them by position)."""
    from flashtrain.kernels import launch

    params = launch.MaskModParams(error=error.data_ptr())
    for i, tensor in enumerate(mask.tensors.values()):
        params.ptr[i] = tensor.data_ptr()
        for dim in range(tensor.dim()):
            params.size[i][dim], params.stride[i][dim] = tensor.shape[dim], tensor.stride(dim)
    return params


def block_states(mask, batches: int, heads: int, seqlen_q: int, seqlen_k: int, block: int,
                 cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                 window: tuple[int, int] = (-1, -1), device=None) -> tuple[Tensor, Tensor]:
    from flashtrain.kernels import build, launch

    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for name, tensor in mask.tensors.items():
        if tensor.device != device or tensor.dim() > 4:
            raise ValueError(f"mask_mod tensor {name!r}: the GPU path needs tensors on {device} of at most 4 "
                             f"dimensions, got {tensor.device} {tensor.dim()}-d")
    n_q, n_k = -(-seqlen_q // block), -(-seqlen_k // block)
    states = torch.empty(batches, heads, n_q, n_k, dtype=torch.uint8, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    if cu_seqlens_q is not None:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32 or cu.shape != (batches + 1,) or not cu.is_contiguous():
                raise ValueError(f"{name} must be contiguous int32 ({batches + 1},), got {cu.dtype} {tuple(cu.shape)}")
    params = launch.MaskBlocksParams(
        mm=mask_mod_params(mask, error), states=states.data_ptr(),
        cu_seqlens_q=cu_seqlens_q.data_ptr() if cu_seqlens_q is not None else 0,
        cu_seqlens_k=cu_seqlens_k.data_ptr() if cu_seqlens_k is not None else 0,
        heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, n_qblocks=n_q, n_kblocks=n_k, block=block,
        window_left=window[0], window_right=window[1])
    spec = build.mask_blocks_kernel(mask)
    # grid (n_kblocks * B' * H', n_qblocks): x has room for any batch x heads (z stops at 65535)
    launch.get_kernel(spec, spec.symbols[0], device).launch((n_k * batches * heads, n_q, 1), params, device)
    return states, error
