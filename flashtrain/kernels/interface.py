"""Public attention functions: validate every argument, then run the CUDA kernel or the plain-PyTorch reference.

impl="reference" runs flashtrain.kernels.reference; impl="cuda" runs the kernel of flashtrain.kernels.ops or raises
RuntimeError saying why it cannot; impl="auto" runs the reference on CPU tensors and, on CUDA tensors, the kernel when
it can run, else the reference with a one-time warning naming the reason. The reference works on the packed (varlen)
layout only; the batch form is adapted to it here.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from flashtrain.kernels.mask_mod import MaskMod
from flashtrain.kernels.reference import BLOCK_SPARSE_SIZE, flash_attn_reference

if TYPE_CHECKING:  # PEP 692's typed **kwargs; only type checkers read the annotation
    from typing_extensions import Unpack

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 512  # the reference; the CUDA kernels: up to build.HEAD_DIMS[-1] (ops.unavailable_reason)
IMPLS = ("auto", "cuda", "reference")
_warned_fallback_reasons: set[str] = set()


class AttentionOptions(TypedDict, total=False):
    """The keyword-only options of flash_attn_func and flash_attn_varlen_func (their `**options`), documented in
    flash_attn_func; each may be left out (OPTION_DEFAULTS). Beyond them both functions take flash-attn's positional
    dropout_p, softmax_scale and causal."""

    block_mask: Tensor | None
    return_lse: bool
    dropout_mask: Tensor | None
    generator: torch.Generator | None
    deterministic: bool
    impl: str
    window_size: tuple[int, int]
    softcap: float
    alibi_slopes: Tensor | None
    mask_mod: MaskMod | str | None


OPTION_DEFAULTS: AttentionOptions = {"block_mask": None, "return_lse": False, "dropout_mask": None, "generator": None,
                                     "deterministic": False, "impl": "auto", "window_size": (-1, -1), "softcap": 0.0,
                                     "alibi_slopes": None, "mask_mod": None}


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **options: Unpack[AttentionOptions],
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention softmax(q k^T * softmax_scale) v, computed tile by tile (FlashAttention).

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16 / bfloat16 (float32 / float64 on the reference only);
            the last dimension must be contiguous (stride 1). head_dim <= 512 (the CUDA kernels too;
            head dims 257-512 need Hopper's shared memory: an A100 refuses them by name).
        k, v: (batch, seqlen_k, nheads_kv, head_dim), same dtype and device as q. nheads must be a multiple of
            nheads_kv (GQA; nheads_kv == 1 is MQA): query head h attends with kv head h // (nheads // nheads_kv).
        dropout_p: probability of dropping each attention probability (training only; pass 0.0 in eval). Kept
            probabilities are scaled by 1 / (1 - dropout_p).
        softmax_scale: multiplies q k^T before the softmax; default 1 / sqrt(head_dim).
        causal: causal mask aligned to the bottom-right corner of the (seqlen_q, seqlen_k) score matrix, as in
            FlashAttention >= 2.1: query i sees key j iff j <= i + seqlen_k - seqlen_q. With seqlen_q == seqlen_k
            this is the usual lower triangle; with seqlen_q > seqlen_k the first seqlen_q - seqlen_k queries see
            no key, and their output is 0 (lse -inf, zero gradients).

    Keyword-only options (**options, AttentionOptions; flash_attn_varlen_func takes the same):
        block_mask: optional bool ([nheads,] ceil(seqlen_q / 128), ceil(seqlen_k / 128)); block (i, j) covers
            queries [128 i, 128 i + 128) and keys [128 j, 128 j + 128); False skips the block (its scores are
            never computed). Combined with causal by AND. A query that sees no key outputs 0. The CUDA kernels
            walk only the non-zero blocks (work proportional to their number; head_dim <= 128);
            flashtrain.kernels.block_sparse builds common layouts.
        return_lse: also return the log-sum-exp of each query's scaled scores, float32 (batch, nheads, seqlen_q).
            It is differentiable (a loss on it, a z-loss or a merge of partial results, reaches q and k: its
            gradient enters the backward as dS += P * dlse); rows that see no key (lse -inf) pass none.
        dropout_mask: optional explicit bool keep-mask (batch, nheads, seqlen_q, seqlen_k), True = keep (tests;
            runs on the reference). Without it the mask is drawn from `generator` and regenerated in backward.
        generator: torch.Generator for the dropout mask (default: the device's default generator).
        deterministic: the CUDA backward gives bitwise-identical dq, dk, dv from run to run (each CTA sums dq into
            its own buffer, the buffers are added in a fixed order; no atomics), at some speed cost. The forward is
            deterministic either way, and so is the reference.
        impl: "auto" (CPU tensors: the plain-PyTorch reference; CUDA tensors: the CUDA kernel, or the reference with
            a one-time warning saying why when the kernel cannot run this call), "cuda" (the kernel or a
            RuntimeError saying why not; never a fallback) or "reference".
        window_size: (left, right) local attention, flash-attn's definition: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 = unbounded on that side
            (default (-1, -1): none). With causal, right must be -1 or 0 (causal is right = 0). Tiles outside every
            query's window are skipped.
        softcap: > 0 caps the scaled scores s at +-softcap smoothly, s -> softcap * tanh(s / softcap), before the
            softmax (Gemma 2, Grok); 0 (default) = none.
        alibi_slopes: float32 (nheads,) or (batch, nheads) (varlen: one row per sequence): ALiBi, adds
            -slope * |i + seqlen_k - seqlen_q - j| to the scaled (and capped) scores.
        mask_mod: a mask expression (flashtrain.kernels.mask_mod.MaskMod, or its C expression as a str when it reads
            no tensor): query q_idx of sequence b, head h attends key kv_idx where the expression is nonzero, on top
            of causal / window_size / block_mask; e.g. MaskMod("doc[q_idx] == doc[kv_idx]", doc=ids). Tiles where it
            is 0 for every pair are skipped (evaluated exactly). q_idx / kv_idx count from each sequence's start.
        window_size, softcap, alibi_slopes and mask_mod run on the CUDA kernels without dropout and block_mask
        (mask_mod: the expression compiled into the kernels, the warpgroup-MMA ones on Hopper at head dims 64 / 128;
        its block states computed on the GPU and cached on the MaskMod while its tensors are unmodified).

    Returns:
        out (batch, seqlen_q, nheads, head_dim) in q's dtype, or (out, lse) with return_lse=True. Any of batch,
        seqlen_q, seqlen_k and nheads may be 0: with seqlen_k 0 every query sees no key (out 0, lse -inf, zero
        gradients); a call with nothing to compute launches no kernel.
    """
    options = _check_options("flash_attn_func", options)
    block_mask, dropout_mask, generator = options["block_mask"], options["dropout_mask"], options["generator"]
    _check_qkv(q, k, v, rank=4, layout="(batch, seqlen, nheads, head_dim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch size {k.shape[0]} differs from q's {q.shape[0]}")
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    dropout_p, softmax_scale = _check_scalars(dropout_p, softmax_scale, causal, head_dim)
    _check_block_mask(block_mask, q, nheads, seqlen_q, seqlen_k)
    _check_dropout_mask(dropout_mask, q, dropout_p, (batch, nheads, seqlen_q, seqlen_k))
    features = _check_features(options, q, nheads, batch, causal)

    ops = _cuda_ops_to_use(options["impl"], q, block_mask, dropout_mask, features, dropout_p)
    if ops is not None:
        out, lse = ops.flash_attn_cuda(
            q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, generator=generator,
            block_mask=block_mask, deterministic=options["deterministic"], validated=True, **(features or {}),
        )
    else:  # batch form -> packed form with one sequence per batch entry
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
        cu_seqlens_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_k
        if dropout_mask is not None:  # (batch, nheads, seqlen_q, seqlen_k) -> (nheads, batch * seqlen_q, seqlen_k)
            dropout_mask = dropout_mask.transpose(0, 1).reshape(nheads, batch * seqlen_q, seqlen_k)
        out, lse = flash_attn_reference(
            q.reshape(batch * seqlen_q, nheads, head_dim),
            k.reshape(batch * seqlen_k, k.shape[2], head_dim),
            v.reshape(batch * seqlen_k, k.shape[2], head_dim),
            cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal, block_mask=block_mask,
            dropout_p=dropout_p, dropout_mask=dropout_mask, generator=generator, **(features or {}),
        )
        out = out.view(batch, seqlen_q, nheads, head_dim)
        lse = lse.view(nheads, batch, seqlen_q).transpose(0, 1).contiguous()  # (batch, nheads, seqlen_q)
    return (out, lse) if options["return_lse"] else out


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    **options: Unpack[AttentionOptions],
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed variable-length sequences (how padding is handled without wasted work).

    q (total_q, nheads, head_dim), k/v (total_k, nheads_kv, head_dim); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k/v (cu_seqlens: int32,
    length batch + 1, starting at 0, non-decreasing, last == total). max_seqlen_q/k bound every sequence's length.
    Sequences never attend to each other; causal is bottom-right aligned per sequence. Every other argument is as in
    flash_attn_func.

    Returns out (total_q, nheads, head_dim), and with return_lse=True also lse (nheads, total_q). block_mask:
    ([nheads,] ceil(max_seqlen_q / 128), ceil(max_seqlen_k / 128)), blocks counted from the start of each sequence.
    dropout_mask: (nheads, total_q, max_seqlen_k), column j of a row is key j of that row's sequence.

    Empty inputs: sequences without queries or keys, zero sequences, zero rows and max_seqlen 0 are valid. A query
    that sees no key (its sequence has none) gets out 0 and lse -inf and passes no gradient; a call with nothing to
    compute launches no kernel.

    Bad offsets. CPU cu_seqlens are checked here at once (ValueError naming the argument and the sequence). CUDA
    cu_seqlens are checked without a host sync, by a device-side assert: offsets past the packed rows, a sequence
    longer than max_seqlen_q / max_seqlen_k, a first offset other than 0 or decreasing offsets stop the process at
    its next synchronisation with "CUDA error: device-side assert triggered", and the assert leaves the CUDA context
    unusable: every later CUDA call in that process fails (the kernels still never read outside q, k, v). Offsets
    built on the host are best checked there, before the copy to the GPU, with check_cu_seqlens (the data pipelines
    do).
    """
    options = _check_options("flash_attn_varlen_func", options)
    block_mask, dropout_mask, generator = options["block_mask"], options["dropout_mask"], options["generator"]
    _check_qkv(q, k, v, rank=3, layout="(total, nheads, head_dim)")
    nheads, head_dim = q.shape[1], q.shape[2]
    max_seqlen_q, max_seqlen_k = _number(max_seqlen_q, integral=True), _number(max_seqlen_k, integral=True)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    dropout_p, softmax_scale = _check_scalars(dropout_p, softmax_scale, causal, head_dim)
    _check_block_mask(block_mask, q, nheads, max_seqlen_q, max_seqlen_k)
    _check_dropout_mask(dropout_mask, q, dropout_p, (nheads, q.shape[0], max_seqlen_k))
    features = _check_features(options, q, nheads, cu_seqlens_q.shape[0] - 1, causal)

    ops = _cuda_ops_to_use(options["impl"], q, block_mask, dropout_mask, features, dropout_p)
    if ops is not None:
        out, lse = ops.flash_attn_cuda(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            generator=generator, block_mask=block_mask, deterministic=options["deterministic"], validated=True,
            **(features or {}),
        )
    else:
        out, lse = flash_attn_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=causal, block_mask=block_mask,
            dropout_p=dropout_p, dropout_mask=dropout_mask, generator=generator, **(features or {}),
        )
    return (out, lse) if options["return_lse"] else out


# ---- dispatch ----------------------------------------------------------------------------------------------------


# the options of flash_attn_func beyond plain attention that the CUDA kernels run (the attention features window_size,
# softcap, alibi_slopes and mask_mod, added as the kernels gained them); the others run on impl="reference" only
CUDA_FEATURES: frozenset[str] = frozenset({"window_size", "softcap", "alibi_slopes", "mask_mod"})  # build.SCORE_MODS
_SCORE_MODS = ("window_size", "softcap", "alibi_slopes", "mask_mod")


def features_unavailable_reason(features) -> str | None:
    """None when the CUDA kernels run every option named in `features` (window_size, softcap, alibi_slopes), else a
    sentence naming those they lack."""
    missing = [name for name in features if name not in CUDA_FEATURES]
    if not missing:
        return None
    return f"{' / '.join(missing)} run on impl='reference' only (the CUDA kernels do not have them yet)"


def _cuda_ops_or_reason(q: Tensor, block_mask: Tensor | None, dropout_mask: Tensor | None, features=None,
                        dropout_p: float = 0.0):
    """(ops module, None) when the CUDA kernel can run these arguments, else (None, why not)."""
    if q.device.type != "cuda":
        return None, f"the tensors are on {q.device}; the CUDA kernel needs CUDA tensors"
    if dropout_mask is not None:
        return None, "an explicit dropout_mask is supported by impl='reference' only"
    reason = features_unavailable_reason(features or ())
    if reason is not None:
        return None, reason
    score_mods = [name for name in _SCORE_MODS if name in (features or ())]
    if score_mods and (dropout_p > 0 or block_mask is not None):
        return None, (f"{' / '.join(score_mods)} with {'dropout' if dropout_p > 0 else 'a block_mask'} run on "
                      f"impl='reference' only (the CUDA kernels have them without)")
    from flashtrain.kernels import ops  # imported here: CPU-only calls never load the kernel side
    reason = ops.unavailable_reason(q.device, head_dim=q.shape[-1], dtype=q.dtype, block_mask=block_mask is not None)
    return (None, reason) if reason is not None else (ops, None)


def _cuda_ops_to_use(impl: str, q: Tensor, block_mask: Tensor | None, dropout_mask: Tensor | None, features=None,
                     dropout_p: float = 0.0):
    """The ops module when the CUDA kernel runs this call, None when the reference does."""
    if impl == "reference" or (impl == "auto" and q.device.type != "cuda"):
        return None
    ops, reason = _cuda_ops_or_reason(q, block_mask, dropout_mask, features, dropout_p)
    if ops is not None:
        return ops
    if impl == "cuda":
        raise RuntimeError(f"impl='cuda' cannot run: {reason}")
    if reason not in _warned_fallback_reasons:
        _warned_fallback_reasons.add(reason)
        warnings.warn(f"flash attention on CUDA tensors runs the slow reference: {reason}", stacklevel=3)
    return None


# ---- validation: every error names the argument -----------------------------------------------------------------


def _qkv_valid(q, k, v, rank: int) -> bool:
    """True when _check_qkv's checks all pass, tested in one expression (the per-call cost of a valid call)."""
    return (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and q.dtype in SUPPORTED_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and k.device == q.device and v.device == q.device
            and q.dim() == rank and k.dim() == rank and v.dim() == rank
            and (q.stride(-1) == 1 or q.shape[-1] <= 1) and (k.stride(-1) == 1 or k.shape[-1] <= 1)
            and (v.stride(-1) == 1 or v.shape[-1] <= 1) and 1 <= q.shape[-1] <= MAX_HEAD_DIM
            and k.shape[-1] == q.shape[-1] and v.shape == k.shape and k.shape[-2] != 0
            and q.shape[-2] % k.shape[-2] == 0)


