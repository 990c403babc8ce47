"""The pieces ring attention is made of: which query / key blocks a rank computes at each ring step (the schedule,
built on the host), and the forward and backward of one such block on the plain-PyTorch reference or the CUDA
kernels.

Coordinates. The full batch is (batch, seqlen) tokens; document boundaries (cu_seqlens) are offsets into its
flattened batch * seqlen rows, and no document crosses the end of a batch row. A rank holds seqlen_local =
seqlen / world tokens of every row, as a few equal chunks of consecutive positions (`Segment`s, local_segments): one
chunk for the contiguous layout, chunks r and 2 world - 1 - r for zigzag. Its q / k / v are flattened to
(batch * seqlen_local, heads, head_dim), the "local rows"; row b * seqlen_local + j is token j of batch row b.

The schedule of one step pairs this rank's query segments with the segments of the key / value block it holds.
All segments of a layout have one length and lie on one grid, so two of them are the same positions or disjoint,
and under a causal mask a key segment is wholly before a query segment (full attention), the same positions (the
causal diagonal) or wholly after it (skipped). Inside each pair only keys of the query's own document count. One
step becomes at most a few varlen calls (`BlockCall`): one non-causal call per distinct set of fully visible key
segments (in both layouts at most one per step), whose sequences are, per batch row and document, the document's
query rows against all of the document's visible key rows; and one causal call holding the diagonal pieces (a
document's rows of a segment against the same rows, so the causal mask within a piece is the ordinary lower
triangle). A call never reads a key row twice, so its dK / dV rows can be added without a reduction of their own.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashtrain.kernels import reference

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Segment:
    """Consecutive positions [start, start + length) of every batch row, held at local rows local_start.. of it."""

    local_start: int
    start: int
    length: int


def local_segments(seqlen: int, rank: int, world: int, layout: str) -> list[Segment]:
    """The segments a rank holds of sequences of `seqlen` tokens cut over `world` ranks, in local order."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, value, low in (("seqlen", seqlen, 0), ("world", world, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if rank >= world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")
    chunks = 2 * world if layout == "zigzag" else world
    if seqlen % chunks:
        raise ValueError(f"seqlen = {seqlen} must be divisible by {'2 * world' if layout == 'zigzag' else 'world'} = "
                         f"{chunks} for the {layout} layout over world = {world} ranks")
    chunk = seqlen // chunks
    if layout == "contiguous":
        return [Segment(0, rank * chunk, chunk)]
    # chunk r and its mirror 2 world - 1 - r: an early and a late chunk, so every rank has the same causal work
    return [Segment(0, rank * chunk, chunk), Segment(chunk, (chunks - 1 - rank) * chunk, chunk)]


class RowSet:
    """Some rows of a (rows, ...) tensor, in a fixed order: (start, stop) ranges, adjacent ones merged. The rows a
    block call reads or writes; the index tensor is made once per device (no host sync: it is copied, not read)."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self.ranges = tuple(ranges)
        self.size = sum(stop - start for start, stop in ranges)
        self._index: dict[torch.device, Tensor] = {}

    def covers(self, rows: int) -> bool:
        """Whether these are all `rows` rows, in order (then take / put use the tensor itself)."""
        return self.ranges == ((0, rows),) or (rows == 0 and not self.ranges)

    def index(self, device: torch.device) -> Tensor:
        """int64 (size,) the rows, on `device`."""
        index = self._index.get(device)
        if index is None:
            starts = torch.tensor([start for start, _ in self.ranges], dtype=torch.int64)
            lengths = torch.tensor([stop - start for start, stop in self.ranges], dtype=torch.int64)
            # row t of range i is starts[i] + t - (rows before range i)
            shift = starts - (torch.cumsum(lengths, 0) - lengths)
            index = torch.repeat_interleave(shift, lengths) + torch.arange(self.size)
            index = self._index[device] = index.to(device, non_blocking=True)
        return index

    def take(self, x: Tensor, dim: int = 0) -> Tensor:
        """These rows of x along dim."""
        return x if self.covers(x.shape[dim]) else x.index_select(dim, self.index(x.device))

    def put(self, x: Tensor, rows: Tensor, dim: int = 0) -> None:
        """x's rows along dim = rows."""
        if self.covers(x.shape[dim]):
            x.copy_(rows)
        else:
            x.index_copy_(dim, self.index(x.device), rows)

    def add(self, x: Tensor, rows: Tensor) -> None:
        """x's rows (dim 0) += rows; each row is added once (a RowSet never repeats a row), in a fixed order."""
        if self.covers(x.shape[0]):
            x.add_(rows)
        else:
            x.index_add_(0, self.index(x.device), rows.to(x.dtype))


