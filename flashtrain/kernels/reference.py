"""Plain-PyTorch FlashAttention: the reference implementation that the CPU path runs and the CUDA kernel is tested
against.

Forward (FlashAttention-2, Algorithm 1): for each query tile, walk the key tiles it can see, keeping per row only the
running max m and the running sum l of exp(S - m); the output accumulator stays unnormalised until the last key tile,
then out = acc / l and one logsumexp per row, lse = m + log(l), is kept.
Backward (FlashAttention-2, Algorithm 2), by recomputation: with D = rowsum(dO * O), for each key tile, for each query
tile: P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dQ += dS K * scale, dK += dS^T Q * scale.
Only q, k, v, out, lse (and the dropout seed) live between the passes, so memory is O(seqlen): no seqlen_q x seqlen_k
tensor is ever allocated (an explicit dropout_mask is the caller's own).

Tiles are TILE x TILE with TILE = BLOCK_SPARSE_SIZE, so one tile is one block-sparse unit: a zero block of block_mask,
and a tile entirely above the causal diagonal, is never computed.

Layout. Inputs arrive packed as for flash_attn_varlen_func: q (total_q, nheads, head_dim), k/v (total_k, nheads_kv,
head_dim), cu_seqlens_q/k. When all sequences have the same lengths (always so for flash_attn_func) they are computed
as one batch; otherwise one sequence at a time. A group of sequences is laid out "rows by kv head":
q -> (batch * nheads_kv, seqlen_q * group_size, head_dim), group_size = nheads // nheads_kv, where row r holds query
r // group_size of query head kv_head * group_size + r % group_size. One batched matmul against k
(batch * nheads_kv, seqlen_k, head_dim) thus serves all query heads of a kv head (GQA without repeating K/V), and the
dK/dV matmuls sum over the query heads of a group by construction.

Dropout. With an explicit keep-mask, its tiles are used. Otherwise one seed is drawn per call from the caller's
generator, and each tile's keep-mask is drawn from a generator (on the tensors' device) re-seeded with
hash(seed, sequence group, query tile, key tile): backward regenerates exactly the forward's mask without storing it,
and the mask does not depend on the compute dtype.

Score modifications, in this order (as flash-attn): softcap (s -> softcap * tanh(s / softcap) of the scaled scores;
its derivative 1 - tanh^2 in backward), ALiBi (+ -slope * |i + seqlen_k - seqlen_q - j|), then the masks: causal,
window_size = (left, right) (query i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
right; -1 = unbounded; causal is right = 0), block_mask. Tiles with no visible pair are never computed.

Precision: computes in float32 (float64 for float64 inputs); out has the input dtype, lse is float32 (float64 for
float64 inputs, so float64 gradient checks are exact).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK_SPARSE_SIZE = 128  # tokens per side of a block_mask block
TILE = BLOCK_SPARSE_SIZE  # query rows and keys per tile (per head)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class _SeqGroup:
    """`batch` consecutive sequences of equal lengths, computed together."""

    index: int  # index of the first sequence (mixed into the dropout seed)
    batch: int
    q_start: int  # first packed row of q / k
    k_start: int
    seqlen_q: int
    seqlen_k: int


@dataclass(frozen=True)
class _Tile:
    """One visible TILE x TILE block of the score matrix of a sequence group."""

    q_tile: int
    k_tile: int
    q0: int  # queries [q0, q1), keys [k0, k1), counted from the start of each sequence
    q1: int
    k0: int
    k1: int
    on_diagonal: bool  # causal / window: some query of the tile may not see some key of it
    head_skip: Tensor | None  # (nheads_kv, 1, group_size, 1) True for heads whose block_mask block is 0


def _seq_groups(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> list[_SeqGroup]:
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens_q = [end - start for start, end in zip(starts_q, starts_q[1:])]
    lens_k = [end - start for start, end in zip(starts_k, starts_k[1:])]
    if lens_q and len(set(lens_q)) == 1 and len(set(lens_k)) == 1:
        return [_SeqGroup(0, len(lens_q), 0, 0, lens_q[0], lens_k[0])]
    return [
        _SeqGroup(b, 1, starts_q[b], starts_k[b], lens_q[b], lens_k[b]) for b in range(len(lens_q))
    ]


def _visible_tiles(
    seqlen_q: int, seqlen_k: int, window: tuple[int, int], block_mask: Tensor | None, nheads_kv: int,
    device: torch.device
) -> list[_Tile]:
    """Tiles with at least one (query, key) pair to compute, query-tile major. window = (left, right), causal being
    right = 0 (-1: unbounded). block_mask is on the CPU; the per-head skip masks go to `device`, where the scores
    are."""
    offset = seqlen_k - seqlen_q  # bottom-right: query i is aligned with key i + offset
    left, right = window
    tiles = []
    for q_tile in range(math.ceil(seqlen_q / TILE)):
        q0, q1 = q_tile * TILE, min(seqlen_q, (q_tile + 1) * TILE)
        for k_tile in range(math.ceil(seqlen_k / TILE)):
            k0, k1 = k_tile * TILE, min(seqlen_k, (k_tile + 1) * TILE)
            if right >= 0 and k0 > q1 - 1 + offset + right:
                break  # this tile and all later ones lie right of every query's window
            if left >= 0 and k1 - 1 < q0 + offset - left:
                continue  # left of every query's window
            head_skip = None
            if block_mask is not None:
                keep = block_mask[..., q_tile, k_tile]  # () shared by all heads, or (nheads,)
                if not keep.any():
                    continue
                if not keep.all():
                    head_skip = (~keep).view(nheads_kv, 1, -1, 1).to(device)
            on_diagonal = (right >= 0 and k1 - 1 > q0 + offset + right) or (left >= 0 and k0 < q1 - 1 + offset - left)
            tiles.append(_Tile(q_tile, k_tile, q0, q1, k0, k1, on_diagonal, head_skip))
    return tiles


def _tile_seed(seed: int, group_index: int, q_tile: int, k_tile: int) -> int:
    """splitmix64 of the tile coordinates: nearby tiles get unrelated seeds (the CPU generator uses only 32 bits)."""
    x = (seed + group_index * 0x9E3779B97F4A7C15 + q_tile * 0xC2B2AE3D27D4EB4F + k_tile * 0x165667B19E3779F9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # < 2**63


class _GroupCompute:
    """What the forward and backward passes of one sequence group share: tiles, masks, dropout."""

    def __init__(self, group, *, nheads, nheads_kv, device, window, block_mask, dropout_p, dropout_mask, dropout_seed,
                 softcap=0.0, alibi_slopes=None, mask_mod=None):
        self.group = group
        self.nheads_kv = nheads_kv
        self.group_size = nheads // nheads_kv
        self.causal_offset = group.seqlen_k - group.seqlen_q
        self.device = device
        self.window = window
        self.tiles = _visible_tiles(group.seqlen_q, group.seqlen_k, window, block_mask, nheads_kv, device)
        self._edge_masks: dict[tuple[int, int, int], Tensor] = {}
        # mask_mod: per tile, True where the expression is 0, (batch, nheads_kv, bq, group, bk), or None where it is
        # nonzero everywhere; tiles where it is 0 everywhere are dropped (the kernels' skip list, exactly)
        self._mod_masks: dict[tuple[int, int], Tensor | None] = {}
        if mask_mod is not None:
            self.tiles = [tile for tile in self.tiles if self._mod_mask(mask_mod, tile, nheads)]
        self.softcap = softcap
        self.slopes = None  # ALiBi: (batch * nheads_kv, 1, group, 1), the rows' layout
        if alibi_slopes is not None:  # (sequences, nheads) -> this group's sequences
            slopes = alibi_slopes[group.index : group.index + group.batch]
            self.slopes = slopes.reshape(group.batch * nheads_kv, 1, self.group_size, 1)
        self.dropout_p = dropout_p
        self.dropout_seed = dropout_seed
        self.dropout_mask = None
        if dropout_mask is not None:  # (nheads, total_q, max_seqlen_k) -> (batch, nheads_kv, seqlen_q, group, seqlen_k)
            rows = dropout_mask[:, group.q_start : group.q_start + group.batch * group.seqlen_q, : group.seqlen_k]
            rows = rows.unflatten(1, (group.batch, group.seqlen_q)).unflatten(0, (nheads_kv, self.group_size))
            self.dropout_mask = rows.permute(2, 0, 3, 1, 4)
        if dropout_p > 0 and dropout_mask is None:
            self.generator = torch.Generator(device=device)

    def _mod_mask(self, mask_mod, tile: _Tile, nheads: int) -> bool:
        """Evaluate mask_mod on the tile for this group's sequences and every head; remember where it masks.
        Returns whether any pair of the tile is attended."""
        b = torch.arange(self.group.index, self.group.index + self.group.batch, device=self.device)
        allowed = mask_mod.evaluate(b.view(-1, 1, 1, 1), torch.arange(nheads, device=self.device).view(1, -1, 1, 1),
                                    torch.arange(tile.q0, tile.q1, device=self.device).view(1, 1, -1, 1),
                                    torch.arange(tile.k0, tile.k1, device=self.device).view(1, 1, 1, -1))
        bq, bk = tile.q1 - tile.q0, tile.k1 - tile.k0
        # heads h = kv_head * group + g -> the rows' layout (batch, nheads_kv, bq, group, bk)
        allowed = allowed.reshape(self.group.batch, self.nheads_kv, self.group_size, bq, bk).transpose(2, 3)
        self._mod_masks[tile.q_tile, tile.k_tile] = None if allowed.all() else ~allowed
        return bool(allowed.any())

    def _distance(self, tile: _Tile) -> Tensor:
        """(bq, 1, bk): key k0 + c minus the key aligned with query q0 + r (bottom-right), c - r + k0 - q0 - offset."""
        bq, bk = tile.q1 - tile.q0, tile.k1 - tile.k0
        rows = torch.arange(bq, device=self.device)[:, None, None]
        cols = torch.arange(bk, device=self.device)
        return cols - rows + (tile.k0 - tile.q0 - self.causal_offset)

    def masked_out(self, tile: _Tile) -> Tensor | None:
        """Bool mask True where a score of the tile must be -inf, broadcastable to (batch, nheads_kv, bq, group, bk)."""
        mask = tile.head_skip
        if tile.on_diagonal:
            key = (tile.q1 - tile.q0, tile.k1 - tile.k0, tile.k0 - tile.q0 - self.causal_offset)
            outside = self._edge_masks.get(key)
            if outside is None:  # right of the window (causal: in the future), or left of it
                left, right = self.window
                distance = self._distance(tile)
                outside = torch.zeros(distance.shape, dtype=torch.bool, device=self.device)
                if right >= 0:
                    outside |= distance > right
                if left >= 0:
                    outside |= distance < -left
                self._edge_masks[key] = outside  # (bq, 1, bk)
            mask = outside if mask is None else mask | outside
        mod = self._mod_masks.get((tile.q_tile, tile.k_tile))
        if mod is not None:
            mask = mod if mask is None else mask | mod
        return mask

    def modify_scores(self, scores: Tensor, tile: _Tile) -> Tensor | None:
        """softcap, ALiBi and the masks on scores (batch * nheads_kv, bq * group, bk), in place; returns tanh of the
        softcapped scores (their derivative is softcap-independent: 1 - tanh^2) or None without softcap."""
        bq, bk = tile.q1 - tile.q0, tile.k1 - tile.k0
        tanh = None
        if self.softcap > 0:
            tanh = scores.div_(self.softcap).tanh_().clone()
            scores.mul_(self.softcap)
        if self.slopes is not None:  # -slope * |i + seqlen_k - seqlen_q - j|
            bias = self._distance(tile).abs().to(scores.dtype)  # (bq, 1, bk)
            scores.view(-1, bq, self.group_size, bk).sub_(self.slopes.to(scores.dtype) * bias)
        mask = self.masked_out(tile)
        if mask is not None:
            scores.view(self.group.batch, self.nheads_kv, bq, self.group_size, bk).masked_fill_(mask, -math.inf)
        return tanh

    def dropout_scale(self, tile: _Tile, dtype: torch.dtype) -> Tensor | None:
        """keep-mask / (1 - dropout_p) of the tile, (batch * nheads_kv, bq * group, bk); None without dropout."""
        if self.dropout_p == 0:
            return None
        bq, bk = tile.q1 - tile.q0, tile.k1 - tile.k0
        rows = self.group.batch * self.nheads_kv
        if self.dropout_mask is not None:
            keep = self.dropout_mask[:, :, tile.q0 : tile.q1, :, tile.k0 : tile.k1].reshape(rows, -1, bk)
        else:
            self.generator.manual_seed(_tile_seed(self.dropout_seed, self.group.index, tile.q_tile, tile.k_tile))
            uniform = torch.rand((rows, bq * self.group_size, bk), generator=self.generator, device=self.device)
            keep = uniform >= self.dropout_p
        return keep.to(dtype).mul_(1.0 / (1.0 - self.dropout_p))

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """q (rows, seqlen_q * group, D) pre-scaled by softmax_scale; k, v (rows, seqlen_k, D); rows = batch * nheads_kv.
        Returns out (rows, seqlen_q * group, D) and lse (rows, seqlen_q * group)."""
        g = self.group_size
        out = q.new_zeros(q.shape)
        lse = torch.full(q.shape[:2], -math.inf, dtype=q.dtype, device=q.device)
        tiles_by_q: dict[int, list[_Tile]] = {}
        for tile in self.tiles:
            tiles_by_q.setdefault(tile.q_tile, []).append(tile)
        for row_tiles in tiles_by_q.values():
            r0, r1 = row_tiles[0].q0 * g, row_tiles[0].q1 * g
            q_rows = q[:, r0:r1]  # (rows, bq * group, D)
            row_max = torch.full(q_rows.shape[:2], -math.inf, dtype=q.dtype, device=q.device)
            row_sum = torch.zeros_like(row_max)
            acc = torch.zeros_like(q_rows)  # unnormalised output
            for tile in row_tiles:
                scores = torch.bmm(q_rows, k[:, tile.k0 : tile.k1].transpose(1, 2))  # (rows, bq * group, bk)
                self.modify_scores(scores, tile)
                new_max = torch.maximum(row_max, scores.amax(-1))
                # rows that have seen no key yet keep max -inf; subtract 0 instead so exp() gives 0, not NaN
                safe_max = new_max.masked_fill(new_max == -math.inf, 0.0)
                probs = scores.sub_(safe_max.unsqueeze(-1)).exp_()
                rescale = (row_max - safe_max).exp_()  # the running max moved: shrink what was summed so far
                row_sum.mul_(rescale).add_(probs.sum(-1))  # lse is taken before dropout
                keep_scale = self.dropout_scale(tile, probs.dtype)
                if keep_scale is not None:
                    probs.mul_(keep_scale)
                acc.mul_(rescale.unsqueeze(-1)).add_(torch.bmm(probs, v[:, tile.k0 : tile.k1]))
                row_max = new_max
            # row_sum >= 1 once a row has seen a key (its max contributes exp(0)); rows that saw none have acc = 0
            out[:, r0:r1] = acc / row_sum.clamp_min(1.0).unsqueeze(-1)
            lse[:, r0:r1] = row_max + row_sum.log()  # -inf + -inf = -inf for rows that saw no key
        return out, lse

    def backward(self, q, k, v, dout, lse, delta) -> tuple[Tensor, Tensor, Tensor]:
        """Shapes as in forward, dout like q; lse and delta = rowsum(dO * O) (rows, seqlen_q * group); q pre-scaled.
        Returns dq (without the softmax_scale factor), dk, dv."""
        g = self.group_size
        # rows that saw no key: exp(S - inf) = 0 (and exp(-inf - inf) = 0), not NaN
        lse = lse.masked_fill(lse == -math.inf, math.inf)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for tile in sorted(self.tiles, key=lambda t: (t.k_tile, t.q_tile)):  # key tile outer, query tile inner
            r0, r1 = tile.q0 * g, tile.q1 * g
            q_rows, dout_rows = q[:, r0:r1], dout[:, r0:r1]
            k_tile, v_tile = k[:, tile.k0 : tile.k1], v[:, tile.k0 : tile.k1]
            scores = torch.bmm(q_rows, k_tile.transpose(1, 2))  # (rows, bq * group, bk)
            tanh = self.modify_scores(scores, tile)
            probs = scores.sub_(lse[:, r0:r1, None]).exp_()  # P
            dprobs = torch.bmm(dout_rows, v_tile.transpose(1, 2))  # dP of the dropped-out probabilities
            keep_scale = self.dropout_scale(tile, probs.dtype)
            # (in-place baddbmm_ on these strided views is a slow per-batch loop on CPU: bmm, then add_)
            if keep_scale is None:
                dv[:, tile.k0 : tile.k1].add_(torch.bmm(probs.transpose(1, 2), dout_rows))
            else:
                dv[:, tile.k0 : tile.k1].add_(torch.bmm((probs * keep_scale).transpose(1, 2), dout_rows))
                dprobs.mul_(keep_scale)
            dscores = probs.mul_(dprobs.sub_(delta[:, r0:r1, None]))  # dS = P * (dP - D)
            if tanh is not None:  # through softcap: d/ds softcap * tanh(s / softcap) = 1 - tanh^2
                dscores.mul_(1.0 - tanh.square_())
            dq[:, r0:r1].add_(torch.bmm(dscores, k_tile))
            dk[:, tile.k0 : tile.k1].add_(torch.bmm(dscores.transpose(1, 2), q_rows))
        return dq, dk, dv


# Shapes below are spelled out (no -1): sequences of length 0 give tensors with no elements.
# group: query heads per kv head for q-like tensors, 1 for k and v.


def _rows_by_kv_head(packed: Tensor, start: int, batch: int, seqlen: int, nheads_kv: int, group: int, dtype) -> Tensor:
    """(total, nheads, D) packed rows [start, start + batch * seqlen) -> a new (batch * nheads_kv, seqlen * group, D)."""
    head_dim = packed.shape[-1]
    rows = torch.empty((batch * nheads_kv, seqlen * group, head_dim), dtype=dtype, device=packed.device)
    x = packed[start : start + batch * seqlen].view(batch, seqlen, nheads_kv, group, head_dim)
    rows.view(batch, nheads_kv, seqlen, group, head_dim).copy_(x.permute(0, 2, 1, 3, 4))
    return rows


def _copy_to_packed(packed: Tensor, rows: Tensor, batch: int, seqlen: int, nheads_kv: int, group: int) -> None:
    """Inverse of _rows_by_kv_head: rows (batch * nheads_kv, seqlen * group, D) into packed (batch * seqlen, nheads, D)."""
    head_dim = rows.shape[-1]
    source = rows.view(batch, nheads_kv, seqlen, group, head_dim).permute(0, 2, 1, 3, 4)
    packed.view(batch, seqlen, nheads_kv, group, head_dim).copy_(source)


def _lse_rows(lse: Tensor, batch: int, seqlen: int, nheads_kv: int, group: int) -> Tensor:
    """(nheads, batch * seqlen) per-row values, packed like lse -> (batch * nheads_kv, seqlen * group), the row order of
    _rows_by_kv_head."""
    x = lse.view(nheads_kv, group, batch, seqlen).permute(2, 0, 3, 1)
    return x.reshape(batch * nheads_kv, seqlen * group)


def _copy_lse_to_packed(packed: Tensor, rows: Tensor, batch: int, seqlen: int, nheads_kv: int, group: int) -> None:
    """Inverse of _lse_rows: rows (batch * nheads_kv, seqlen * group) into packed (nheads, batch * seqlen)."""
    source = rows.view(batch, nheads_kv, seqlen, group).permute(1, 3, 0, 2)  # (nheads_kv, group, batch, seqlen)
    packed.view(nheads_kv, group, batch, seqlen).copy_(source)


class _FlashAttentionFunction(torch.autograd.Function):
    """Packed q (total_q, nheads, D), k/v (total_k, nheads_kv, D) -> out (total_q, nheads, D), lse (nheads, total_q)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window, block_mask, dropout_p, dropout_mask,
                dropout_seed, softcap, alibi_slopes, mask_mod):
        computes = _computes(q, k, cu_seqlens_q, cu_seqlens_k, window, block_mask, dropout_p, dropout_mask,
                             dropout_seed, softcap, alibi_slopes, mask_mod)
        out, lse = _forward(computes, q, k, v, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.computes = computes  # tiles, masks and the dropout seed of each sequence group
        ctx.softmax_scale = softmax_scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(ctx.computes, dout, q, k, v, out, lse, ctx.softmax_scale, dlse)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


def _computes(q, k, cu_seqlens_q, cu_seqlens_k, window, block_mask, dropout_p, dropout_mask, dropout_seed, softcap,
              alibi_slopes, mask_mod) -> list[_GroupCompute]:
    """The tiles, masks and dropout draws of each group of equal-length sequences."""
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    block_mask_cpu = None if block_mask is None else block_mask.cpu()
    return [
        _GroupCompute(seqs, nheads=q.shape[1], nheads_kv=k.shape[1], device=q.device, window=window,
                      block_mask=block_mask_cpu, dropout_p=dropout_p, dropout_mask=dropout_mask,
                      dropout_seed=dropout_seed, softcap=softcap,
                      alibi_slopes=None if alibi_slopes is None else alibi_slopes.to(compute_dtype),
                      mask_mod=mask_mod)
        for seqs in _seq_groups(cu_seqlens_q, cu_seqlens_k)
    ]


def _forward(computes, q, k, v, softmax_scale) -> tuple[Tensor, Tensor]:
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    nheads, nheads_kv = q.shape[1], k.shape[1]
    group = nheads // nheads_kv
    out = q.new_zeros(q.shape)
    lse = torch.full((nheads, q.shape[0]), -math.inf, dtype=compute_dtype, device=q.device)
    for compute in computes:
        seqs = compute.group
        q_rows = _rows_by_kv_head(q, seqs.q_start, seqs.batch, seqs.seqlen_q, nheads_kv, group, compute_dtype)
        k_rows = _rows_by_kv_head(k, seqs.k_start, seqs.batch, seqs.seqlen_k, nheads_kv, 1, compute_dtype)
        v_rows = _rows_by_kv_head(v, seqs.k_start, seqs.batch, seqs.seqlen_k, nheads_kv, 1, compute_dtype)
        out_rows, lse_rows = compute.forward(q_rows.mul_(softmax_scale), k_rows, v_rows)
        packed_q = slice(seqs.q_start, seqs.q_start + seqs.batch * seqs.seqlen_q)
        _copy_to_packed(out[packed_q], out_rows, seqs.batch, seqs.seqlen_q, nheads_kv, group)
        _copy_lse_to_packed(lse[:, packed_q], lse_rows, seqs.batch, seqs.seqlen_q, nheads_kv, group)
    return out, lse


def _backward(computes, dout, q, k, v, out, lse, softmax_scale, dlse=None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv from the forward's out and lse. dlse (lse's shape, or None): the gradient reaching lse, which
    enters as dS += P * dlse, i.e. D = rowsum(dO * O) - dlse."""
    compute_dtype, scale = lse.dtype, softmax_scale
    nheads_kv = k.shape[1]
    group = q.shape[1] // nheads_kv
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for compute in computes:
        seqs = compute.group
        packed_q = slice(seqs.q_start, seqs.q_start + seqs.batch * seqs.seqlen_q)
        packed_k = slice(seqs.k_start, seqs.k_start + seqs.batch * seqs.seqlen_k)
        q_rows = _rows_by_kv_head(q, seqs.q_start, seqs.batch, seqs.seqlen_q, nheads_kv, group, compute_dtype)
        k_rows = _rows_by_kv_head(k, seqs.k_start, seqs.batch, seqs.seqlen_k, nheads_kv, 1, compute_dtype)
        v_rows = _rows_by_kv_head(v, seqs.k_start, seqs.batch, seqs.seqlen_k, nheads_kv, 1, compute_dtype)
        dout_rows = _rows_by_kv_head(dout, seqs.q_start, seqs.batch, seqs.seqlen_q, nheads_kv, group, compute_dtype)
        lse_rows = _lse_rows(lse[:, packed_q], seqs.batch, seqs.seqlen_q, nheads_kv, group)
        delta = (dout[packed_q].to(compute_dtype) * out[packed_q]).sum(-1).t()  # D = rowsum(dO * O), (nheads, rows)
        if dlse is not None:  # (rows that saw no key have P = 0: their dlse reaches nothing)
            seen = lse[:, packed_q] > -math.inf
            delta = delta - torch.where(seen, dlse[:, packed_q].to(compute_dtype), 0.0)
        delta_rows = _lse_rows(delta.contiguous(), seqs.batch, seqs.seqlen_q, nheads_kv, group)
        dq_rows, dk_rows, dv_rows = compute.backward(
            q_rows.mul_(scale), k_rows, v_rows, dout_rows, lse_rows, delta_rows
        )
        _copy_to_packed(dq[packed_q], dq_rows.mul_(scale), seqs.batch, seqs.seqlen_q, nheads_kv, group)
        _copy_to_packed(dk[packed_k], dk_rows, seqs.batch, seqs.seqlen_k, nheads_kv, 1)
        _copy_to_packed(dv[packed_k], dv_rows, seqs.batch, seqs.seqlen_k, nheads_kv, 1)
    return dq, dk, dv


def flash_attn_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    block_mask: Tensor | None,
    dropout_p: float,
    dropout_mask: Tensor | None,
    generator: torch.Generator | None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    mask_mod=None,
) -> tuple[Tensor, Tensor]:
    """FlashAttention in plain PyTorch, packed (varlen) form, arguments as validated by flashtrain.kernels.interface:
    q (total_q, nheads, D), k/v (total_k, nheads_kv, D), cu_seqlens int32 (batch + 1,); block_mask
    ([nheads,] n_qblocks, n_kblocks); dropout_mask (nheads, total_q, max_seqlen_k); window_size (left, right), -1
    unbounded (with causal, right is 0); softcap 0 = none; alibi_slopes (batch, nheads) float32 or None; mask_mod a
    flashtrain.kernels.mask_mod.MaskMod or None.
    Returns out (total_q, nheads, D) in q's dtype and lse (nheads, total_q), both differentiable w.r.t. q, k, v."""
    dropout_seed = 0
    if dropout_p > 0 and dropout_mask is None:  # one draw per call; every tile's mask derives from it
        device = q.device if generator is None else generator.device
        dropout_seed = int(torch.randint(2**62, (), generator=generator, device=device))
    window = (window_size[0], 0 if causal else window_size[1])
    return _FlashAttentionFunction.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window, block_mask, dropout_p, dropout_mask, dropout_seed,
        softcap, alibi_slopes, mask_mod,
    )