def _check_qkv(q, k, v, *, rank: int, layout: str) -> None:
    if _qkv_valid(q, k, v, rank):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q.dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype is {x.dtype} but q.dtype is {q.dtype}; all three must be equal")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all three must be on one device")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(x.shape)}")
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), got {x.stride(-1)}")
    head_dim = q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[-1]) must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k: head_dim {k.shape[-1]} differs from q's {head_dim}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads_kv (k.shape[-2] = {nheads_kv}) must divide nheads (q.shape[-2] = {nheads}) for GQA/MQA"
        )


def _check_options(function: str, options: dict) -> AttentionOptions:
    """`options` (the **options of `function`) checked, with OPTION_DEFAULTS for those left out (returned as they
    are, not to be modified, when none is given)."""
    if not options:
        return OPTION_DEFAULTS
    for name in options:
        if name not in OPTION_DEFAULTS:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}; its options are dropout_p, "
                            f"softmax_scale, causal, {', '.join(OPTION_DEFAULTS)}")
    options = {**OPTION_DEFAULTS, **options}
    for name in ("return_lse", "deterministic"):
        if not isinstance(options[name], bool):
            raise TypeError(f"{name} must be a bool, got {type(options[name]).__name__}")
    generator = options["generator"]
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if options["impl"] not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {options['impl']!r}")
    return options


