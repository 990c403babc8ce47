"""Ring attention: exact attention over a sequence split across the ranks of a process group (context parallelism).

Each rank holds seqlen / world tokens of every sequence (shard_positions: zigzag or contiguous) with their q, k, v.
Forward: world steps; at step s a rank attends its queries to the key / value block that started on rank
(rank - s) % world while that block moves one rank on (P2P isend / irecv to rank + 1 from rank - 1, overlapped with
the step's compute), and folds each partial (out, lse) into a running one by log-sum-exp (blockwise.merge_block).
Backward: the key / value blocks go round again; dq accumulates where it is, each block's dK / dV accumulate as they
travel with it and arrive back at its owner after world steps. Every block's backward takes the global out and lse of
the forward, so the blocks' gradients add up to the exact ones. Design and tests: docs/context_parallel.md.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from flashtrain.kernels.interface import IMPLS, _check_qkv, _check_scalars, _cuda_ops_to_use, check_cu_seqlens
from flashtrain.parallel.blockwise import (LAYOUTS, block_backward, block_forward, local_segments, merge_block,
                                           ring_schedule)

__all__ = ["LAYOUTS", "ring_attention", "shard_positions", "shard_sequence", "unshard_sequence"]

_KV_TAG, _DKV_TAG = 0, 1  # the backward has both in flight to the same peer at once


def shard_positions(seqlen: int, rank: int, world: int, layout: str = "zigzag") -> Tensor:
    """int64 global positions (0..seqlen-1) of the tokens `rank` of `world` holds, in local order. zigzag: the
    sequence cut in 2 * world equal chunks, rank r holds chunks r and 2 world - 1 - r (the same causal work on every
    rank); contiguous: chunk r of world. seqlen must be divisible by 2 * world (zigzag) or world (contiguous)."""
    return torch.cat([torch.arange(seg.start, seg.start + seg.length)
                      for seg in local_segments(seqlen, rank, world, layout)])


def shard_sequence(x: Tensor, dim: int, rank: int, world: int, layout: str = "zigzag") -> Tensor:
    """The tokens of x (the full sequence along `dim`) that `rank` holds, in local order: a new tensor,
    x.index_select(dim, shard_positions(x.shape[dim], rank, world, layout))."""
    dim = dim % x.dim()
    return torch.cat([x.narrow(dim, seg.start, seg.length)
                      for seg in local_segments(x.shape[dim], rank, world, layout)], dim)


def unshard_sequence(local: Tensor, dim: int, group=None, layout: str = "zigzag") -> Tensor:
    """The full sequence along `dim` from every rank's shard (shard_sequence's inverse): an all-gather over `group`
    (None: the default group) and a reorder. Not differentiable (for outputs, checks and tests)."""
    world = dist.get_world_size(group)
    dim = dim % local.dim()
    seqlen = local.shape[dim] * world
    segments = [local_segments(seqlen, rank, world, layout) for rank in range(world)]  # (checked before talking)
    local = local.contiguous()
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    pieces = {seg.start: shard.narrow(dim, seg.local_start, seg.length)
              for shard, rank_segments in zip(gathered, segments) for seg in rank_segments}
    return torch.cat([pieces[start] for start in sorted(pieces)], dim)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool, softmax_scale: float | None = None,
                   cu_seqlens: Tensor | None = None, layout: str = "zigzag", deterministic: bool = False,
                   return_lse: bool = False, impl: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Attention softmax(q k^T * softmax_scale) v over sequences split across the ranks of `group`.

    Args:
        q: (batch, seqlen_local, nheads, head_dim) on each rank: the tokens shard_positions(seqlen_local * world,
            rank, world, layout) of every sequence (shard_sequence cuts them). float16 / bfloat16 on the CUDA kernels,
            also float32 / float64 on the reference.
        k, v: (batch, seqlen_local, nheads_kv, head_dim), the same tokens; nheads a multiple of nheads_kv (GQA).
        group: the process group the sequence is split over (None: the default group). Every rank of it calls
            ring_attention with the same shapes and options.
        causal: each query sees the keys at its position and before (within its document).
        softmax_scale: default 1 / sqrt(head_dim).
        cu_seqlens: optional document boundaries of the full (unsharded) batch: int32 offsets into its flattened
            batch * seqlen rows, on the host (as flashtrain.data.lm.collate_documents builds them); each token
            attends only within its document, and no document may cross the end of a batch row. Empty and one-token
            documents are fine. The schedule is computed from it on the host: no device sync.
        layout: "zigzag" (balanced causal work) or "contiguous"; seqlen must be divisible by 2 * world or world.
        deterministic: bitwise-reproducible out, lse and gradients from run to run (the ring's own sums have a
            fixed order always; this also asks the CUDA kernels' backward for theirs).
        return_lse: also return lse (batch, nheads, seqlen_local), float32 (float64 for float64 inputs on the
            reference), the log-sum-exp of each query's scaled scores over all its keys; differentiable.
        impl: "auto" (the CUDA kernels on CUDA tensors, the reference on CPU tensors), "cuda" (the kernels or a
            RuntimeError saying why not) or "reference", as flash_attn_func's impl.

    Returns:
        out (batch, seqlen_local, nheads, head_dim) in q's dtype, or (out, lse) with return_lse; differentiable with
        respect to q, k and v.
    """
    _check_qkv(q, k, v, rank=4, layout="(batch, seqlen_local, nheads, head_dim)")
    if k.shape[:2] != q.shape[:2]:
        raise ValueError(f"k: (batch, seqlen_local) {tuple(k.shape[:2])} differs from q's {tuple(q.shape[:2])}")
    _, softmax_scale = _check_scalars(0.0, softmax_scale, causal, q.shape[-1])
    for name, value in (("deterministic", deterministic), ("return_lse", return_lse)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    group = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, seqlen_local = q.shape[:2]
    offsets = None if cu_seqlens is None else _document_offsets(cu_seqlens, batch * seqlen_local * world)
    schedule = ring_schedule(batch, seqlen_local * world, world, rank, layout, causal, offsets)
    out, lse = _RingAttention.apply(q, k, v, _Ring(group, rank, world), schedule, softmax_scale, deterministic,
                                    _uses_cuda(impl, q))
    return (out, lse) if return_lse else out


def _document_offsets(cu_seqlens, total: int) -> tuple[int, ...]:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens must be on the host (the ring's schedule is computed from it there, without a "
                         f"device sync), got a tensor on {cu_seqlens.device}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    check_cu_seqlens(cu_seqlens, total, name="cu_seqlens")
    return tuple(cu_seqlens.tolist())


def _uses_cuda(impl: str, q: Tensor) -> bool:
    """Whether the blocks run on the CUDA kernels (else on the reference): flash_attn_func's choice for these tensors
    (its one-time warning where "auto" falls back); raises where impl="cuda" cannot."""
    try:
        cuda = _cuda_ops_to_use(impl, q, None, None) is not None
    except RuntimeError as error:
        raise RuntimeError(f"ring_attention {error}") from None
    if cuda and q.shape[-1] % 8:
        raise ValueError(f"ring_attention on the CUDA kernels needs head_dim (q.shape[-1]) a multiple of 8, got "
                         f"{q.shape[-1]}; pad q, k, v with zeros to the next multiple of 8 (zero columns change "
                         f"no score) or use impl='reference'")
    return cuda


class _Ring:
    """The ring of a process group: tensors go to rank + 1 and come from rank - 1."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.world = group, world
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def pass_on(self, tensor: Tensor, tag: int) -> "_Transfer":
        """Start sending `tensor` to the next rank and receiving the previous rank's (same shape) in its place.
        On NCCL the transfers run on the communicator's stream, after the work already queued on the current one."""
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                           dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])
        return _Transfer(tensor, received, requests)


