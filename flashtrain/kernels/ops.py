"""The CUDA FlashAttention-2 kernels (csrc/) as torch custom ops, in one place.

    flashtrain::flash_attn_fwd   (q, k, v, ...) -> (out, lse)
    flashtrain::flash_attn_bwd   (dout, q, k, v, out, lse, ...) -> (dq, dk, dv)

both defined by the C++ host layer (host/flash_host.cpp, compiled at first use by build.host_library and loaded by
load_host): their CUDA kernels and the forward's autograd node (whose backward calls bwd) are C++, so that a call's
host work and the whole backward never enter Python; their fake implementations (torch.compile traces them without
running them) are registered here. What they launch is decided here: the launch plans (_fwd_plan, _bwd_plan, below).
One pair of ops serves both layouts: batch form q (batch, seqlen_q, nheads, head_dim) when cu_seqlens_q is None,
packed (varlen) form q (total_q, nheads, head_dim) otherwise. Under functorch transforms (torch.func.grad, vmap) the
ops raise (a C++ autograd node does not support them).

flash_attn_cuda and unavailable_reason are the hook that flashtrain.kernels.interface calls (validation of the
user's arguments happens there; this module checks only what it relies on to launch safely).

Dropout: flash_attn_cuda draws rng_state = (seed, offset), two int64 on the GPU, from the caller's generator (in
Python, before the op: under torch.compile the draw is a node of the graph, each CUDA graph replay draws anew); the
kernels derive every keep decision from it (Philox, counter-based), the backward regenerates the same mask from the
saved rng_state, and dropout_mask_for_testing (test only) materialises the mask of a draw.

Block-sparse (block_mask, blocks of build.BLOCK_SPARSE_SIZE = 128 tokens counted from each sequence's start):
flash_attn_cuda turns the mask, once per call and on the GPU (no host sync), into compressed index lists, which the
forward saves for the backward: bs_rows (mask heads, n_qblocks, n_kblocks + 1) holds per query block the count of its
non-zero key blocks, then those blocks ascending (the forward's CTA of a query block walks them); bs_cols
(mask heads, n_kblocks, n_qblocks + 1) the same per key block (the backward's CTA of a key block walks them). Their
size is that of the mask (O((seqlen / 128)^2) per head), nothing is seqlen x seqlen. The block-sparse kernels are a
separate instantiation set (build.BLOCK_SPARSE_HEAD_DIMS); the dense kernels are unchanged.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import struct
import threading
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from flashtrain.kernels import build, tma
from flashtrain.kernels.mask_mod import MaskMod, mask_mod_from_text, mask_mod_text, mask_states, state_row_bytes

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_launch = None  # flashtrain.kernels.launch once loaded (it needs cuda-python; importing this module does not)


def _load_launch():
    global _launch
    from flashtrain.kernels import launch

    _launch = launch
    return launch


@torch.compiler.assume_constant_result
def _unavailable_reason(device_type: str, device_index: int, head_dim: int, dtype: str, block_mask: bool) -> str | None:
    return _unavailable_reason_cached(device_type, device_index, head_dim, dtype, block_mask)


@functools.lru_cache(maxsize=None)
def _unavailable_reason_cached(device_type: str, device_index: int, head_dim: int, dtype: str,
                               block_mask: bool) -> str | None:
    if device_type != "cuda":
        return f"the tensors are on {device_type}; the CUDA kernels need CUDA tensors"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if dtype not in ("torch.float16", "torch.bfloat16"):
        return f"the CUDA kernels support float16 and bfloat16, got {dtype}"
    if not 1 <= head_dim <= build.HEAD_DIMS[-1]:
        return f"the CUDA kernels need head_dim in [1, {build.HEAD_DIMS[-1]}], got {head_dim}"
    head_dim = padded_head_dim(head_dim)  # what the kernels run (flash_attn_cuda pads the inputs)
    if block_mask and head_dim > build.BLOCK_SPARSE_HEAD_DIMS[-1]:
        return (f"the block-sparse CUDA kernels (block_mask) support head_dim <= {build.BLOCK_SPARSE_HEAD_DIMS[-1]} "
                f"(instantiated for {build.BLOCK_SPARSE_HEAD_DIMS}), got {head_dim}")
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return f"the CUDA kernels need compute capability 8.0 or newer, cuda:{device_index} has {major}.{minor}"
    try:
        from flashtrain.kernels import launch
    except ImportError as error:
        return f"cuda-python is not installed ({error}); pip install cuda-python"
    smem_limit = launch.device_smem_limit(torch.device("cuda", device_index))
    reason = build.smem_unavailable_reason(head_dim, block_mask, smem_limit)
    if reason is not None:
        return f"cuda:{device_index}: {reason}"
    compiler_reason = build.compiler_unavailable_reason()
    mismatch = build.cuda_version_mismatch()
    if compiler_reason is None and mismatch is not None:  # may still work (a new enough driver): say it, once
        warnings.warn(f"flashtrain kernels: {mismatch}", stacklevel=2)
    if compiler_reason is not None:
        return compiler_reason
    try:
        load_host()
    except (RuntimeError, OSError) as error:
        return f"the C++ host layer (flashtrain/kernels/host) cannot be built or loaded: {error}"
    return None


def unavailable_reason(device: torch.device, *, head_dim: int, dtype: torch.dtype, block_mask: bool) -> str | None:
    """None when the CUDA kernels can run these arguments, else a sentence saying why not."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _unavailable_reason(device.type, index, head_dim, str(dtype), bool(block_mask))


def _score_mods(window, softcap: float, alibi_slopes) -> bool:
    """Whether a call needs the score-modification kernels (build.SCORE_MODS)."""
    return tuple(window) != (-1, -1) or softcap > 0 or alibi_slopes is not None


def _window_only(mask, softcap: float, alibi_slopes) -> bool:
    """Whether a call's one score modification (if any) is its window: the kernels built without softcap's and ALiBi's
    code (build: the `_window` variants)."""
    return mask is None and softcap <= 0 and alibi_slopes is None


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels run a head_dim on: the next multiple of 8 (16-byte rows of 16-bit values)."""
    return -(-head_dim // 8) * 8


def kernel_scale(softmax_scale: float) -> tuple[float, float]:
    """(q_factor, scale): the kernels compute softmax((q * q_factor) k^T * scale) for softmax(q k^T * softmax_scale),
    with scale >= 2^-64. They take each row's running max over the raw scores q k^T, which is the max of the scaled
    scores only for a positive scale (with a negative one, exp() overflows once a row's scaled scores spread by more
    than ~88): q k^T * s = (-q) k^T * (-s). And the Hopper backward keeps some rows' lse in raw score units, -lse /
    scale (csrc/flash.h), which a scale below 2^-64 (0 included) would overflow: such a scale goes into q, q k^T * s =
    (q s 2^64) k^T * 2^-64 (the scaled scores are then below 2^-64 |q k^T| anyway). dq of the caller's q is q_factor
    times the kernels' dq (a product by -1 is exact: the negation)."""
    q_factor, scale = (-1.0, -softmax_scale) if softmax_scale < 0 else (1.0, softmax_scale)
    if scale < 2.0 ** -64:
        q_factor, scale = q_factor * scale * 2.0 ** 64, 2.0 ** -64
    return q_factor, scale


def kernel_query(q: Tensor, softmax_scale: float) -> tuple[Tensor, float, float]:
    """(q * q_factor, q_factor, scale) of kernel_scale: the query and scale the kernels take (q itself where q_factor
    is 1); a caller that runs the raw backward multiplies its dq by q_factor."""
    q_factor, scale = kernel_scale(softmax_scale)
    return (q if q_factor == 1.0 else q * q_factor), q_factor, scale