def _check_features(options: AttentionOptions, q: Tensor, nheads: int, batch: int, causal: bool) -> dict | None:
    """window_size, softcap, alibi_slopes checked; {name: value} of those set (alibi_slopes expanded to
    (batch, nheads)), None when none is (the common call)."""
    window, softcap, slopes = options["window_size"], options["softcap"], options["alibi_slopes"]
    mask_mod = options["mask_mod"]
    if window == (-1, -1) and softcap == 0.0 and slopes is None and mask_mod is None:
        return None
    features = {}
    if window != (-1, -1):
        if (not isinstance(window, (tuple, list)) or len(window) != 2
                or any(isinstance(x, bool) or not isinstance(_number(x, integral=True), int) for x in window)):
            raise TypeError(f"window_size must be a pair of ints (left, right), got {window!r}")
        left, right = (_number(x, integral=True) for x in window)
        if left < -1 or right < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {tuple(window)}")
        if causal and right not in (-1, 0):
            raise ValueError(f"window_size={tuple(window)} with causal=True: causal is right = 0, so right must be -1 "
                             f"or 0")
        if left >= 0 or (right >= 0 and not causal):  # (causal: right 0 is the diagonal, no window of its own)
            features["window_size"] = (left, right)
    softcap = _number(softcap)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0: none), got {softcap}")
    if softcap > 0:
        features["softcap"] = float(softcap)
    if slopes is not None:
        if not isinstance(slopes, Tensor):
            raise TypeError(f"alibi_slopes must be a float32 tensor, got {type(slopes).__name__}")
        if slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
        if slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {slopes.device}, q on {q.device}")
        if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}) (nheads, or batch x nheads), "
                             f"got {tuple(slopes.shape)}")
        features["alibi_slopes"] = slopes.expand(batch, nheads)
    if mask_mod is not None:
        if isinstance(mask_mod, str):
            mask_mod = MaskMod(mask_mod)
        if not isinstance(mask_mod, MaskMod):
            raise TypeError(f"mask_mod must be a MaskMod (flashtrain.kernels.mask_mod) or a str, got "
                            f"{type(mask_mod).__name__}")
        for name, tensor in mask_mod.tensors.items():
            if tensor.device != q.device:
                raise ValueError(f"mask_mod tensor {name!r} is on {tensor.device}, q on {q.device}")
        features["mask_mod"] = mask_mod
    return features or None


