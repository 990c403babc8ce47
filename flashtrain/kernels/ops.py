"""The CUDA FlashAttention-2 kernels (csrc/) as torch custom ops, in one place.

    flashtrain::flash_attn_fwd   (q, k, v, ...) -> (out, lse)
    flashtrain::flash_attn_bwd   (dout, q, k, v, out, lse, ...) -> (dq, dk, dv)

both registered with torch.library.custom_op, with fake implementations (torch.compile traces them without running
them) and autograd (fwd's backward calls bwd). One pair of ops serves both layouts: batch form q (batch, seqlen_q,
nheads, head_dim) when cu_seqlens_q is None, packed (varlen) form q (total_q, nheads, head_dim) otherwise.

flash_attn_cuda and unavailable_reason are the hook that flashtrain.kernels.interface calls (validation of the
user's arguments happens there; this module checks only what it relies on to launch safely).

Dropout: flash_attn_cuda draws rng_state = (seed, offset), two int64 on the GPU, from the caller's generator; the
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
import functools
import math
import struct
import warnings

import torch
from torch import Tensor

from flashtrain.kernels import build, tma

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
    if head_dim % 8 != 0 or not 8 <= head_dim <= build.HEAD_DIMS[-1]:
        return f"the CUDA kernels need head_dim a multiple of 8 in [8, {build.HEAD_DIMS[-1]}], got {head_dim}"
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
    return compiler_reason


def unavailable_reason(device: torch.device, *, head_dim: int, dtype: torch.dtype, block_mask: bool) -> str | None:
    """None when the CUDA kernels can run these arguments, else a sentence saying why not."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    return _unavailable_reason(device.type, index, head_dim, str(dtype), bool(block_mask))