def flash_attn_cuda(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                    generator: torch.Generator | None, deterministic: bool = False,
                    block_mask: Tensor | None = None, validated: bool = False, window_size=(-1, -1),
                    softcap: float = 0.0, alibi_slopes: Tensor | None = None,
                    mask_mod: MaskMod | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of the CUDA kernel, differentiable w.r.t. q, k, v. Arguments as in flash_attn_(varlen_)func after
    validation; cu_seqlens None selects the batch form. deterministic=True makes the backward's dq bitwise
    reproducible (each CTA accumulates into its own dq buffer, summed in a fixed order) at some speed cost.
    block_mask: bool ([nheads,] ceil(max_seqlen_q / 128), ceil(max_seqlen_k / 128)) on q's device, or None.
    validated=True: the caller (flashtrain.kernels.interface) has checked the arguments and unavailable_reason.
    mask_mod: a mask expression (mask_mod.MaskMod, its tensors on q's device): its block states are computed on the
    GPU (MaskMod.call_states: cached while its tensors and the shapes stay the same) and the mma.sync score-modification kernels with the expression compiled in
    skip the empty tiles and test the partial ones; without dropout or a block mask."""
    if not validated:
        reason = unavailable_reason(q.device, head_dim=q.shape[-1], dtype=q.dtype, block_mask=block_mask is not None)
        if reason is not None:
            raise RuntimeError(f"the CUDA attention kernel cannot run: {reason}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got {x.stride(-1)}")
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    head_dim = q.shape[-1]
    if head_dim % 8:  # zero columns added to q, k, v change no score and give zero output columns, sliced off
        pad = padded_head_dim(head_dim) - head_dim
        q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        out, lse = flash_attn_cuda(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                                   softmax_scale=softmax_scale, causal=causal, generator=generator,
                                   deterministic=deterministic, block_mask=block_mask, validated=validated,
                                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                   mask_mod=mask_mod)
        return out[..., :head_dim].contiguous(), lse
    if cu_seqlens_q is not None:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if no_work(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):  # the op launches nothing (its plan only fills the
        block_mask = mask_mod = None  # outputs): no block lists or mask states to build for it
    bs_rows = bs_cols = None
    if block_mask is not None:
        blocks = (math.ceil(max_seqlen_q / build.BLOCK_SPARSE_SIZE), math.ceil(max_seqlen_k / build.BLOCK_SPARSE_SIZE))
        if block_mask.dtype != torch.bool or tuple(block_mask.shape) not in (blocks, (q.shape[-2], *blocks)):
            raise ValueError(f"block_mask must be bool ([{q.shape[-2]},] {blocks[0]}, {blocks[1]}), got "
                             f"{block_mask.dtype} {tuple(block_mask.shape)}")
        bs_rows, bs_cols = block_sparse_lists(block_mask)
    rng_state = _draw_rng_state(q.device, generator) if dropout_p > 0 else None
    q, _, softmax_scale = kernel_query(q, softmax_scale)  # (autograd carries dq back through the product)
    if not _host_loaded:
        load_host()
    # the op (flash_host.cpp): its autograd node and launches are C++; torch.compile traces it as one graph node
    left, right = (int(x) for x in window_size)
    right = -1 if causal else right  # causal is the right bound 0 already: a window only when left is bounded
    # a bound wider than both lengths excludes no key; capped there it stays far inside the kernels' int32 index
    # arithmetic (window_left = 2**31 - 1 overflowed the backward's last-row bound: dk, dv all zero)
    reach = int(max_seqlen_q) + int(max_seqlen_k)
    left, right = (min(x, reach) if x >= 0 else -1 for x in (left, right))
    if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:  # (batch, nheads) float32, head stride 1
        alibi_slopes = alibi_slopes.contiguous()
    mask_args = ()
    if mask_mod is not None:
        if dropout_p > 0 or block_mask is not None:
            raise ValueError("mask_mod does not combine with dropout_p > 0 or a block_mask on the CUDA kernels")
        batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
        tensors = list(mask_mod.tensors.values())
        if torch.compiler.is_compiling():  # one op in the graph (its fake gives the packed shape); no cache
            states, error = mask_states(q, mask_mod_text(mask_mod), batch, int(max_seqlen_q), int(max_seqlen_k),
                                        left, 0 if causal else right, cu_seqlens_q, cu_seqlens_k, *tensors,
                                        *[None] * (4 - len(tensors)))
        else:
            states, error = mask_mod.call_states(batch, q.shape[-2], int(max_seqlen_q), int(max_seqlen_k),
                                                 device=q.device, block=build.BLOCK_SPARSE_SIZE,
                                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                 window=(left, 0 if causal else right))
        mask_args = (states, error, *tensors, *[None] * (4 - len(tensors)), mask_mod_text(mask_mod))
    return flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                          float(dropout_p), float(softmax_scale), bool(causal), rng_state, bool(deterministic),
                          bs_rows, bs_cols, left, right, float(softcap), alibi_slopes, *mask_args)


def no_work(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """Whether a call has no (query, key) pair to compute: no sequence, no query head, no query row or no key row
    (batch form q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, ...); varlen q (total_q, nheads, d), k (total_k,
    ...), sequences of at most max_seqlen_q / max_seqlen_k rows). Its plans launch no kernel: out 0 and lse -inf
    (every query sees no key, as a query row of an empty key sequence does), dq, dk, dv 0. Launching would encode TMA
    tensor maps over a dimension of size 0 at a null address (Hopper) and size grids and tile groups by zero blocks."""
    if cu_seqlens_q is None:
        extents = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    else:
        extents = (cu_seqlens_q.shape[0] - 1, q.shape[0], k.shape[0], int(max_seqlen_q), int(max_seqlen_k),
                   q.shape[1], k.shape[1])
    return min(extents) <= 0


def _no_work_plan(outputs: list[tuple[tuple[int, ...], torch.dtype, int]]) -> "_Plan":
    """The plan of a call without work (no_work): its outputs allocated with their fills, no launch."""
    return _Plan(outputs, [])


# block_sparse_lists' results by mask: id(mask) -> (weak reference to the mask, its version counter, the lists). A
# model passes the same mask tensor to every layer and step; the lists are built once (two argsorts and a few more
# launches: 0.3-0.4 ms of host time per call at N = 1K, where the dense forward takes 0.09 ms; H200 2026-11-25).
# An entry holds only while that very tensor is alive and unmodified (in-place writes bump _version).
_lists_cache: dict[int, tuple[weakref.ref, int, tuple[Tensor, Tensor]]] = {}
_LISTS_CACHE_SIZE = 64


def block_sparse_lists(block_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels' index lists of a bool block_mask ([mask heads,] n_qblocks, n_kblocks), built on its device
    without a host sync: bs_rows int32 (mask heads, n_qblocks, n_kblocks + 1) = per query block the number c of its
    non-zero key blocks, then (in entries 1..c) those key blocks ascending; bs_cols int32 (mask heads, n_kblocks,
    n_qblocks + 1) the same per key block. mask heads = 1 for a 2-D mask. Cached per mask tensor (eager only)."""
    if torch.compiler.is_compiling():
        return _block_sparse_lists(block_mask)
    key = id(block_mask)
    hit = _lists_cache.get(key)
    if hit is not None and hit[0]() is block_mask and hit[1] == block_mask._version:
        return hit[2]
    lists = _block_sparse_lists(block_mask)
    if len(_lists_cache) >= _LISTS_CACHE_SIZE:
        for stale in [k for k, (ref, _, _) in _lists_cache.items() if ref() is None] or list(_lists_cache)[:1]:
            del _lists_cache[stale]
    _lists_cache[key] = (weakref.ref(block_mask), block_mask._version, lists)
    return lists


def _block_sparse_lists(block_mask: Tensor) -> tuple[Tensor, Tensor]:
    mask = block_mask if block_mask.dim() == 3 else block_mask.unsqueeze(0)

    def lists(rows: Tensor) -> Tensor:  # (H, R, C) bool -> (H, R, C + 1): count, then the True columns ascending
        order = torch.argsort(rows.logical_not().to(torch.uint8), dim=-1, stable=True)  # True first, in order
        return torch.cat([rows.sum(-1, keepdim=True), order], dim=-1).to(torch.int32).contiguous()

    return lists(mask), lists(mask.transpose(1, 2))


def _draw_rng_state(device: torch.device, generator: torch.Generator | None) -> Tensor:
    """(seed, offset): two int64 drawn from generator (the default generator of device if None), on device."""
    source = device if generator is None else generator.device
    state = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, device=source, generator=generator)
    return state.to(device)