class _Transfer:
    def __init__(self, sent: Tensor, received: Tensor, requests):
        self.sent = sent  # kept alive until the send has completed
        self.received, self.requests = received, requests

    def wait(self) -> Tensor:
        """The received tensor (on CUDA: the current stream waits for it, the host does not)."""
        for request in self.requests:
            request.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    """q (B, T_local, H, D), k / v (B, T_local, H_kv, D) -> out (B, T_local, H, D), lse (B, H, T_local)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, schedule, softmax_scale, deterministic, cuda):
        batch, seqlen_local, nheads, head_dim = q.shape
        rows = batch * seqlen_local
        q_rows, k_rows, v_rows = (x.reshape(rows, x.shape[2], head_dim) for x in (q, k, v))
        accumulate = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros((rows, nheads, head_dim), dtype=accumulate, device=q.device)
        lse = torch.full((nheads, rows), -math.inf, dtype=accumulate, device=q.device)
        kv = torch.stack((k_rows, v_rows)) if ring.world > 1 else None  # (2, rows, H_kv, D): one message a step
        for step, calls in enumerate(schedule):
            transfer = ring.pass_on(kv, _KV_TAG) if step + 1 < ring.world else None
            keys, values = (k_rows, v_rows) if step == 0 else (kv[0], kv[1])
            for call in calls:
                block_out, block_lse = block_forward(call.q_rows.take(q_rows), call.k_rows.take(keys),
                                                     call.k_rows.take(values), call, softmax_scale, cuda,
                                                     deterministic)
                merge_block(out, lse, call.q_rows, block_out, block_lse)
            if transfer is not None:
                kv = transfer.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.schedule, ctx.softmax_scale = ring, schedule, softmax_scale
        ctx.deterministic, ctx.cuda = deterministic, cuda
        ctx.set_materialize_grads(False)
        return (out.view(batch, seqlen_local, nheads, head_dim),
                lse.view(nheads, batch, seqlen_local).transpose(0, 1).contiguous())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, cuda, deterministic = ctx.ring, ctx.softmax_scale, ctx.cuda, ctx.deterministic
        batch, seqlen_local, nheads, head_dim = q.shape
        rows, nheads_kv = batch * seqlen_local, k.shape[2]
        dout = torch.zeros_like(out) if dout is None else dout.reshape(rows, nheads, head_dim)  # None: only lse used
        if dlse is not None:  # (B, H, T_local) -> lse's (H, rows)
            dlse = dlse.transpose(0, 1).reshape(nheads, rows)
        q_rows, k_rows, v_rows = (x.reshape(rows, x.shape[2], head_dim) for x in (q, k, v))
        dq = torch.zeros((rows, nheads, head_dim), dtype=lse.dtype, device=q.device)
        kv = torch.stack((k_rows, v_rows)) if ring.world > 1 else None
        dkv_transfer = None
        for step, calls in enumerate(ctx.schedule):
            kv_transfer = ring.pass_on(kv, _KV_TAG) if step + 1 < ring.world else None
            keys, values = (k_rows, v_rows) if step == 0 else (kv[0], kv[1])
            dkv = torch.zeros((2, rows, nheads_kv, head_dim), dtype=lse.dtype, device=q.device)  # this block's
            for call in calls:
                block_dq, block_dk, block_dv = block_backward(
                    call.q_rows.take(dout), call.q_rows.take(q_rows), call.k_rows.take(keys),
                    call.k_rows.take(values), call.q_rows.take(out), call.q_rows.take(lse, 1), call, scale, cuda,
                    deterministic, None if dlse is None else call.q_rows.take(dlse, 1))
                call.q_rows.add(dq, block_dq)
                call.k_rows.add(dkv[0], block_dk)
                call.k_rows.add(dkv[1], block_dv)
            if dkv_transfer is not None:  # what the ranks before this one added to this block's dK / dV
                dkv += dkv_transfer.wait()
            if ring.world > 1:  # on to the next rank; after the last step that is the block's owner
                dkv_transfer = ring.pass_on(dkv, _DKV_TAG)
            if kv_transfer is not None:
                kv = kv_transfer.wait()
        if dkv_transfer is not None:
            dkv = dkv_transfer.wait()
        return (dq.to(q.dtype).view(q.shape), dkv[0].to(k.dtype).view(k.shape), dkv[1].to(v.dtype).view(v.shape),
                None, None, None, None, None)