def flash_attn_cuda(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                    generator: torch.Generator | None, deterministic: bool = False,
                    block_mask: Tensor | None = None, validated: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of the CUDA kernel, differentiable w.r.t. q, k, v. Arguments as in flash_attn_(varlen_)func after
    validation; cu_seqlens None selects the batch form. deterministic=True makes the backward's dq bitwise
    reproducible (each CTA accumulates into its own dq buffer, summed in a fixed order) at some speed cost.
    block_mask: bool ([nheads,] ceil(max_seqlen_q / 128), ceil(max_seqlen_k / 128)) on q's device, or None.
    validated=True: the caller (flashtrain.kernels.interface) has checked the arguments and unavailable_reason."""
    if not validated:
        reason = unavailable_reason(q.device, head_dim=q.shape[-1], dtype=q.dtype, block_mask=block_mask is not None)
        if reason is not None:
            raise RuntimeError(f"the CUDA attention kernel cannot run: {reason}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got {x.stride(-1)}")
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is not None:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    bs_rows = bs_cols = None
    if block_mask is not None:
        blocks = (math.ceil(max_seqlen_q / build.BLOCK_SPARSE_SIZE), math.ceil(max_seqlen_k / build.BLOCK_SPARSE_SIZE))
        if block_mask.dtype != torch.bool or tuple(block_mask.shape) not in (blocks, (q.shape[-2], *blocks)):
            raise ValueError(f"block_mask must be bool ([{q.shape[-2]},] {blocks[0]}, {blocks[1]}), got "
                             f"{block_mask.dtype} {tuple(block_mask.shape)}")
        bs_rows, bs_cols = block_sparse_lists(block_mask)
    rng_state = _draw_rng_state(q.device, generator) if dropout_p > 0 else None
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(dropout_p),
            float(softmax_scale), bool(causal), rng_state, bool(deterministic), bs_rows, bs_cols)
    if torch.compiler.is_compiling():
        return flash_attn_fwd(*args)
    if torch._C._are_functorch_transforms_active():  # vmap / grad transforms: the full autograd.Function.apply
        return _EagerFlashAttn.apply(*args)
    return _apply_eager(*args)


def block_sparse_lists(block_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels' index lists of a bool block_mask ([mask heads,] n_qblocks, n_kblocks), built on its device
    without a host sync: bs_rows int32 (mask heads, n_qblocks, n_kblocks + 1) = per query block the number c of its
    non-zero key blocks, then (in entries 1..c) those key blocks ascending; bs_cols int32 (mask heads, n_kblocks,
    n_qblocks + 1) the same per key block. mask heads = 1 for a 2-D mask."""
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
# A call's launch parameters depend on its tensors' addresses and on everything else about it (shapes, strides,
# dtype, options, the kernel chosen). The second part is a "plan", built once per call signature and kept: a call
# then costs a dictionary lookup, a copy of the plan's parameter struct and the addresses written into it
# (benchmarks/host_overhead.py). The first fields of FwdParams are the eight addresses q, k, v, out, lse,
# cu_seqlens_q, cu_seqlens_k, rng_state; those of AuxParams the nine out, dout, dq, softmax_d, dq_accum,
# dropout_mask, cu_seqlens_q, cu_seqlens_k, rng_state; BwdParams continues after its FwdParams with dout, dk, dv,
# dq_accum, softmax_d.
_ADDRESSES = {n: struct.Struct(f"={n}Q") for n in (1, 5, 8, 9)}
_MAX_PLANS = 1024  # per direction; a process that sees more distinct call signatures rebuilds plans (correct, slower)


class _FwdPlan:
    __slots__ = ("kernel", "grid", "template", "fwd_offset", "bs_offset", "tma_layouts")


class _BwdPlan:
    __slots__ = ("kernel", "grid", "template", "fwd_offset", "bs_offset", "tma_layouts", "aux", "aux_grid",
                 "preprocess", "convert", "d_floats", "dqa_shape", "semaphore_shape", "semaphore_offset")


_fwd_plans: dict[tuple, _FwdPlan] = {}
_bwd_plans: dict[tuple, _BwdPlan] = {}


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


_TMA_BYTES = ctypes.sizeof(tma.TmaDesc)


def _write_tensor_maps(params: ctypes.Structure, tensors, layouts) -> None:
    """The TMA tensor maps of `tensors` (tma.layout()s `layouts`) into the first 128-byte slots of a Sm90 params
    struct."""
    base = ctypes.addressof(params)
    for slot, (x, layout) in enumerate(zip(tensors, layouts)):
        ctypes.memmove(base + slot * _TMA_BYTES, ctypes.addressof(tma.tensor_map(x.data_ptr(), layout)), _TMA_BYTES)


def _aligned_addresses(*tensors: Tensor) -> bool:
    """Every address 16-byte aligned (the strides' part of _aligned is in the plan's signature)."""
    address = 0
    for x in tensors:
        address |= x.data_ptr()
    return address % 16 == 0


def _fwd_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
              causal, bs_rows) -> _FwdPlan:
    from flashtrain.kernels import launch

    block_sparse = bs_rows is not None
    arch = launch.device_arch(q.device)
    head_dim = build.rounded_head_dim(q.shape[-1], block_sparse, arch)
    spec = build.fwd_kernel(head_dim, _DTYPE_NAMES[q.dtype], causal, dropout_p > 0, block_sparse, arch=arch,
                            smem_limit=launch.device_smem_limit(q.device))
    params = _fwd_params(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, None, bs_rows=bs_rows)
    plan = _FwdPlan()
    plan.grid = (math.ceil(params.seqlen_q / spec.block_m), params.batch, params.nheads)
    if spec.persistent:  # at most one CTA per SM, each taking tiles from the dynamic scheduler
        plan.grid = (min(math.prod(plan.grid), launch.sm_count(q.device)), 1, 1)
    plan.kernel = launch.get_kernel(spec, spec.symbols[0], q.device)
    varlen, plan.tma_layouts, plan.fwd_offset = cu_seqlens_q is not None, None, 0
    if spec.source == "flash_fwd_sm90.cu":  # the TMA kernel: tensor maps of q, k, v, then the same parameters
        plan.tma_layouts = tuple(tma.layout(x, varlen, rows)
                                 for x, rows in ((q, spec.tiles.block_m), (k, spec.tiles.block_n), (v, spec.tiles.block_n)))
        params = launch.FwdSm90Params(fwd=params)
        plan.fwd_offset = launch.FwdSm90Params.fwd.offset
    plan.bs_offset = plan.fwd_offset + launch.FwdParams.bs_rows.offset
    plan.template = params
    return plan


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
              max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
              rng_state: Tensor | None, bs_rows: Tensor | None) -> tuple[Tensor, Tensor]:
    launch = _launch or _load_launch()

    options = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               None if bs_rows is None else (bs_rows.shape, bs_rows.stride()))
    plan = _fwd_plans.get(_signature(q, k, v, cu_seqlens_q, *options))
    if plan is None or not _aligned_addresses(q, k, v):  # plans exist for aligned layouts only
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
        key = _signature(q, k, v, cu_seqlens_q, *options)
        plan = _fwd_plans.get(key)
    out, lse = _empty_outputs(q, cu_seqlens_q)
    if plan is None:
        plan = _remember(_fwd_plans, key, _fwd_plan(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, dropout_p, softmax_scale, causal, bs_rows))
    stream = launch.stream_of(q.device)
    params = type(plan.template).from_buffer_copy(plan.template)
    _ADDRESSES[8].pack_into(params, plan.fwd_offset, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                            lse.data_ptr(), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(rng_state))
    if bs_rows is not None:
        _ADDRESSES[1].pack_into(params, plan.bs_offset, bs_rows.data_ptr())
    if plan.tma_layouts is not None:
        _write_tensor_maps(params, (q, k, v), plan.tma_layouts)
        params.tile_counter = launch.tile_counter(plan.kernel, q.device, stream)
    plan.kernel.launch_on(plan.grid, params, stream)
    return out, lse