def dropout_mask_for_testing(q: Tensor, k: Tensor, *, dropout_p: float, generator: torch.Generator | None,
                             cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                             max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> Tensor:
    """Test only: the keep-mask that flash_attn_cuda draws when called with a generator in the same state.

    Returns bool (batch, nheads, seqlen_q, seqlen_k), or varlen (nheads, total_q, max_seqlen_k) with column j of a row
    being key j of its own sequence (False past the sequence's end) -- the dropout_mask layout of the reference."""
    from flashtrain.kernels import launch

    rng_state = _draw_rng_state(q.device, generator)
    varlen = cu_seqlens_q is not None
    if varlen:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    nheads = q.shape[-2]
    if varlen:
        batch, seqlen_q, seqlen_k = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
        mask = torch.zeros((nheads, q.shape[0], seqlen_k), dtype=torch.uint8, device=q.device)
        mask_strides = (0, mask.stride(0), mask.stride(1))
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        mask = torch.zeros((batch, nheads, seqlen_q, seqlen_k), dtype=torch.uint8, device=q.device)
        mask_strides = mask.stride()[:3]
    spec = build.aux_kernels(_DTYPE_NAMES[q.dtype])
    params = launch.AuxParams(
        dropout_mask=mask.data_ptr(), rng_state=rng_state.data_ptr(),
        cu_seqlens_q=_ptr(cu_seqlens_q), cu_seqlens_k=_ptr(cu_seqlens_k),
        mask_batch_stride=mask_strides[0], mask_head_stride=mask_strides[1], mask_row_stride=mask_strides[2],
        batch=batch, nheads=nheads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, keep_threshold=_keep_threshold(dropout_p),
        total_q=q.shape[0], total_k=k.shape[0])
    grid = (math.ceil(seqlen_q / build.AUX_ROWS_PER_CTA), batch, nheads)
    launch.get_kernel(spec, spec.symbols[2], q.device).launch(grid, params, q.device)
    return mask.bool()


# ---------------------------------------------------------------------------------------------------- the ops
# flashtrain::flash_attn_fwd / flash_attn_bwd are defined and executed by the C++ host layer (host/flash_host.cpp,
# built by build.host_library): their CUDA kernels and the forward's autograd node, so that a call's host work and
# the whole backward stay in C++. Everything they launch is decided here, in Python, once per call signature: a
# launch plan (_Plan) holds everything about a call except its tensors' addresses (the outputs to allocate, and per
# kernel launch the kernel, grid, the full parameter struct with every address 0, where each address goes, the TMA
# tensor maps and the tile counter). The C++ executor asks for a plan through the ops flashtrain::_fwd_plan /
# _bwd_plan (implemented below) the first time it sees a signature and keeps it; _execute is the same executor in
# Python, the reference the tests compare the C++ one with (byte for byte on CPU, bitwise on the GPU).
#
# Plans index the ops' tensor arguments ("input i") in this order, None giving address 0:
#   forward   q, k, v, cu_seqlens_q, cu_seqlens_k, rng_state, bs_rows, bs_cols
#   backward  dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, bs_cols, alibi_slopes, mm_states,
#             mm_error, mm0..mm3, dlse (the gradient reaching lse, in lse's layout, or None)
_INPUT, _OUTPUT = 0, 1
_DLSE_INPUT = 17  # where an address comes from: an input of the op, or an output / workspace of the plan
_PLAN_FORMAT = 3  # = flash_host.cpp kPlanFormat
# how a plan's output is allocated (flash_host.cpp Fill): uninitialised, zero-filled, filled with -inf
_FILL_NONE, _FILL_ZERO, _FILL_NEG_INF = 0, 1, 2
_SCALAR_TYPES = {torch.int32: 3, torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}  # c10::ScalarType codes
_MAX_PLANS = 1024  # per direction; a process that sees more distinct call signatures rebuilds plans (correct, slower)


@dataclasses.dataclass
class _Launch:
    kernel: object  # launch.Kernel
    grid: tuple[int, int, int]
    params: ctypes.Structure  # the kernel's parameter struct, every address 0
    addresses: list[tuple[int, int, int, int]]  # (byte offset, _INPUT / _OUTPUT, index, bytes added)
    # (offset, input i or output j as -1 - j, layout)
    tensor_maps: list[tuple[int, int, tuple]] = dataclasses.field(default_factory=list)
    tile_counter_offset: int = -1  # persistent kernels: where their stream's tile counter goes
    # programmatic dependent launch (cuLaunchKernelEx with programmatic stream serialization): the kernel may start
    # while the launch before it finishes; it waits for that launch's writes itself (utils.cuh grid_dependency_wait)
    pdl: bool = False

    def flat(self) -> list[int]:
        data = bytes(self.params)
        data += b"\0" * (-len(data) % 8)
        words = list(struct.unpack(f"<{len(data) // 8}q", data))
        flat = [int(self.kernel.handle.value or 0), *self.grid, self.kernel.threads, self.kernel.smem_bytes,
                ctypes.sizeof(self.params), *words, len(self.addresses)]
        for address in self.addresses:
            flat += address
        flat.append(len(self.tensor_maps))
        for offset, index, (dtype, dims, strides, box_cols, box_rows, swizzle) in self.tensor_maps:
            flat += [offset, index, dtype, *dims, *strides, box_cols, box_rows, swizzle, tma.L2_PROMOTION,
                     tma.OOB_FILL_ZERO]
        return flat + [self.tile_counter_offset, self.kernel.tile_counters, build.MAX_STREAMS, int(self.pdl)]


@dataclasses.dataclass
class _Plan:
    outputs: list[tuple[tuple[int, ...], torch.dtype, int]]  # (shape, dtype, _FILL_*); the op returns the
    launches: list[_Launch]  # first ones, the others are workspaces

    def flat(self) -> list[int]:
        """The plan as flash_host.cpp parse_plan reads it: a list of int64."""
        flat = [_PLAN_FORMAT, len(self.outputs)]
        for shape, dtype, fill in self.outputs:
            flat += [_SCALAR_TYPES[dtype], int(fill), len(shape), *shape]
        flat.append(len(self.launches))
        for item in self.launches:
            flat += item.flat()
        return flat


def _offset(params: type, path: str) -> int:
    """Byte offset of a (nested, dotted) field of a ctypes struct: _offset(launch.BwdSm90Params, 'bwd.fwd.q')."""
    offset = 0
    for name in path.split("."):
        offset += getattr(params, name).offset
        params = dict(params._fields_)[name]
    return offset


def _fwd_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              bs_rows, window=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod="", mm_states=None,
              mm_tensors=()) -> _Plan:
    """The launch plan of a forward call (q, k, v aligned: _aligned); window (left, right), softcap, alibi_slopes
    (float32 (batch, nheads), head stride 1): as flash_attn_func's (with causal, right is -1)."""
    if no_work(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):  # out 0, lse -inf
        (out_shape, out_dtype), (lse_shape, lse_dtype) = _output_shapes(q, cu_seqlens_q)
        return _no_work_plan([(out_shape, out_dtype, _FILL_ZERO), (lse_shape, lse_dtype, _FILL_NEG_INF)])
    launch = _launch or _load_launch()
    block_sparse = bs_rows is not None
    arch = launch.device_arch(q.device)
    head_dim = build.rounded_head_dim(q.shape[-1], block_sparse, arch)
    mask = mask_mod_from_text(mask_mod, mm_tensors)
    small_l2 = arch == build.SM90_ARCH and build.is_small_l2(launch.l2_bytes(q.device))
    spec = build.fwd_kernel(head_dim, _DTYPE_NAMES[q.dtype], causal, dropout_p > 0, block_sparse, arch=arch,
                            smem_limit=launch.device_smem_limit(q.device),
                            seqlen_q=max_seqlen_q if cu_seqlens_q is not None else q.shape[1],
                            seqlen_k=0 if cu_seqlens_k is not None else k.shape[1],
                            effective_head_dim=q.shape[-1],
                            score_mods=_score_mods(window, softcap, alibi_slopes) or mask is not None,
                            softcap=softcap > 0, mask_defines=mask.kernel_defines() if mask is not None else (),
                            window_only=_window_only(mask, softcap, alibi_slopes), small_l2=small_l2)
    outputs = _output_shapes(q, cu_seqlens_q)
    out, lse = (torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in outputs)
    params = _fwd_params(q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         bs_rows=bs_rows, window=window, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
                         mm_states=mm_states)
    grid = grid_tiles = (math.ceil(params.seqlen_q / spec.block_m), params.batch, params.nheads)
    if spec.persistent:  # at most one CTA per SM, each taking tiles from the dynamic scheduler
        grid = (min(math.prod(grid), launch.sm_count(q.device)), 1, 1)
        cluster = getattr(spec.tiles, "cluster", 1)
        if cluster > 1:  # whole clusters, statically scheduled pairs of query tiles (build.fwd_sm90_tiles)
            if cu_seqlens_q is not None or math.ceil(params.seqlen_q / spec.block_m) % cluster:
                raise AssertionError(f"{spec.name}: clusters need a dense call with a multiple of {cluster} query "
                                     f"tiles per head (seqlen_q {params.seqlen_q})")
            grid = (max(grid[0] // cluster, 1) * cluster, 1, 1)
    if spec.persistent and causal and (head_dim >= FWD_CAUSAL_GROUP_HEAD_DIM or spec.block_m > 128):  # (fwd_tile)
        n_blocks, short_hd128 = math.ceil(params.seqlen_q / spec.block_m), _short_group_hd128(head_dim, q.shape[-1],
                                                                                              spec.block_m)
        small_l2_short = small_l2 and params.nheads == params.nheads_kv and (
            (short_hd128 and n_blocks <= CAUSAL_GROUP_SHORT_BLOCKS)
            or (spec.block_m > 128 and n_blocks <= FWD_TALL_SHORT_BLOCKS_SMALL_L2))
        params.causal_tile_group = _causal_tile_group(n_blocks, params.batch * params.nheads,
                                                      launch.sm_count(q.device), short_hd128,
                                                      tall=spec.block_m > 128
                                                      and params.seqlen_q >= FWD_TALL_CAUSAL_GROUP_SEQLEN,
                                                      wide_fwd=head_dim > 128 and spec.block_m == 128,
                                                      small_l2_short=small_l2_short)
    kernel = launch.get_kernel(spec, spec.symbols[0], q.device)
    varlen, maps, prefix = cu_seqlens_q is not None, [], ""
    if spec.source == "flash_fwd_sm90.cu":  # the TMA kernel: tensor maps of q, k, v, out, then the same parameters
        params, prefix = launch.FwdSm90Params(fwd=params), "fwd."
        # (clusters at head dims of one 64-column box, FwdSm90Traits::kColBlocks 1: each CTA copies half of a K / V
        # tile's rows, tma_load_4d_multicast_rows)
        kv_rows = spec.tiles.block_n // (spec.tiles.cluster if head_dim // 64 == 1 else 1)
        maps = [(_offset(launch.FwdSm90Params, name), index, tma.layout(x, varlen, rows)) for name, index, x, rows in
                (("tma_q", 0, q, spec.tiles.block_m), ("tma_k", 1, k, kv_rows),
                 ("tma_v", 2, v, kv_rows), ("tma_o", -1, out, 64))]  # (-1: output 0)
    fields = (("q", _INPUT, 0), ("k", _INPUT, 1), ("v", _INPUT, 2), ("out", _OUTPUT, 0), ("lse", _OUTPUT, 1),
              ("cu_seqlens_q", _INPUT, 3), ("cu_seqlens_k", _INPUT, 4), ("rng_state", _INPUT, 5),
              ("bs_rows", _INPUT, 6), ("alibi_slopes", _INPUT, 8))
    addresses = [(_offset(type(params), prefix + name), source, index, 0) for name, source, index in fields]
    outputs = [(shape, dtype, _FILL_NONE) for shape, dtype in outputs]
    if build.fwd_tail_split(spec) and not varlen:  # the last, partial wave's tiles in pieces over their key blocks
        n_tiles = math.prod(grid_tiles)
        params.tail_first, params.tail_pieces = _tail_split(n_tiles, launch.sm_count(q.device),
                                                            math.ceil(params.fwd.seqlen_k / spec.tiles.block_n))
        if params.tail_pieces > 1:
            n_tail, consumers = n_tiles - params.tail_first, spec.block_m // 64
            outputs.append(((n_tail * consumers,), torch.int32, _FILL_ZERO))  # warpgroups done per tail tile
            # per tail tile, piece and consumer warpgroup: its 128 threads' fp32 O (head_dim / 2) and lse (2)
            outputs.append(((n_tail * params.tail_pieces * consumers * 128 * (head_dim // 2 + 2),), torch.float32,
                            _FILL_NONE))
            addresses += [(_offset(launch.FwdSm90Params, "tail_counters"), _OUTPUT, 2, 0),
                          (_offset(launch.FwdSm90Params, "tail_partials"), _OUTPUT, 3, 0)]
            grid = (min(n_tiles + n_tail * (params.tail_pieces - 1), launch.sm_count(q.device)), 1, 1)
    item = _Launch(kernel, grid, params, addresses, maps)
    if mask is not None:  # inputs 9, 10, 11.. (the mma.sync kernel: FwdParams itself)
        item.addresses += _mask_addresses(type(params), prefix, 9, len(mask.tensors))
    if spec.persistent:
        item.tile_counter_offset = _offset(launch.FwdSm90Params, "tile_counter")
    return _Plan(outputs, [item])


def _bwd_plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, causal, deterministic, bs_cols, window=(-1, -1), softcap=0.0,
              alibi_slopes=None, mask_mod="", mm_states=None, mm_tensors=()) -> _Plan:
    """The launch plan of a backward call (dout, q, k, v, out aligned): the preprocess kernel (D = rowsum(dout * out),
    dq_accum = 0), the backward kernel, the dq conversion (dq = scale * sum of dq_accum)."""
    if no_work(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):  # dq, dk, dv 0
        return _no_work_plan([(tuple(x.shape), q.dtype, _FILL_ZERO) for x in (q, k, v)])
    launch = _launch or _load_launch()
    dq = q.new_empty(q.shape, device="meta")
    dk, dv = k.new_empty(k.shape, device="meta"), v.new_empty(v.shape, device="meta")
    block_sparse = bs_cols is not None
    arch = launch.device_arch(q.device)
    head_dim = build.rounded_head_dim(q.shape[-1], block_sparse, arch)
    mask = mask_mod_from_text(mask_mod, mm_tensors)
    spec = build.bwd_kernel(head_dim, _DTYPE_NAMES[q.dtype], causal, dropout_p > 0, block_sparse, arch=arch,
                            deterministic=deterministic, smem_limit=launch.device_smem_limit(q.device),
                            effective_head_dim=q.shape[-1],
                            seqlen_q=max_seqlen_q if cu_seqlens_q is not None else q.shape[1],
                            score_mods=_score_mods(window, softcap, alibi_slopes) or mask is not None,
                            softcap=softcap > 0,
                            mask_defines=mask.kernel_defines() if mask is not None else (),
                            window_left=window[0],
                            window_only=_window_only(mask, softcap, alibi_slopes))
    tiles = spec.tiles
    fwd = _fwd_params(q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      bs_cols=bs_cols, window=window, softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
                      mm_states=mm_states)
    batch, nheads, nheads_kv = fwd.batch, fwd.nheads, fwd.nheads_kv
    n_kblocks = math.ceil(fwd.seqlen_k / tiles.block_n)
    nsplits = 1
    hopper = spec.source == "flash_bwd_sm90.cu"
    if deterministic and not hopper:  # enough CTAs to fill the GPU twice over; each walks key blocks x, x + nsplits..
        sm_count = launch.sm_count(q.device)
        nsplits = max(1, min(n_kblocks, math.ceil(2 * sm_count / max(1, batch * nheads_kv))))
    # (Hopper: one dq_accum, the key blocks taking turns at each query block in one chain, in tile groups:
    # _det_tile_group. Chains of their own dq_accum splits were 0.65-0.95x of one chain with the groups, H200.)
    # the Hopper backward's dq_accum rows are its instantiated head dim (a padded head dim adds whole 16-row slices too)
    dqa_cols = head_dim if hopper else q.shape[-1]
    varlen = cu_seqlens_q is not None
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    if hopper:
        # padded rows (csrc/flash.h): each sequence owns whole query blocks of lse_log2, softmax_d and dq_accum, so
        # that the kernel reads a block's statistics and adds its dQ with bulk copies (racecheck-clean hand-overs);
        # one float32 workspace (output 3): lse_log2, softmax_d, dq_accum
        # (utils.cuh padded_row_start; a multiple of block_m: 16-byte aligned heads for the copies)
        block_m = tiles.block_m
        rows_pad = (batch * -(-fwd.seqlen_q // block_m) * block_m if not varlen
                    else -(-(fwd.total_q + batch * block_m) // block_m) * block_m)
        stats_floats = nheads * rows_pad
        # (80-query blocks: dq_accum starts at a whole row of dqa_cols floats from lse_log2, where tma_dq's rows do)
        row_floats = dqa_cols if tiles.swap_dq else 32
        d_offset, d_floats = 4 * stats_floats, -(-2 * stats_floats // row_floats) * row_floats
        dqa_shape = (nsplits, nheads, rows_pad, dqa_cols)
        dqa_strides = (nheads * rows_pad * dqa_cols, 0, rows_pad * dqa_cols)
        d_strides = (0, rows_pad)
    else:
        # softmax_d (lse's layout) and dq_accum share one float32 workspace (output 3); dq_accum starts 128-byte
        # aligned
        d_extent = 1 + sum((size - 1) * stride for size, stride in zip(lse.shape, lse.stride()))
        d_offset, d_floats, dqa_shape = 0, -(-d_extent // 32) * 32, (nsplits, *lse.shape, dqa_cols)
        dq_accum = torch.empty(dqa_shape, dtype=torch.float32, device="meta")
        dqa_strides = (dq_accum.stride(0), 0, dq_accum.stride(1)) if varlen else dq_accum.stride()[:3]
        d_strides = lse_strides
    # the kernel converts dq itself (build.bwd_fused_dq): per (query head, query block of the padded rows) a count of
    # the key blocks added, after dq_accum in the workspace (zeroed by the preprocess)
    fused_dq = hopper and build.bwd_fused_dq(spec)
    counts_per_head = rows_pad // tiles.block_m if fused_dq else 0
    outputs = [(tuple(q.shape), q.dtype, _FILL_NONE), (tuple(k.shape), q.dtype, _FILL_NONE),
               (tuple(v.shape), q.dtype, _FILL_NONE),
               ((d_floats + math.prod(dqa_shape) + nheads * counts_per_head,), torch.float32, _FILL_NONE)]
    softmax_d, dq_accum_address = (_OUTPUT, 3, d_offset), (_OUTPUT, 3, 4 * d_floats)
    dq_counts_address = (_OUTPUT, 3, 4 * (d_floats + math.prod(dqa_shape)))

    aux_spec = build.aux_kernels(_DTYPE_NAMES[q.dtype])
    aux = launch.AuxParams(
        d_batch_stride=d_strides[0], d_head_stride=d_strides[1], dqa_split_stride=dqa_strides[0],
        dqa_batch_stride=dqa_strides[1], dqa_head_stride=dqa_strides[2], batch=batch, nheads=nheads,
        head_dim=q.shape[-1], seqlen_q=fwd.seqlen_q, seqlen_k=fwd.seqlen_k, nsplits=nsplits,
        softmax_scale=softmax_scale, dq_block_m=tiles.block_m, total_q=fwd.total_q, total_k=fwd.total_k,
        dqa_cols=dqa_cols, padded=int(hopper), lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1],
        # the backward adds whole blocks in a scrambled order unless deterministic or head_dim is padded (mma.sync)
        dq_slice_width=(tiles.dq_slice_width(head_dim)
                        if tiles.scramble_dq and (hopper or not deterministic) and dqa_cols == head_dim else 0),
        dq_frag=int(hopper and tiles.swap_dq and tiles.dq_frag), lse_bias=int(build.bwd_lse_bias(spec)),
        fused_dq=(2 if causal else 1) if fused_dq else 0, dq_counts_head_stride=counts_per_head)
    (aux.o_batch_stride, aux.o_row_stride, aux.o_head_stride) = _strides(out, varlen)
    (aux.do_batch_stride, aux.do_row_stride, aux.do_head_stride) = _strides(dout, varlen)
    (aux.dq_batch_stride, aux.dq_row_stride, aux.dq_head_stride) = _strides(dq, varlen)
    aux_addresses = [(_offset(launch.AuxParams, name), *source) for name, source in (
        ("out", (_INPUT, 4, 0)), ("dout", (_INPUT, 0, 0)), ("dq", (_OUTPUT, 0, 0)), ("softmax_d", softmax_d),
        ("dq_accum", dq_accum_address), ("cu_seqlens_q", (_INPUT, 6, 0)), ("cu_seqlens_k", (_INPUT, 7, 0)),
        ("rng_state", (_INPUT, 8, 0)), ("lse", (_INPUT, 5, 0)), ("lse_log2", (_OUTPUT, 3, 0)),
        ("dlse", (_INPUT, _DLSE_INPUT, 0)), *((("dq_counts", dq_counts_address),) if fused_dq else ()))]
    # (padded: the preprocess also writes the padding rows of each sequence's last query block)
    aux_rows = -(-fwd.seqlen_q // tiles.block_m) * tiles.block_m if hopper else fwd.seqlen_q
    aux_grid = (math.ceil(aux_rows / build.AUX_ROWS_PER_CTA), batch, nheads)
    preprocess = _Launch(launch.get_kernel(aux_spec, aux_spec.symbols[0], q.device), aux_grid, aux, aux_addresses)
    # (dq_frag: one CTA per query block of the fragment order)
    convert_grid = (math.ceil(fwd.seqlen_q / tiles.block_m), batch, nheads) if aux.dq_frag else aux_grid
    convert = _Launch(launch.get_kernel(aux_spec, aux_spec.symbols[1], q.device), convert_grid, aux, aux_addresses)

    params = launch.BwdParams(
        fwd=fwd, dqa_split_stride=dqa_strides[0], dqa_batch_stride=dqa_strides[1], dqa_head_stride=dqa_strides[2],
        deterministic=int(deterministic))
    (params.do_batch_stride, params.do_row_stride, params.do_head_stride) = _strides(dout, varlen)
    (params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride) = _strides(dk, varlen)
    (params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride) = _strides(dv, varlen)
    fields = [("fwd.q", (_INPUT, 1, 0)), ("fwd.k", (_INPUT, 2, 0)), ("fwd.v", (_INPUT, 3, 0)),
              ("fwd.out", (_INPUT, 4, 0)), ("fwd.lse", (_INPUT, 5, 0)), ("fwd.cu_seqlens_q", (_INPUT, 6, 0)),
              ("fwd.cu_seqlens_k", (_INPUT, 7, 0)), ("fwd.rng_state", (_INPUT, 8, 0)),
              ("fwd.bs_cols", (_INPUT, 9, 0)), ("fwd.alibi_slopes", (_INPUT, 10, 0)), ("dout", (_INPUT, 0, 0)),
              ("dk", (_OUTPUT, 1, 0)),
              ("dv", (_OUTPUT, 2, 0)), ("dq_accum", dq_accum_address), ("softmax_d", softmax_d)]
    if fused_dq:
        (params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride) = _strides(dq, varlen)
        params.dq_counts_head_stride = counts_per_head
        fields += [("dq", (_OUTPUT, 0, 0)), ("dq_counts", dq_counts_address)]
    if deterministic and hopper:  # per (batch, head, query block): MMA warps of lower key blocks done adding dQ
        params.dq_sem_mblocks = math.ceil(fwd.seqlen_q / tiles.block_m)
        outputs.append(((nsplits, batch, nheads, params.dq_sem_mblocks), torch.int32, _FILL_ZERO))  # output 4
        fields.append(("dq_semaphore", (_OUTPUT, 4, 0)))
    params.kv_splits, kv_converts = 1, []
    if hopper and not block_sparse and nheads > nheads_kv:  # (deterministic too: the splits are summed in order)
        params.kv_splits = _gqa_splits(nheads // nheads_kv, fwd.seqlen_q, fwd.seqlen_k, tiles, causal,
                                       batch * nheads_kv, launch.sm_count(q.device))
    if params.kv_splits > 1:  # fp32 dK / dV sums (an output of their own), converted by two launches
        rows = (nheads_kv, fwd.total_k) if varlen else (batch, nheads_kv, fwd.seqlen_k)
        params.dkv_cols, params.dkv_split_stride = head_dim, math.prod(rows) * head_dim
        params.dkv_batch_stride = 0 if varlen else nheads_kv * fwd.seqlen_k * head_dim
        params.dkv_head_stride = rows[-1] * head_dim
        # the splits reduce-add into one zero-filled copy; deterministic calls: a copy per split, summed in order
        copies = params.kv_splits if deterministic else 1
        index = len(outputs)
        outputs.append(((2 * copies * params.dkv_split_stride,), torch.float32,
                        _FILL_NONE if deterministic else _FILL_ZERO))
        fields.append(("dkv_accum", (_OUTPUT, index, 0)))
        for target, scale, offset in ((1, softmax_scale, 0), (2, 1.0, 4 * copies * params.dkv_split_stride)):
            aux_kv = launch.AuxParams(
                dqa_split_stride=params.dkv_split_stride, dqa_batch_stride=params.dkv_batch_stride,
                dqa_head_stride=params.dkv_head_stride, batch=batch, nheads=nheads_kv, head_dim=k.shape[-1],
                seqlen_q=fwd.seqlen_k, seqlen_k=fwd.seqlen_k, nsplits=copies, softmax_scale=scale,
                dq_block_m=tiles.block_m, total_q=fwd.total_k, total_k=fwd.total_k, dqa_cols=head_dim, dq_slice_width=0)
            (aux_kv.dq_batch_stride, aux_kv.dq_row_stride, aux_kv.dq_head_stride) = _strides(dk, varlen)
            kv_converts.append(_Launch(
                launch.get_kernel(aux_spec, aux_spec.symbols[1], q.device),
                (math.ceil(fwd.seqlen_k / build.AUX_ROWS_PER_CTA), batch, nheads_kv), aux_kv,
                [(_offset(launch.AuxParams, name), *source) for name, source in (
                    ("dq", (_OUTPUT, target, 0)), ("dq_accum", (_OUTPUT, index, offset)),
                    ("cu_seqlens_q", (_INPUT, 7, 0)), ("cu_seqlens_k", (_INPUT, 7, 0)))]))
    if hopper and causal and not deterministic:  # (else 0: key blocks fastest)
        params.fwd.causal_tile_group = _causal_tile_group(n_kblocks, batch * nheads_kv * params.kv_splits,
                                                          launch.sm_count(q.device),
                                                          _short_group_hd128(head_dim, q.shape[-1], tiles.block_n),
                                                          wide_bwd=tiles.split_head_dim)
    elif hopper and deterministic:
        m_blocks = math.ceil(fwd.seqlen_q / tiles.block_m)
        params.fwd.causal_tile_group = _det_tile_group(
            (m_blocks + 1) / 2 if causal else m_blocks, batch * nheads_kv * params.kv_splits,
            8 * fwd.seqlen_q * head_dim * (nheads // nheads_kv // params.kv_splits), launch.sm_count(q.device),
            n_kblocks, _det_group_steps(causal, head_dim, q.shape[-1], fwd.seqlen_q))
    grid = (nsplits if deterministic and not hopper else n_kblocks, batch, nheads_kv)
    n_units = n_tiles = math.prod(grid) * params.kv_splits
    if hopper and build.bwd_tail_split(spec) and not varlen and params.kv_splits == 1:
        # the last, partial wave's tiles in pieces over their query blocks (BwdParams' tail fields)
        steps = nheads // nheads_kv * math.ceil(fwd.seqlen_q / tiles.block_m)
        params.tail_first, params.tail_pieces = _tail_split(n_tiles, launch.sm_count(q.device), steps)
        if params.tail_pieces > 1:
            n_tail = n_tiles - params.tail_first
            n_units = n_tiles + n_tail * (params.tail_pieces - 1)
            outputs.append(((n_tail,), torch.int32, _FILL_ZERO))  # pieces done per tail tile
            fields.append(("tail_counters", (_OUTPUT, len(outputs) - 1, 0)))
            # per tail tile, piece and MMA warpgroup: its 128 threads' fp32 dK and dV sums, head_dim floats each
            outputs.append(((n_tail * params.tail_pieces * 2 * 128 * head_dim,), torch.float32, _FILL_NONE))
            fields.append(("tail_partials", (_OUTPUT, len(outputs) - 1, 0)))
    if hopper:  # tiles (key block, batch, kv head, GQA split) along x: at most one CTA per SM when persistent
        grid = (min(n_units, launch.sm_count(q.device)) if tiles.persistent else n_tiles, 1, 1)
    maps, prefix = [], ""
    if hopper:  # the TMA kernel: tensor maps of q, k, v, dout, dk, dv, then the same parameters
        params, prefix = launch.BwdSm90Params(bwd=params), "bwd."
        # (K: tiles.k_box_cols columns per box, the kernel's TileK)
        maps = [(_offset(launch.BwdSm90Params, name), index, tma.layout(x, varlen, rows, cols))
                for name, index, x, rows, cols in
                (("tma_q", 1, q, tiles.block_m, tma.BOX_COLS), ("tma_k", 2, k, tiles.block_n, tiles.k_box_cols),
                 ("tma_v", 3, v, tiles.block_n, tma.BOX_COLS), ("tma_do", 0, dout, tiles.block_m, tma.BOX_COLS),
                 ("tma_dk", -2, dk, 64, tma.BOX_COLS), ("tma_dv", -3, dv, 64, tma.BOX_COLS))]  # outputs 1, 2
        # lse_log2 and softmax_d, the start of output 3
        maps.append((_offset(launch.BwdSm90Params, "tma_stats"), -4, tma.rows_layout(rows_pad, 2 * nheads,
                                                                                       tiles.block_m)))
        if tiles.swap_dq and not tiles.dq_frag:  # dq_accum's rows, counted from lse_log2's address (same output)
            params.bwd.dq_map_row0 = d_floats // dqa_cols
            maps.append((_offset(launch.BwdSm90Params, "tma_dq"), -4,
                         tma.accum_layout(d_floats // dqa_cols + nheads * rows_pad, dqa_cols, tiles.block_m)))
    main = _Launch(launch.get_kernel(spec, spec.symbols[0], q.device), grid, params,
                   [(_offset(type(params), prefix + name), *source) for name, source in fields], maps)
    if hopper:  # the persistent grid's tile counter (the one-CTA-per-tile variant ignores it)
        main.tile_counter_offset = _offset(launch.BwdSm90Params, "tile_counter")
    if mask is not None:  # inputs 11, 12, 13.. (the mma.sync kernel: BwdParams)
        main.addresses += _mask_addresses(type(params), prefix + "fwd.", 11, len(mask.tensors))
    # Hopper: the main kernel and the conversions are programmatic dependent launches (build.pdl_enabled): the main
    # kernel's prologue (barrier set-up, tensor-map prefetches) overlaps the preprocess's tail, then its threads wait
    # for the preprocess's writes; each conversion waits for the kernel before it at its start
    converts = [*([] if fused_dq else [convert]), *kv_converts]
    if hopper and build.pdl_enabled():
        for item in (main, *converts):
            item.pdl = True
    return _Plan(outputs, [preprocess, main, *converts])


# Hopper causal kernels: tiles per group of units (FwdParams.causal_tile_group) about this many times the SM count
CAUSAL_GROUP_WAVES = 2.0
# ... in the forward from this (instantiated) head dim: H200, 2026-11-25, causal forward with / without the groups,
# hd128 512 / 1K / 4K 1.11 / 1.17 / 1.06x; hd64 512 / 1K / 4K / GPT-2 small 0.99 / 0.99 / 1.02 / 0.98x (128-row
# tiles). Below it, with tiles of more than 128 rows (hd64 causal from build.LONG_CAUSAL_SEQLEN): H200, 2026-11-26,
# graph-interleaved, 512 / 1K / 2K / 4K 1.009 / 1.020 / 1.008 / 1.003x.
FWD_CAUSAL_GROUP_HEAD_DIM = 128


# ... and CAUSAL_GROUP_WAVES_SHORT for short head-dim-128 calls (at most CAUSAL_GROUP_SHORT_BLOCKS blocks of 128 rows
# per unit, 1K tokens; not head dims 65-96 on the hd128 tiles): one wave. H200, 2026-12-01, interleaved CUDA-graph A/B
# (ab_probe.py), one wave / two: hd128 causal 512 backward 1.034, forward 1.053; 1K 1.014 / 1.021; 2K 0.999 / 0.997
# and 4K 0.994 / 0.994 (so not there); hd64 512 / 1K 0.995-0.997 backward (not there either); four waves and longest
# first over all units: 0.81-0.95 and 0.68-0.82 at 512 / 1K (kernel_ab-h200.json). A group of two waves of 512-token
# hd128 units spans about 50 MB of their inputs (and the backward's dq_accum rows), the L2's size; one wave, half that.
# A/B: ab_probe.py flashtrain@ops.CAUSAL_GROUP_WAVES_SHORT=2 (two waves everywhere).
CAUSAL_GROUP_WAVES_SHORT = 1.0
CAUSAL_GROUP_SHORT_BLOCKS = 8
# ... but half a wave for those forwards (not GQA) on a GPU with a small L2 (build.SMALL_L2_BYTES: the H100), and for
# the hd64 causal forward on 192-row tiles with at most FWD_TALL_SHORT_BLOCKS_SMALL_L2 of them (768 rows; two Q
# buffers there, build.SMALL_L2_Q_BUFFERS_SEQLEN). H100 80GB HBM3, 2026-12-05, interleaved CUDA-graph replays
# (ab_probe.py), forward against one wave: hd128 causal 512 1.028-1.031, 768 1.027-1.028, 1K 1.019-1.026 (two
# machines; a quarter wave 1.026-1.027, three quarters 1.010-1.034); but GQA 32/8 at 512 0.986-0.988, and the
# backward 0.988-0.994 at 512, 1.014-1.019 at 1K, so neither takes it. hd64 (two Q buffers) against two waves: 512
# 1.008, 768 1.024, but 1K 0.986 and 12 heads at 1K 0.972. Both rules and the two Q buffers against none of them
# (build.SMALL_L2_BYTES = 0): hd64 512 / 768 / 1K 1.033 / 1.045 / 1.010, hd128 512 / 1K 1.032 / 1.018
# (kernel_ab-h100.json). A/B: ab_probe.py flashtrain@build.SMALL_L2_BYTES=0.
FWD_SHORT_WAVES_SMALL_L2 = 0.5
FWD_TALL_SHORT_BLOCKS_SMALL_L2 = 4


# ... and, at head dims above 128 (192, 256), fewer waves for short calls too: the forward (128-row query tiles)
# FWD_WIDE_SHORT_WAVES up to FWD_WIDE_SHORT_BLOCKS query blocks (1K tokens), the backward (96-key blocks at hd192,
# 64-key at hd256) BWD_WIDE_SHORT_WAVES up to BWD_WIDE_SHORT_BLOCKS key blocks (1.5K / 1K keys). H200, 2026-12-03,
# interleaved CUDA-graph A/B (ab_probe.py), against two waves: forward, 1.5 waves: hd192 512 / 1K 1.076 / 1.041, 16
# heads batch 8 1.043; hd256 512 / 1K 1.133 / 1.050, 16 heads 1.045, GQA 16/2 1K 0.990 (one wave: 1.004 there, but
# 1.047 / 1.105 at 512); 2K 1.000 (so not there); backward, one wave: hd256 512 1.062, 1K 1.019-1.036, 2K / 4K
# 1.008 / 1.004 (not there); hd192 512 1.014-1.018, 1K 1.000-1.028, 1.5K 1.004-1.010, 2K 0.976; forward + backward
# 1.022-1.069 (kernel_ab-h200.json). A/B: ab_probe.py flashtrain@ops.FWD_WIDE_SHORT_BLOCKS=0,
# flashtrain@ops.BWD_WIDE_SHORT_BLOCKS=0 (two waves everywhere).
FWD_WIDE_SHORT_WAVES = 1.5
FWD_WIDE_SHORT_BLOCKS = 8
BWD_WIDE_SHORT_WAVES = 1.0
BWD_WIDE_SHORT_BLOCKS = 16


# ... and FWD_TALL_CAUSAL_GROUP_WAVES for the forward's tiles of more than 128 rows (head dim 64 causal: 192 rows,
# build.FWD_SM90_TILES_LONG_CAUSAL) from FWD_TALL_CAUSAL_GROUP_SEQLEN query rows. H200, 2026-12-02, interleaved
# CUDA-graph replays (ab_probe.py), forward, four waves / two: hd64 causal 2K / 4K / 8K / 16K 1.005 / 1.002 / 1.007 /
# 1.006 (three: 1.000 / 1.000 / 1.006 / 1.005; all units, longest first: 0.963 / 0.992 / 1.007 / 1.007); but 512 /
# 1K 0.986 / 0.994 (GPT-2 small's 12 heads at 1K: 1.013), hence the threshold (kernel_ab-h200.json). A/B: ab_probe.py
# flashtrain@ops.FWD_TALL_CAUSAL_GROUP_WAVES=2.
FWD_TALL_CAUSAL_GROUP_WAVES = 4.0
FWD_TALL_CAUSAL_GROUP_SEQLEN = 2048


def _causal_tile_group(n_blocks: int, n_units: int, sm_count: int, short_hd128: bool = False,
                       tall: bool = False, wide_fwd: bool = False, wide_bwd: bool = False,
                       small_l2_short: bool = False) -> int:
    """Units per group of the Hopper causal kernels' tile order (forward: (batch, head) with n_blocks query blocks;
    backward: (batch, kv head, GQA split) with n_blocks key blocks): enough that a group's tiles, longest first, fill
    the SMs CAUSAL_GROUP_WAVES times over (CAUSAL_GROUP_WAVES_SHORT where short_hd128, a head-dim-128 call on 128-row
    blocks, has at most CAUSAL_GROUP_SHORT_BLOCKS of them; FWD_SHORT_WAVES_SMALL_L2 where small_l2_short, a short
    forward without GQA on a GPU of build.SMALL_L2_BYTES, decided by the caller; FWD_WIDE_SHORT_WAVES /
    BWD_WIDE_SHORT_WAVES where wide_fwd / wide_bwd, a forward / backward at a head dim above 128, has at most
    FWD_WIDE_SHORT_BLOCKS / BWD_WIDE_SHORT_BLOCKS; FWD_TALL_CAUSAL_GROUP_WAVES where tall, a long forward on query
    tiles of more than 128 rows), so that the launch ends on short tiles; no more, so that concurrent tiles share K / V
    (backward: Q / dO and dQ rows) in L2. (The kernel's last group also takes the
    remainder of n_units.) Earlier orders: backward, key blocks fastest (CAUSAL_GROUP_WAVES = 0); forward, longest
    first over all units (CAUSAL_GROUP_WAVES = inf)."""
    if tall:
        waves = FWD_TALL_CAUSAL_GROUP_WAVES
    elif small_l2_short:
        waves = FWD_SHORT_WAVES_SMALL_L2
    elif short_hd128 and n_blocks <= CAUSAL_GROUP_SHORT_BLOCKS:
        waves = CAUSAL_GROUP_WAVES_SHORT
    elif wide_fwd and n_blocks <= FWD_WIDE_SHORT_BLOCKS:
        waves = FWD_WIDE_SHORT_WAVES
    elif wide_bwd and n_blocks <= BWD_WIDE_SHORT_BLOCKS:
        waves = BWD_WIDE_SHORT_WAVES
    else:
        waves = CAUSAL_GROUP_WAVES
    if not math.isfinite(waves):
        return n_units
    # (n_blocks 0: max_seqlen 0, a call without work; no_work keeps such calls from launching)
    return max(1, min(n_units, math.ceil(waves * sm_count / max(1, n_blocks))))


def _short_group_hd128(head_dim: int, call_head_dim: int, block: int) -> bool:
    """Whether a causal call's tile groups take CAUSAL_GROUP_WAVES_SHORT when short: head dim 128 (instantiated, and
    not a head dim 65-96 narrowed on its tiles), blocks of 128 rows."""
    return head_dim == 128 and build.sm90_narrow_width(128, call_head_dim) is None and block == 128


# The Hopper deterministic backward's tile order: units per group (FwdParams.causal_tile_group; 0: key blocks
# fastest), ceil(DET_GROUP_STEPS * sm_count / steps_per_tile) ...
DET_GROUP_STEPS = 2.0
# ... and no more units than keep this many bytes of their Q and dO rows (bf16) and dq_accum rows (fp32) in L2 ...
DET_GROUP_L2_BYTES = 24 << 20
# ... but (DET_GROUP_FULL_WAVE = 1) at least enough units for one tile per SM: a group of fewer tiles than SMs leaves
# SMs idle until its last tiles end (hd128 16K non-causal, 64-query blocks: one 16 MiB unit is 128 key blocks on 132
# SMs; two units measured 1.011x, H200, 2026-11-30). 0: the L2 bound alone (A/B).
DET_GROUP_FULL_WAVE = 1
# ... with DET_CAUSAL_GROUP_STEPS[head dim] in place of DET_GROUP_STEPS for causal calls at head dims 64 and 128 (the
# call's own head dim: not 65-96 on the hd128 kernels), the first (queries, waves) entry that covers the call: hd64 one
# wave of steps per group up to 2K queries, half a wave up to 4K; hd128 key blocks fastest (0) up to 1K, then as hd64.
# After the default backward's short causal calls gained the in-kernel dQ conversion, their deterministic ones fell to
# 0.77-0.83x of it with two waves. H100 80GB HBM3, 2026-12-06, interleaved CUDA-graph replays (ab_probe.py
# flashtrain-det@ops.DET_GROUP_STEPS=...), deterministic / default backward, two waves -> this rule: hd128 causal 2K
# 0.87 -> 0.91, 4K 0.87 -> 0.89; hd64 causal 512 0.83 -> 0.89, 768 0.81 -> 0.86, 1K 0.81 -> 0.87, 2K 0.88 -> 0.89, 4K
# 0.91 -> 0.94 (kernel_ab-h100.json det_group_steps_ab); hd128 causal with one wave / key blocks fastest: 512 0.89 /
# 0.96, 768 0.84 / 0.91, 1K 0.85 / 0.89, 2K 0.89 / 0.89 (det_hd128_builds_ab). Key blocks fastest measured lower at
# hd64 (0.75-0.84) and in non-causal calls (0.55-0.94); at 8K / 16K no setting measured better than two waves.
# DET_CAUSAL_GROUP_RULE = 0: DET_GROUP_STEPS for every call (A/B: ab_probe.py
# flashtrain-det@ops.DET_CAUSAL_GROUP_RULE=0).
DET_CAUSAL_GROUP_STEPS = {64: ((2048, 1.0), (4096, 0.5)), 128: ((1024, 0.0), (2048, 1.0), (4096, 0.5))}
DET_CAUSAL_GROUP_RULE = 1


def _det_group_steps(causal: bool, head_dim: int, call_head_dim: int, seqlen_q: int) -> float:
    """Waves of steps per tile group of a Hopper deterministic backward call (DET_CAUSAL_GROUP_STEPS, else
    DET_GROUP_STEPS)."""
    if DET_CAUSAL_GROUP_RULE and causal and call_head_dim == head_dim:
        for seqlen, steps in DET_CAUSAL_GROUP_STEPS.get(head_dim, ()):
            if seqlen_q <= seqlen:
                return steps
    return DET_GROUP_STEPS


def _det_tile_group(steps_per_tile: float, n_units: int, unit_bytes: int, sm_count: int, n_kblocks: int,
                    group_steps: float) -> int:
    """Units per tile group of the Hopper deterministic backward (0: key blocks fastest; steps_per_tile: a tile's
    query blocks, unit_bytes: a unit's Q, dO and dq_accum rows, n_kblocks: a unit's tiles). Fewer of a unit's key
    blocks then run at once, in one chain of turns. H200, 2026-11-25, deterministic / default backward at 2K-16K, hd64
    and hd128: these groups 0.73-0.91x; key blocks fastest 0.67-0.84x with 2-4 chains of their own dq_accum, 0.49-0.83x
    with one; 4 units per group within 0.01 of these except hd128 causal 16K (0.72 vs 0.79); 33 units 0.57-0.84x and
    all units 0.56-0.79x (the units' Q, dO and dq_accum leave L2). group_steps: the call's waves of steps
    (_det_group_steps: DET_GROUP_STEPS or the causal rule's)."""
    if group_steps <= 0:
        return 0
    want = math.ceil(group_steps * sm_count / max(1.0, steps_per_tile))
    group = min(want, DET_GROUP_L2_BYTES // max(1, unit_bytes))
    if DET_GROUP_FULL_WAVE and n_kblocks > 0:
        group = max(group, math.ceil(sm_count / n_kblocks))
    return max(1, min(n_units, group))


def _gqa_splits(group: int, seqlen_q: int, seqlen_k: int, tiles, causal: bool, n_bh: int, sm_count: int) -> int:
    """How many tiles share the query heads of a GQA group per key block in the Hopper backward: the smallest divisor
    of the group whose longest tile is at most a quarter of an SM's share of the work, so that the dynamic scheduler
    can balance the SMs (GQA 16/2 at 4K causal, 132 SMs, simulated: the whole group per tile ends 1.59x after the
    ideal, 4 splits 1.00x; 32/8 at 8K: 1.12x and, with 2 splits, 1.005x)."""
    m_blocks, offset = math.ceil(seqlen_q / tiles.block_m), seqlen_k - seqlen_q
    visible = [m_blocks - (max(0, j * tiles.block_n - offset) // tiles.block_m if causal else 0)
               for j in range(math.ceil(seqlen_k / tiles.block_n))]
    share = n_bh * group * sum(max(0, v) for v in visible) / sm_count
    longest = max(visible, default=0)  # (no key block: seqlen_k 0, a call without work)
    for splits in (d for d in range(1, group + 1) if group % d == 0):
        if group // splits * longest <= share / 4:
            return splits
    return group


# The Hopper kernels' tail split (build.BWD_TAIL_SPLIT / FWD_TAIL_SPLIT, _tail_split): a piece's cost beyond its steps
# (query blocks in the backward, key blocks in the forward), in steps (its first copies, the pipeline's fill, its fp32
# partial results written), and per piece the cost of merging its results in the piece that completes the tile; a
# split is taken when it ends the launch at least TAIL_MIN_GAIN of a tile's time earlier. (Estimates from the
# backward's per-tile overheads in the timeline probe, ~3 us of ~250 us at hd128 16K: not yet fitted to a measured
# split.)
TAIL_PIECE_STEPS = 2.0
TAIL_MERGE_STEPS = 0.5
TAIL_MAX_PIECES = 32
TAIL_MIN_GAIN = 0.1


def _tail_split(n_tiles: int, sm_count: int, steps: int) -> tuple[int, int]:
    """(tail_first, pieces) for a persistent launch of n_tiles equally long tiles of `steps` steps each (query blocks
    in the backward, key blocks in the forward) on sm_count SMs: tiles tail_first .. n_tiles - 1, the last wave, which
    leaves the other SMs idle, run as `pieces` pieces of steps / pieces steps each (the piece count that ends the
    launch earliest by the cost model above); (0, 1): no split. E.g. the hd64 non-causal 16K backward, 4096 tiles of
    128 steps on 132 SMs: 4 tail tiles alone for a whole tile's time unless split."""
    tail = n_tiles % sm_count if n_tiles > 0 and sm_count > 0 else 0
    best, best_time = 1, float(steps)
    for pieces in range(2, min(TAIL_MAX_PIECES, steps // 2) + 1):
        waves = math.ceil(tail * pieces / sm_count)
        time = waves * (math.ceil(steps / pieces) + TAIL_PIECE_STEPS + TAIL_MERGE_STEPS * pieces)
        if time < best_time:
            best, best_time = pieces, time
    if tail == 0 or best == 1 or best_time > (1 - TAIL_MIN_GAIN) * steps:
        return 0, 1
    return n_tiles - tail, best


# The plan builders as the C++ executor calls them (their inputs already aligned; the flat plan back).
def _fwd_plan_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 rng_state, deterministic, bs_rows, bs_cols, window_left=-1, window_right=-1, softcap=0.0,
                 alibi_slopes=None, mm_states=None, mm_error=None, mm0=None, mm1=None, mm2=None, mm3=None,
                 mask_mod="") -> list[int]:
    return _fwd_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, bs_rows, (window_left, window_right), softcap, alibi_slopes, mask_mod, mm_states,
                     [x for x in (mm0, mm1, mm2, mm3) if x is not None]).flat()


def _bwd_plan_op(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, rng_state, deterministic, bs_cols, window_left=-1, window_right=-1,
                 softcap=0.0, alibi_slopes=None, mm_states=None, mm_error=None, mm0=None, mm1=None, mm2=None,
                 mm3=None, mask_mod="") -> list[int]:
    return _bwd_plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     softmax_scale, causal, deterministic, bs_cols, (window_left, window_right), softcap,
                     alibi_slopes, mask_mod, mm_states, [x for x in (mm0, mm1, mm2, mm3) if x is not None]).flat()


def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
              rng_state, deterministic, bs_rows=None, bs_cols=None, window_left=-1, window_right=-1, softcap=0.0,
              alibi_slopes=None, mm_states=None, mm_error=None, mm0=None, mm1=None, mm2=None, mm3=None, mask_mod=""):
    return tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in _output_shapes(q, cu_seqlens_q))


def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, causal, rng_state, deterministic, bs_cols=None, window_left=-1, window_right=-1,
              softcap=0.0, alibi_slopes=None, mm_states=None, mm_error=None, mm0=None, mm1=None, mm2=None, mm3=None,
              mask_mod="", dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_host_loaded = False
_host_lock = threading.Lock()
_host_registrations = None  # the torch.library.Library holding this module's registrations for the host's ops


def load_host() -> None:
    """Builds (first use; build.host_library caches it on disk) and loads the C++ host layer, which defines the ops,
    then registers their fake implementations and the plan builders. Raises RuntimeError saying what is missing."""
    global _host_loaded, _host_registrations, flash_attn_fwd, flash_attn_bwd
    if _host_loaded:
        return
    with _host_lock:
        if _host_loaded:
            return
        torch.ops.load_library(str(build.host_library()))
        library = torch.library.Library("flashtrain", "IMPL")
        torch.library.register_fake("flashtrain::flash_attn_fwd", _fwd_fake, lib=library)
        torch.library.register_fake("flashtrain::flash_attn_bwd", _bwd_fake, lib=library)
        library.impl("_fwd_plan", _fwd_plan_op, "CompositeExplicitAutograd")
        library.impl("_bwd_plan", _bwd_plan_op, "CompositeExplicitAutograd")
        _host_registrations = library
        flash_attn_fwd = torch.ops.flashtrain.flash_attn_fwd.default
        flash_attn_bwd = torch.ops.flashtrain.flash_attn_bwd.default
        try:  # plans depend on the shared-memory limit: launch tells when it changes
            from flashtrain.kernels import launch
        except ImportError:  # no cuda-python: no device, no limit to change
            pass
        else:
            launch.smem_limit_listeners.append(clear_host_plans)
        _host_loaded = True


def clear_host_plans() -> None:
    """Forget the C++ executor's plans (launch.smem_limit_listeners: a device's shared-memory limit changed, as
    tests lower it)."""
    if _host_loaded:
        torch.ops.flashtrain._clear_plans()


def __getattr__(name: str):
    """flash_attn_fwd / flash_attn_bwd: the ops (torch OpOverloads), loading the host layer on first access."""
    if name in ("flash_attn_fwd", "flash_attn_bwd"):
        load_host()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -------------------------------------------------------------------------------------------- the Python executor
# The reference the C++ executor is tested against: the same plans, executed in Python.
_fwd_plans: dict[tuple, _Plan] = {}
_bwd_plans: dict[tuple, _Plan] = {}


def clear_plans() -> None:
    """Forget every launch plan (Python and C++ executors), so that the next calls rebuild them: after a dispatch
    table or switch they read at plan time changed (A/B probes, tests)."""
    _fwd_plans.clear()
    _bwd_plans.clear()
    clear_host_plans()


_TMA_BYTES = ctypes.sizeof(tma.TmaDesc)


def _signature(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, *options) -> tuple:
    """Everything a plan depends on besides addresses: layouts, dtype, device, the kernel selection's inputs
    (FLASHTRAIN_SM90, the shared-memory limit) and the call's options."""
    launch = _launch or _load_launch()
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device.index,
            -1 if cu_seqlens_q is None else cu_seqlens_q.shape[0], build.sm90_enabled(),
            launch.device_smem_limit(q.device), *options)


def _remember(plans: dict, key: tuple, plan):
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def _execute(plan: _Plan, inputs: list[Tensor | None]) -> list[Tensor]:
    """Allocates the plan's outputs and issues its launches on the current stream (what flash_host.cpp execute
    does)."""
    device = inputs[0].device
    outputs = [torch.empty(shape, dtype=dtype, device=device) if fill == _FILL_NONE else
               torch.full(shape, 0.0 if fill == _FILL_ZERO else -math.inf, dtype=dtype, device=device)
               for shape, dtype, fill in plan.outputs]
    _issue(plan, inputs, outputs)
    return outputs


def _issue(plan: _Plan, inputs: list[Tensor | None], outputs: list[Tensor]) -> None:
    if not plan.launches:  # a call without work (no_work): its outputs' fills are all
        return
    launch = _launch or _load_launch()
    device = inputs[0].device
    addresses = ([_ptr(x) for x in inputs], [x.data_ptr() for x in outputs])
    stream = launch.stream_of(device)
    for item in plan.launches:
        if min(item.grid) <= 0:
            continue
        params = type(item.params).from_buffer_copy(item.params)
        base = ctypes.addressof(params)
        for offset, source, index, add in item.addresses:
            address = addresses[source][index]
            ctypes.c_uint64.from_address(base + offset).value = address + add if address else 0
        for offset, index, layout in item.tensor_maps:
            x = inputs[index] if index >= 0 else outputs[-1 - index]
            ctypes.memmove(base + offset, ctypes.addressof(tma.tensor_map(x.data_ptr(), layout)), _TMA_BYTES)
        if item.tile_counter_offset >= 0:
            ctypes.c_uint64.from_address(base + item.tile_counter_offset).value = launch.tile_counter(
                item.kernel, device, stream)
        item.kernel.launch_on(item.grid, params, stream, item.pdl)


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
              max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
              rng_state: Tensor | None, bs_rows: Tensor | None, window=(-1, -1),
              softcap: float = 0.0, alibi_slopes: Tensor | None = None, mask_mod: str = "",
              mm_states: Tensor | None = None, mm_error: Tensor | None = None,
              mm_tensors=()) -> tuple[Tensor, Tensor]:
    """(out, lse) of the forward through the Python executor (tests)."""
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    if cu_seqlens_q is not None:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    options = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               None if bs_rows is None else (bs_rows.shape, bs_rows.stride()), tuple(window), softcap,
               None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride()), mask_mod,
               _layouts(mm_states, *mm_tensors))
    key = _signature(q, k, v, cu_seqlens_q, *options)
    plan = _fwd_plans.get(key) or _remember(_fwd_plans, key, _fwd_plan(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, bs_rows,
        window, softcap, alibi_slopes, mask_mod, mm_states, mm_tensors))
    # (the C++ executor's inputs, in order: the mask's four tensor slots too)
    out, lse = _execute(plan, [q, k, v, cu_seqlens_q, cu_seqlens_k, rng_state, bs_rows, None, alibi_slopes,
                               mm_states, mm_error, *mm_tensors, *[None] * (4 - len(mm_tensors))])[:2]
    return out, lse


def _bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
              dropout_p: float, softmax_scale: float, causal: bool, rng_state: Tensor | None,
              deterministic: bool, bs_cols: Tensor | None, window=(-1, -1),
              softcap: float = 0.0, alibi_slopes: Tensor | None = None, mask_mod: str = "",
              mm_states: Tensor | None = None, mm_error: Tensor | None = None,
              mm_tensors=(), dlse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the backward through the Python executor (tests)."""
    dout, q, k, v, out = (_aligned(x) for x in (dout, q, k, v, out))
    if cu_seqlens_q is not None:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    options = (lse.shape, lse.stride(), max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, deterministic,
               None if bs_cols is None else (bs_cols.shape, bs_cols.stride()), tuple(window), softcap,
               None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride()), mask_mod,
               _layouts(mm_states, *mm_tensors))
    key = _signature(q, k, v, cu_seqlens_q, dout.stride(), out.stride(), *options)
    plan = _bwd_plans.get(key) or _remember(_bwd_plans, key, _bwd_plan(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, deterministic, bs_cols, window, softcap, alibi_slopes, mask_mod, mm_states, mm_tensors))
    if dlse is not None:  # lse's layout (the plan reads it with lse's strides)
        dlse = torch.empty_like(lse).copy_(dlse)
    dq, dk, dv = _execute(plan, [dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, bs_cols,
                                 alibi_slopes, mm_states, mm_error, *mm_tensors, *[None] * (4 - len(mm_tensors)),
                                 dlse])[:3]
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------- helpers
def _layouts(*tensors) -> tuple:
    """(shape, stride, dtype) of each tensor given (None: skipped): what a plan's MaskModParams depend on."""
    return tuple((x.shape, x.stride(), x.dtype) for x in tensors if x is not None)


def _output_shapes(q: Tensor, cu_seqlens_q: Tensor | None) -> list[tuple[tuple, torch.dtype]]:
    """The forward's outputs: out like q (contiguous), lse float32 (batch, nheads, seqlen_q) or varlen
    (nheads, total_q)."""
    if cu_seqlens_q is None:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        lse_shape = (q.shape[1], q.shape[0])
    return [(tuple(q.shape), q.dtype), (lse_shape, torch.float32)]


def _aligned(x: Tensor) -> Tensor:
    """x itself when the kernels' 16-byte loads of its rows are aligned (pointer and every stride) and no dimension
    is broadcast (stride 0, which TMA tensor maps cannot express), else a copy. flash_host.cpp aligned: the same."""
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
            stride % 8 == 0 and (stride > 0 or size == 1) for stride, size in zip(x.stride()[:-1], x.shape[:-1])):
        return x
    return x.clone(memory_format=torch.contiguous_format)  # fresh allocations are aligned; head_dim % 8 == 0


def _strides(x: Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements; the batch stride is 0 in the packed layout."""
    return (0, x.stride(0), x.stride(1)) if varlen else (x.stride(0), x.stride(1), x.stride(2))


def _ptr(x: Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _keep_threshold(dropout_p: float) -> int:
    """Keep iff a uniform 16-bit number < threshold: P(keep) = threshold / 65536 = 1 - p up to 2^-17."""
    return min(65536, round((1.0 - dropout_p) * 65536))


def _fwd_params(q, k, v, out, lse, cu_seqlens_q, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, bs_rows=None,
                bs_cols=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, mask=None, mm_states=None):
    """FwdParams of the call, every address 0 (a plan's addresses are written per call); bs_rows (forward) /
    bs_cols (backward): the block-sparse lists, or None; window / softcap: read by the FT_LOCAL / FT_SOFTCAP
    kernels only."""
    launch = _launch or _load_launch()
    varlen = cu_seqlens_q is not None
    params = launch.FwdParams(
        lse_batch_stride=0 if varlen else lse.stride(0), lse_head_stride=lse.stride(0) if varlen else lse.stride(1),
        batch=cu_seqlens_q.numel() - 1 if varlen else q.shape[0], nheads=q.shape[-2], nheads_kv=k.shape[-2],
        head_dim=q.shape[-1], seqlen_q=max_seqlen_q if varlen else q.shape[1],
        seqlen_k=max_seqlen_k if varlen else k.shape[1], softmax_scale=softmax_scale,
        softmax_scale_log2=softmax_scale * math.log2(math.e), keep_threshold=_keep_threshold(dropout_p),
        rp_dropout=1.0 / (1.0 - dropout_p), total_q=q.shape[0] if varlen else 0, total_k=k.shape[0] if varlen else 0,
        window_left=window[0], window_right=window[1],
        softcap_scale=softmax_scale / softcap if softcap > 0 else 0.0,
        softcap_unscale=softcap / softmax_scale if softcap > 0 else 0.0,
        alibi_batch_stride=alibi_slopes.stride(0) if alibi_slopes is not None else 0)
    (params.q_batch_stride, params.q_row_stride, params.q_head_stride) = _strides(q, varlen)
    (params.k_batch_stride, params.k_row_stride, params.k_head_stride) = _strides(k, varlen)
    (params.v_batch_stride, params.v_row_stride, params.v_head_stride) = _strides(v, varlen)
    (params.o_batch_stride, params.o_row_stride, params.o_head_stride) = _strides(out, varlen)
    if bs_rows is not None:  # (mask heads, n_qblocks, n_kblocks + 1); head stride 0 for one shared mask
        params.bs_rows_head_stride = bs_rows.stride(0) if bs_rows.shape[0] > 1 else 0
        params.bs_n_qblocks, params.bs_n_kblocks = bs_rows.shape[1], bs_rows.shape[2] - 1
    if bs_cols is not None:  # (mask heads, n_kblocks, n_qblocks + 1)
        params.bs_cols_head_stride = bs_cols.stride(0) if bs_cols.shape[0] > 1 else 0
        params.bs_n_kblocks, params.bs_n_qblocks = bs_cols.shape[1], bs_cols.shape[2] - 1
    if mask is not None:  # the expression's tensors' sizes / strides, the packed states' layout (mask_mod.pack_states)
        for i, tensor in enumerate(mask.tensors.values()):
            for dim in range(tensor.dim()):
                params.mm.size[i][dim], params.mm.stride[i][dim] = tensor.shape[dim], tensor.stride(dim)
        params.mm_states_b_stride = mm_states.stride(0) if mm_states.shape[0] > 1 else 0
        params.mm_states_h_stride = mm_states.stride(1) if mm_states.shape[1] > 1 else 0
        params.mm_n_qblocks = math.ceil(params.seqlen_q / build.BLOCK_SPARSE_SIZE)
        params.mm_n_kblocks = state_row_bytes(math.ceil(params.seqlen_k / build.BLOCK_SPARSE_SIZE))
    return params


def _mask_addresses(params_type: type, prefix: str, first_input: int, n_tensors: int) -> list:
    """(offset, _INPUT, index, 0) of the mask's states, error word and tensor pointers (inputs first_input, +1,
    +2 ...)."""
    out = [(_offset(params_type, prefix + "mm_states"), _INPUT, first_input, 0),
           (_offset(params_type, prefix + "mm.error"), _INPUT, first_input + 1, 0)]
    ptr = _offset(params_type, prefix + "mm.ptr")
    return out + [(ptr + 8 * i, _INPUT, first_input + 2 + i, 0) for i in range(n_tensors)]