def _number(value, integral: bool = False):
    """A number given as any numeric type -- Python, numpy scalar, 0-d tensor (read with .item()) -- as a Python int
    or float; anything else (bools included) unchanged, for the callers' type checks to name."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        return value
    return int(value) if integral else float(value)


def _check_scalars(dropout_p, softmax_scale, causal, head_dim: int) -> tuple[float, float]:
    """Validates flash-attn's positional options; returns (dropout_p, the softmax scale to use) as Python floats."""
    if (type(dropout_p) is float and 0.0 <= dropout_p < 1.0 and type(causal) is bool  # the common call, checked
            and (softmax_scale is None or type(softmax_scale) is float and math.isfinite(softmax_scale))):
        return dropout_p, 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    dropout_p = _number(dropout_p)
    softmax_scale = _number(softmax_scale)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    elif not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return float(dropout_p), float(softmax_scale)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q: Tensor, k: Tensor) -> None:
    """Everything the host knows (types, shapes, devices) is checked here; the offsets themselves eagerly on CPU
    tensors, and on CUDA tensors by an asynchronous device assert (_assert_offsets_on_device): no host sync."""
    for name, max_seqlen in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"{name} must be an int, got {type(max_seqlen).__name__}")
        if max_seqlen < 0:
            raise ValueError(f"{name} must be >= 0, got {max_seqlen}")
    for name, cu_seqlens, total, max_name, max_seqlen in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k", max_seqlen_k),
    ):
        if not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {q.device}")
        check = _check_offsets_on_host if cu_seqlens.device.type == "cpu" else _assert_offsets_on_device
        check(name, cu_seqlens, total, max_name, max_seqlen)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(
            f"cu_seqlens_k has length {cu_seqlens_k.numel()} but cu_seqlens_q has {cu_seqlens_q.numel()}; both are "
            "batch + 1"
        )