@torch.library.custom_op("flashtrain::flash_attn_fwd", mutates_args=(), device_types="cuda")
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                   max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                   rng_state: Tensor | None, deterministic: bool, bs_rows: Tensor | None = None,
                   bs_cols: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                     rng_state, bs_rows)


@flash_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, rng_state,
      deterministic, bs_rows=None, bs_cols=None):
    return _empty_outputs(q, cu_seqlens_q)


def _bwd_plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
              softmax_scale, causal, deterministic, bs_cols) -> _BwdPlan:
    from flashtrain.kernels import launch

    dq = q.new_empty(q.shape, device="meta")
    dk, dv = k.new_empty(k.shape, device="meta"), v.new_empty(v.shape, device="meta")
    block_sparse = bs_cols is not None
    arch = launch.device_arch(q.device)
    head_dim = build.rounded_head_dim(q.shape[-1], block_sparse, arch)
    spec = build.bwd_kernel(head_dim, _DTYPE_NAMES[q.dtype], causal, dropout_p > 0, block_sparse, arch=arch,
                            deterministic=deterministic, smem_limit=launch.device_smem_limit(q.device))
    tiles = spec.tiles
    fwd = _fwd_params(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                      softmax_scale, None, bs_cols=bs_cols)
    batch, nheads, nheads_kv = fwd.batch, fwd.nheads, fwd.nheads_kv
    n_kblocks = math.ceil(fwd.seqlen_k / tiles.block_n)
    nsplits = 1
    hopper = spec.source == "flash_bwd_sm90.cu"
    if deterministic and not hopper:  # enough CTAs to fill the GPU twice over; each walks key blocks x, x + nsplits..
        sm_count = launch.sm_count(q.device)
        nsplits = max(1, min(n_kblocks, math.ceil(2 * sm_count / max(1, batch * nheads_kv))))
    # the Hopper backward's dq_accum rows are its instantiated head dim (a padded head dim adds whole 16-row slices too)
    dqa_cols = head_dim if hopper else q.shape[-1]
    plan = _BwdPlan()
    # softmax_d (lse's layout) and dq_accum share one float32 workspace; dq_accum starts 128-byte aligned
    d_extent = 1 + sum((size - 1) * stride for size, stride in zip(lse.shape, lse.stride()))
    plan.d_floats, plan.dqa_shape = -(-d_extent // 32) * 32, (nsplits, *lse.shape, dqa_cols)
    dq_accum = torch.empty(plan.dqa_shape, dtype=torch.float32, device="meta")
    varlen = cu_seqlens_q is not None
    dqa_strides = (dq_accum.stride(0), 0, dq_accum.stride(1)) if varlen else dq_accum.stride()[:3]
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))

    aux_spec = build.aux_kernels(_DTYPE_NAMES[q.dtype])
    aux = launch.AuxParams(
        d_batch_stride=lse_strides[0], d_head_stride=lse_strides[1], dqa_split_stride=dqa_strides[0],
        dqa_batch_stride=dqa_strides[1], dqa_head_stride=dqa_strides[2], batch=batch, nheads=nheads,
        head_dim=q.shape[-1], seqlen_q=fwd.seqlen_q, seqlen_k=fwd.seqlen_k, nsplits=nsplits,
        softmax_scale=softmax_scale, dq_block_m=tiles.block_m, total_q=fwd.total_q, total_k=fwd.total_k,
        dqa_cols=dqa_cols,
        # the backward adds whole blocks in a scrambled order unless deterministic or head_dim is padded (mma.sync)
        dq_slice_width=(tiles.dq_slice_width(head_dim)
                        if tiles.scramble_dq and (hopper or not deterministic) and dqa_cols == head_dim else 0))
    (aux.o_batch_stride, aux.o_row_stride, aux.o_head_stride) = _strides(out, varlen)
    (aux.do_batch_stride, aux.do_row_stride, aux.do_head_stride) = _strides(dout, varlen)
    (aux.dq_batch_stride, aux.dq_row_stride, aux.dq_head_stride) = _strides(dq, varlen)
    plan.aux, plan.aux_grid = aux, (math.ceil(fwd.seqlen_q / build.AUX_ROWS_PER_CTA), batch, nheads)
    plan.preprocess = launch.get_kernel(aux_spec, aux_spec.symbols[0], q.device)  # D, dq_accum = 0
    plan.convert = launch.get_kernel(aux_spec, aux_spec.symbols[1], q.device)  # dq = scale * sum of dq_accum

    params = launch.BwdParams(
        fwd=fwd, dqa_split_stride=dqa_strides[0], dqa_batch_stride=dqa_strides[1], dqa_head_stride=dqa_strides[2],
        deterministic=int(deterministic))
    (params.do_batch_stride, params.do_row_stride, params.do_head_stride) = _strides(dout, varlen)
    (params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride) = _strides(dk, varlen)
    (params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride) = _strides(dv, varlen)
    plan.grid = (nsplits if deterministic and not hopper else n_kblocks, batch, nheads_kv)
    if hopper:  # tiles (key block, batch, kv head) along x: at most one CTA per SM when persistent
        plan.grid = (math.prod(plan.grid), 1, 1)
        if tiles.persistent:
            plan.grid = (min(plan.grid[0], launch.sm_count(q.device)), 1, 1)
    plan.semaphore_shape = None
    if deterministic and hopper:  # per (batch, head, query block): MMA warps of lower key blocks done adding dQ
        params.dq_sem_mblocks = math.ceil(fwd.seqlen_q / tiles.block_m)
        plan.semaphore_shape = (batch, nheads, params.dq_sem_mblocks)
    plan.tma_layouts, plan.fwd_offset = None, 0
    if hopper:  # the TMA kernel: tensor maps of q, k, v, dout, then the same parameters
        plan.tma_layouts = tuple(tma.layout(x, varlen, rows) for x, rows in (
            (q, tiles.block_m), (k, tiles.block_n), (v, tiles.block_n), (dout, tiles.block_m)))
        params = launch.BwdSm90Params(bwd=params)
        plan.fwd_offset = launch.BwdSm90Params.bwd.offset
    plan.bs_offset = plan.fwd_offset + launch.FwdParams.bs_cols.offset
    plan.semaphore_offset = plan.fwd_offset + launch.BwdParams.dq_semaphore.offset
    plan.template, plan.kernel = params, launch.get_kernel(spec, spec.symbols[0], q.device)
    return plan