@dataclass
class BlockCall:
    """One varlen attention call of a ring step: packed query rows q_rows of the local q against key rows k_rows of
    the key / value block held at that step, sequence b being q rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] against
    k rows cu_seqlens_k[b]:cu_seqlens_k[b + 1] (causal: the lower triangle, lengths equal)."""

    causal: bool
    q_rows: RowSet
    k_rows: RowSet
    cu_seqlens_q: Tensor  # int32, host
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    pairs: int  # (query, key) pairs computed: the call's work
    _on_device: dict = field(default_factory=dict, repr=False)

    def offsets(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(cu_seqlens_q, cu_seqlens_k) on `device` (copied once, without a host sync)."""
        if device.type == "cpu":
            return self.cu_seqlens_q, self.cu_seqlens_k
        offsets = self._on_device.get(device)
        if offsets is None:
            offsets = self._on_device[device] = tuple(x.to(device, non_blocking=True)
                                                      for x in (self.cu_seqlens_q, self.cu_seqlens_k))
        return offsets


def _pieces(segments: list[Segment], doc_start: int, doc_end: int) -> list[tuple[int, int]]:
    """(local start, length) within a batch row of the document's tokens in each segment that holds some."""
    pieces = []
    for seg in segments:
        low, high = max(seg.start, doc_start), min(seg.start + seg.length, doc_end)
        if low < high:
            pieces.append((seg.local_start + low - seg.start, high - low))
    return pieces


def _documents_in(starts: list[int], ends: list[int], segments: list[Segment]) -> list[int]:
    """Indices of the documents (sorted, disjoint, non-empty: starts / ends) that overlap any of the segments."""
    found = set()
    for seg in segments:  # documents ending after the segment starts and starting before it ends
        found.update(range(bisect.bisect_right(ends, seg.start), bisect.bisect_left(starts, seg.start + seg.length)))
    return sorted(found)


def _append(ranges: list[tuple[int, int]], start: int, length: int) -> None:
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], start + length)
    else:
        ranges.append((start, start + length))