def check_cu_seqlens(cu_seqlens, total: int, max_seqlen: int | None = None, *, name: str = "cu_seqlens",
                     max_name: str = "max_seqlen") -> None:
    """Raise ValueError, naming `name` and the offending sequence, unless `cu_seqlens` holds valid offsets of
    `total` packed rows for flash_attn_varlen_func: 1-D, batch + 1 integers, starting at 0, non-decreasing, ending at
    `total`, and, when max_seqlen is given, no sequence longer than max_seqlen (named `max_name` in the message).

    Call it where offsets are built on the host -- a CPU tensor, a list or tuple of ints, a numpy array -- before they
    go to the GPU. flash_attn_varlen_func checks CUDA cu_seqlens only with an asynchronous device-side assert (no host
    sync), which stops the process at the next synchronisation and leaves its CUDA context unusable: every later CUDA
    call of that process fails. A CUDA tensor is accepted too, at the cost of a copy that waits for the GPU. The data
    pipelines call it on the offsets they build (flashtrain.data.lm.collate_documents,
    flashtrain.models.padding.Unpadding.of); flash_attn_varlen_func calls it on CPU cu_seqlens."""
    for arg, value in (("total", total), (max_name, max_seqlen)):
        if value is None and arg != "total":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{arg} must be >= 0, got {value}")
    if not isinstance(cu_seqlens, Tensor):  # a list, tuple or numpy array
        cu_seqlens = torch.as_tensor(cu_seqlens) if len(cu_seqlens) else torch.zeros(0, dtype=torch.int64)
    if cu_seqlens.dtype == torch.bool or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise TypeError(f"{name} must hold integers, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D (batch + 1 offsets), got shape {tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.tolist()  # a CPU tensor: no device sync
    if not offsets:
        raise ValueError(f"{name} must hold batch + 1 >= 1 offsets, got none")
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {offsets[0]}")
    lengths = [end - start for start, end in zip(offsets, offsets[1:])]
    if min(lengths, default=0) < 0:
        b = next(b for b, length in enumerate(lengths) if length < 0)
        raise ValueError(f"{name} must be non-decreasing: sequence {b} would end before it starts ({name}[{b}] = "
                         f"{offsets[b]}, {name}[{b + 1}] = {offsets[b + 1]})")
    if offsets[-1] > total:
        b = next(b for b, end in enumerate(offsets[1:]) if end > total)
        raise ValueError(f"{name}: sequence {b} (rows {offsets[b]}:{offsets[b + 1]}) ends past the {total} packed "
                         f"rows; {name}[-1] must equal the number of packed rows")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] = {offsets[-1]} must equal the number of packed rows {total}")
    if max_seqlen is not None and max(lengths, default=0) > max_seqlen:
        b = max(range(len(lengths)), key=lengths.__getitem__)
        raise ValueError(f"{max_name} = {max_seqlen} is below the length {lengths[b]} of sequence {b} of {name} (rows "
                         f"{offsets[b]}:{offsets[b + 1]}); it must bound every sequence's length")