def _bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
              dropout_p: float, softmax_scale: float, causal: bool, rng_state: Tensor | None,
              deterministic: bool, bs_cols: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    launch = _launch or _load_launch()

    options = (lse.shape, lse.stride(), max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, deterministic,
               None if bs_cols is None else (bs_cols.shape, bs_cols.stride()))
    plan = _bwd_plans.get(_signature(q, k, v, cu_seqlens_q, dout.stride(), out.stride(), *options))
    if plan is None or not _aligned_addresses(dout, q, k, v, out):  # plans exist for aligned layouts only
        dout, q, k, v, out = (_aligned(x) for x in (dout, q, k, v, out))
        key = _signature(q, k, v, cu_seqlens_q, dout.stride(), out.stride(), *options)
        plan = _bwd_plans.get(key) or _remember(_bwd_plans, key, _bwd_plan(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, deterministic, bs_cols))
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous
    workspace = torch.empty(plan.d_floats + math.prod(plan.dqa_shape), dtype=torch.float32, device=q.device)
    softmax_d, dq_accum = workspace.data_ptr(), workspace.data_ptr() + 4 * plan.d_floats
    stream = launch.stream_of(q.device)

    aux = launch.AuxParams.from_buffer_copy(plan.aux)
    _ADDRESSES[9].pack_into(aux, 0, out.data_ptr(), dout.data_ptr(), dq.data_ptr(), softmax_d, dq_accum, 0,
                            _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(rng_state))
    plan.preprocess.launch_on(plan.aux_grid, aux, stream)

    params = type(plan.template).from_buffer_copy(plan.template)
    offset = plan.fwd_offset
    _ADDRESSES[8].pack_into(params, offset, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                            _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(rng_state))
    _ADDRESSES[5].pack_into(params, offset + launch.BwdParams.dout.offset, dout.data_ptr(), dk.data_ptr(), dv.data_ptr(), dq_accum,
                            softmax_d)
    if bs_cols is not None:
        _ADDRESSES[1].pack_into(params, plan.bs_offset, bs_cols.data_ptr())
    if plan.semaphore_shape is not None:
        semaphore = torch.zeros(plan.semaphore_shape, dtype=torch.int32, device=q.device)
        _ADDRESSES[1].pack_into(params, plan.semaphore_offset, semaphore.data_ptr())
    if plan.tma_layouts is not None:
        _write_tensor_maps(params, (q, k, v, dout), plan.tma_layouts)
        params.tile_counter = launch.tile_counter(plan.kernel, q.device, stream)
    plan.kernel.launch_on(plan.grid, params, stream)

    plan.convert.launch_on(plan.aux_grid, aux, stream)
    return dq, dk, dv