def _block_call(causal: bool, parts: list[tuple[list[Segment], list[Segment]]], documents, seqlen_local: int):
    """The call of `parts` (query segments, key segments) pairs, every document of every batch row one sequence
    per part; None when no sequence has both queries and keys."""
    q_ranges, k_ranges, lengths_q, lengths_k = [], [], [], []
    for q_segments, k_segments in parts:
        for row, (starts, ends) in enumerate(documents):
            base = row * seqlen_local
            for doc in _documents_in(starts, ends, q_segments):
                q_pieces = _pieces(q_segments, starts[doc], ends[doc])
                k_pieces = _pieces(k_segments, starts[doc], ends[doc])
                if not k_pieces:
                    continue
                for ranges, pieces in ((q_ranges, q_pieces), (k_ranges, k_pieces)):
                    for start, length in pieces:
                        _append(ranges, base + start, length)
                lengths_q.append(sum(length for _, length in q_pieces))
                lengths_k.append(sum(length for _, length in k_pieces))
    if not lengths_q:
        return None
    pairs = sum(n * (n + 1) // 2 if causal else n * m for n, m in zip(lengths_q, lengths_k))
    cu = [torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
          for lengths in (lengths_q, lengths_k)]
    return BlockCall(causal, RowSet(q_ranges), RowSet(k_ranges), cu[0], cu[1], max(lengths_q), max(lengths_k), pairs)


def _step_calls(q_segments: list[Segment], k_segments: list[Segment], causal: bool, documents,
                seqlen_local: int) -> list[BlockCall]:
    """The calls of one ring step: this rank's query segments against the held block's key segments."""
    visible: dict[tuple[int, ...], list[Segment]] = {}  # fully visible key segments -> the query segments seeing them
    diagonal = []
    for q_seg in q_segments:
        full = tuple(j for j, k_seg in enumerate(k_segments)
                     if not causal or k_seg.start + k_seg.length <= q_seg.start)
        if full:
            visible.setdefault(full, []).append(q_seg)
        if causal:
            diagonal += [([q_seg], [k_seg]) for k_seg in k_segments if k_seg.start == q_seg.start]
    parts = [[(q_segs, [k_segments[j] for j in full])] for full, q_segs in visible.items()]
    calls = [_block_call(False, part, documents, seqlen_local) for part in parts]
    if diagonal:
        calls.append(_block_call(True, diagonal, documents, seqlen_local))
    return [call for call in calls if call is not None]


def row_documents(batch: int, seqlen: int, offsets: tuple[int, ...] | None) -> list[tuple[list[int], list[int]]]:
    """Per batch row, the (starts, ends) of its non-empty documents in row positions; offsets: cu_seqlens of the
    flattened batch * seqlen rows (checked), None for one document per row. ValueError when a document crosses the
    end of a batch row."""
    if offsets is None:
        return [([0], [seqlen])] * batch
    documents = [([], []) for _ in range(batch)]
    for doc, (start, end) in enumerate(zip(offsets, offsets[1:])):
        if start == end:
            continue
        row = start // seqlen
        if end > (row + 1) * seqlen:
            raise ValueError(f"cu_seqlens: document {doc} (rows {start}:{end}) crosses the end of batch row {row} "
                             f"(rows {row * seqlen}:{(row + 1) * seqlen}); each document must lie within one row of "
                             f"the (batch, seqlen = {seqlen}) batch, as flashtrain.data.lm.collate_documents builds "
                             f"them")
        documents[row][0].append(start - row * seqlen)
        documents[row][1].append(end - row * seqlen)
    return documents


@functools.lru_cache(maxsize=8)
def ring_schedule(batch: int, seqlen: int, world: int, rank: int, layout: str, causal: bool,
                  offsets: tuple[int, ...] | None = None) -> tuple[tuple[BlockCall, ...], ...]:
    """The calls of each ring step of `rank`: step s computes its queries against the keys and values of rank
    (rank - s) % world. seqlen: the full sequence length; offsets: cu_seqlens of the full batch as a tuple, or None.
    Cached: a model's layers share one schedule (and its index tensors on the device)."""
    documents = row_documents(batch, seqlen, offsets)
    q_segments = local_segments(seqlen, rank, world, layout)
    return tuple(tuple(_step_calls(q_segments, local_segments(seqlen, (rank - step) % world, world, layout), causal,
                                   documents, seqlen // world))
                 for step in range(world))


# ---- one block: forward and backward on the reference or the CUDA kernels --------------------------------------


def block_forward(q: Tensor, k: Tensor, v: Tensor, call: BlockCall, softmax_scale: float, cuda: bool,
                  deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out (rows, H, D) in q's dtype, lse (H, rows) float32, float64 on the float64 reference) of one call on packed
    q (call.q_rows.size, H, D), k / v (call.k_rows.size, H_kv, D)."""
    if not cuda:
        computes = _reference_computes(q, k, call)
        return reference._forward(computes, q, k, v, softmax_scale)
    from flashtrain.kernels import ops  # imported here: CPU runs never load the kernel side

    cu_seqlens_q, cu_seqlens_k = call.offsets(q.device)
    q, _, softmax_scale = ops.kernel_query(q, softmax_scale)  # (a positive scale of at least 2^-64, as the kernels take)
    return ops.flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k, 0.0,
                              softmax_scale, call.causal, None, deterministic)


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, call: BlockCall,
                   softmax_scale: float, cuda: bool, deterministic: bool,
                   dlse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one call from the rows' global out and lse (those of the whole attention, not of this block:
    the kernels form D = rowsum(dout * out) - dlse and P = exp(S - lse) from them, so the blocks' gradients add up
    to the exact ones). dlse (H, rows) or None: the gradient reaching lse."""
    if not cuda:
        computes = _reference_computes(q, k, call)
        return reference._backward(computes, dout, q, k, v, out, lse, softmax_scale, dlse)
    from flashtrain.kernels import ops

    cu_seqlens_q, cu_seqlens_k = call.offsets(q.device)
    q, q_factor, softmax_scale = ops.kernel_query(q, softmax_scale)  # (as block_forward)
    dq, dk, dv = ops.flash_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, call.max_seqlen_q,
                                    call.max_seqlen_k, 0.0, softmax_scale, call.causal, None, deterministic,
                                    dlse=dlse)  # (the op lays dlse out like lse)
    return (dq * q_factor if q_factor != 1.0 else dq), dk, dv  # d(q q_factor) / dq


def _reference_computes(q: Tensor, k: Tensor, call: BlockCall):
    window = (-1, 0) if call.causal else (-1, -1)  # the reference's causal: a window whose right bound is 0
    return reference._computes(q, k, call.cu_seqlens_q, call.cu_seqlens_k, window, None, 0.0, None, 0, 0.0, None, None)


def merge_block(out: Tensor, lse: Tensor, rows: RowSet, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's (block_out (n, H, D), block_lse (H, n)) into the running (out (rows, H, D), lse (H, rows))
    at `rows`, exactly: lse = logaddexp(lse, block_lse), out = out exp(lse_old - lse) + block_out exp(block_lse -
    lse), in out's dtype (float32 / float64). Rows that have seen no key (lse -inf) keep out 0, lse -inf."""
    old_out, old_lse = rows.take(out), rows.take(lse, 1)
    new_lse = torch.logaddexp(old_lse, block_lse.to(lse.dtype))
    finite = new_lse.masked_fill(new_lse == -math.inf, 0.0)  # exp(-inf - 0) = 0 rather than exp(nan)
    old_weight = (old_lse - finite).exp_().t().unsqueeze(-1)  # (n, H, 1)
    block_weight = (block_lse.to(lse.dtype) - finite).exp_().t().unsqueeze(-1)
    rows.put(out, old_out * old_weight + block_out.to(out.dtype) * block_weight)
    rows.put(lse, new_lse, 1)