def _check_offsets_on_host(name: str, cu_seqlens: Tensor, total: int, max_name: str, max_seqlen: int) -> None:
    check_cu_seqlens(cu_seqlens, total, max_seqlen, name=name, max_name=max_name)  # a CPU tensor: no device sync


# CUDA cu_seqlens already asserted on the device: tensor -> {(its _version, total, max_seqlen)}. A model passes one
# cu_seqlens to every layer; it is checked once (a new or modified tensor is checked again).
_asserted_offsets = WeakIdKeyDictionary()


def _assert_offsets_on_device(name: str, cu_seqlens: Tensor, total: int, max_name: str, max_seqlen: int) -> None:
    """The offset checks of _check_offsets_on_host as a device assert (torch._assert_async): a bad tensor stops the
    program with this message at the next synchronisation (CUDA error: device-side assert triggered), without a host
    sync now. The kernels clamp every sequence to [0, total) and max_seqlen, so they never read out of bounds first."""
    compiling = torch.compiler.is_compiling()  # traced into the graph (fused by inductor), not cached
    if not compiling:
        key = (cu_seqlens._version, total, max_seqlen)
        if key in _asserted_offsets.get(cu_seqlens, ()):
            return
    lengths = cu_seqlens.diff()  # (batch,)
    valid = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & ((lengths >= 0) & (lengths <= max_seqlen)).all()
    torch._assert_async(valid, f"{name} must start at 0, be non-decreasing and end at the number of packed rows "
                               f"{total}, with no sequence longer than {max_name} = {max_seqlen}")
    if not compiling:
        _asserted_offsets.setdefault(cu_seqlens, set()).add(key)