@torch.library.custom_op("flashtrain::flash_attn_bwd", mutates_args=(), device_types="cuda")
def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                   dropout_p: float, softmax_scale: float, causal: bool, rng_state: Tensor | None,
                   deterministic: bool, bs_cols: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     softmax_scale, causal, rng_state, deterministic, bs_cols)


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      causal, rng_state, deterministic, bs_cols=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, causal, rng_state, det,
     _bs_rows, bs_cols) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, bs_cols)
    ctx.options = (max_seqlen_q, max_seqlen_k, dropout_p, scale, causal)
    ctx.deterministic = det
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor, bwd=flash_attn_bwd):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, bs_cols = ctx.saved_tensors
    if dout is None:  # only lse was used, and lse carries no gradient
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, rng_state, ctx.deterministic,
                     bs_cols)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerFlashAttn(torch.autograd.Function):
    """The same forward and backward as the custom ops, called directly: in eager mode the custom-op dispatch costs
    ~200 us of host time per call (H100 host, torch 2.11), which is more than the GPU time of a small attention call.
    torch.compile traces the custom ops instead (flash_attn_cuda picks)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                rng_state, deterministic, bs_rows, bs_cols):
        inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  rng_state, deterministic, bs_rows, bs_cols)
        output = _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal, rng_state, bs_rows)
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # lse's gradient stays None (no zero tensor per call)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse, bwd=_bwd_impl)


# autograd.Function.apply's C++ part: Function.apply adds argument binding and functorch unwrapping (a few us per
# call), needed only under functorch transforms (flash_attn_cuda checks)
_apply_eager = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerFlashAttn)


# ---------------------------------------------------------------------------------------------------- helpers
def _empty_outputs(q: Tensor, cu_seqlens_q: Tensor | None) -> tuple[Tensor, Tensor]:
    """out like q (contiguous), lse float32 (batch, nheads, seqlen_q) or varlen (nheads, total_q)."""
    out = q.new_empty(q.shape)
    if cu_seqlens_q is None:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


def _aligned(x: Tensor) -> Tensor:
    """x itself when the kernels' 16-byte loads of its rows are aligned (pointer and every stride) and no dimension
    is broadcast (stride 0, which TMA tensor maps cannot express), else a copy."""
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


def _fwd_params(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                rng_state, bs_rows=None, bs_cols=None):
    """FwdParams of the call; bs_rows (forward) / bs_cols (backward): the block-sparse lists, or None."""
    from flashtrain.kernels import launch

    varlen = cu_seqlens_q is not None
    params = launch.FwdParams(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr(),
        cu_seqlens_q=_ptr(cu_seqlens_q), cu_seqlens_k=_ptr(cu_seqlens_k), rng_state=_ptr(rng_state),
        lse_batch_stride=0 if varlen else lse.stride(0), lse_head_stride=lse.stride(0) if varlen else lse.stride(1),
        batch=cu_seqlens_q.numel() - 1 if varlen else q.shape[0], nheads=q.shape[-2], nheads_kv=k.shape[-2],
        head_dim=q.shape[-1], seqlen_q=max_seqlen_q if varlen else q.shape[1],
        seqlen_k=max_seqlen_k if varlen else k.shape[1], softmax_scale=softmax_scale,
        softmax_scale_log2=softmax_scale * math.log2(math.e), keep_threshold=_keep_threshold(dropout_p),
        rp_dropout=1.0 / (1.0 - dropout_p), total_q=q.shape[0] if varlen else 0, total_k=k.shape[0] if varlen else 0)
    (params.q_batch_stride, params.q_row_stride, params.q_head_stride) = _strides(q, varlen)
    (params.k_batch_stride, params.k_row_stride, params.k_head_stride) = _strides(k, varlen)
    (params.v_batch_stride, params.v_row_stride, params.v_head_stride) = _strides(v, varlen)
    (params.o_batch_stride, params.o_row_stride, params.o_head_stride) = _strides(out, varlen)
    if bs_rows is not None:  # (mask heads, n_qblocks, n_kblocks + 1); head stride 0 for one shared mask
        params.bs_rows = bs_rows.data_ptr()
        params.bs_rows_head_stride = bs_rows.stride(0) if bs_rows.shape[0] > 1 else 0
        params.bs_n_qblocks, params.bs_n_kblocks = bs_rows.shape[1], bs_rows.shape[2] - 1
    if bs_cols is not None:  # (mask heads, n_kblocks, n_qblocks + 1)
        params.bs_cols = bs_cols.data_ptr()
        params.bs_cols_head_stride = bs_cols.stride(0) if bs_cols.shape[0] > 1 else 0
        params.bs_n_kblocks, params.bs_n_qblocks = bs_cols.shape[1], bs_cols.shape[2] - 1
    return params