def _check_block_mask(block_mask, q: Tensor, nheads: int, seqlen_q: int, seqlen_k: int) -> None:
    if block_mask is None:
        return
    if not isinstance(block_mask, Tensor):
        raise TypeError(f"block_mask must be a torch.Tensor or None, got {type(block_mask).__name__}")
    if block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be bool, got {block_mask.dtype}")
    blocks = (math.ceil(seqlen_q / BLOCK_SPARSE_SIZE), math.ceil(seqlen_k / BLOCK_SPARSE_SIZE))
    if tuple(block_mask.shape) not in (blocks, (nheads, *blocks)):
        raise ValueError(
            f"block_mask must have shape {blocks} or {(nheads, *blocks)} "
            f"(nheads, ceil(seqlen / {BLOCK_SPARSE_SIZE}) blocks), got {tuple(block_mask.shape)}"
        )
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device} but q is on {q.device}")


def _check_dropout_mask(dropout_mask, q: Tensor, dropout_p: float, shape: tuple[int, ...]) -> None:
    if dropout_mask is None:
        return
    if not isinstance(dropout_mask, Tensor):
        raise TypeError(f"dropout_mask must be a torch.Tensor or None, got {type(dropout_mask).__name__}")
    if dropout_mask.dtype != torch.bool:
        raise TypeError(f"dropout_mask must be a bool keep-mask, got {dropout_mask.dtype}")
    if tuple(dropout_mask.shape) != shape:
        raise ValueError(f"dropout_mask must have shape {shape}, got {tuple(dropout_mask.shape)}")
    if dropout_mask.device != q.device:
        raise ValueError(f"dropout_mask is on {dropout_mask.device} but q is on {q.device}")
    if dropout_p == 0:
        raise ValueError("dropout_mask is given but dropout_p is 0; pass the dropout probability it was drawn with")
