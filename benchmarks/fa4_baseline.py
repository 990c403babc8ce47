"""FlashAttention-4 (the `flash-attn-4` package: Dao-AILab's CuTe-DSL kernels, with a Hopper forward and backward) as
an optional baseline of the attention benchmarks (benchmarks/attention.py, benchmarks/attention_features.py).

It is imported only when present: where it is missing the benchmarks' tables say "not installed" in its column and
its calls raise Unavailable (which the benchmarks' timers record as a pass that did not run). The GPU machine lacks
it; ../shared/device/fa4.sh downloads it here and says how to carry it there.

FA4 takes flashtrain's layout, (batch, seqlen, heads, head_dim) or packed (total, heads, head_dim) with cu_seqlens,
reads GQA from the shapes, and returns (out, lse); these wrappers return out.
"""

from __future__ import annotations

NOT_INSTALLED = "not installed"


class Unavailable(RuntimeError):
    """FA4 is not installed, or does not offer what the row asks (dropout, ALiBi): raised by the call, so that the
    benchmarks' timers record a pass that did not run."""


def _refusing(reason: str):
    def fn(*_):
        raise Unavailable(reason)
    return fn


def import_error() -> str | None:
    """Why FA4's kernels cannot be imported ("ModuleNotFoundError: ..."), or None when they can."""
    try:
        import flash_attn.cute  # noqa: F401 -- the kernels themselves, not only the metadata
    except Exception as error:  # noqa: BLE001 -- a missing or broken install: either way the reason
        return f"{type(error).__name__}: {error}"
    return None


def version() -> str:
    """FA4's version, or NOT_INSTALLED."""
    if import_error() is not None:
        return NOT_INSTALLED
    from importlib.metadata import PackageNotFoundError, version as package_version
    try:
        return package_version("flash-attn-4")
    except PackageNotFoundError:
        return NOT_INSTALLED


REQUIRE_HINT = ("on the GPU machine FA4's install script (../shared/device/fa4.sh's third piece) prints a PYTHONPATH "
                "export for its site directory: evaluate it after any PYTHONPATH of your own, or extend PYTHONPATH "
                "(PYTHONPATH=$PWD:$PYTHONPATH) instead of setting it")


def require(option: str = "--require-fa4") -> str:
    """FA4's version, or SystemExit naming `option` and the import error: for runs that exist to compare with FA4
    (attention.py / attention_features.py --require-fa4, an explicit fa4 implementation in the probes), which should
    stop before measuring anything rather than fill a record with empty FA4 cells."""
    error = import_error()
    if error is not None:
        raise SystemExit(f"{option}: flash-attn-4 cannot be imported ({error}); {REQUIRE_HINT}")
    return version()


def require_if_named(impls, option: str = "--impls") -> None:
    """require() where the implementations a probe was given name FA4 (fa4, or fa4#tag): before it builds or measures
    any of them."""
    if any(name.split("#")[0] == "fa4" for name in impls):
        require(f"{option} fa4")


def _module():
    """flash_attn.cute, or None when it cannot be imported (import_error says why)."""
    if import_error() is not None:
        return None
    from flash_attn import cute
    return cute


def attention(causal: bool, dropout_p: float = 0.0, window: int = -1, softcap: float = 0.0):
    """fn(q, k, v) -> out: FA4's flash_attn_func, q (batch, seqlen, heads, head_dim), k / v with heads_kv heads.
    window >= 0: each query sees itself and the `window` keys before it (causal sliding window)."""
    cute = _module()
    if cute is None or dropout_p > 0:
        return _refusing(f"flash-attn-4 {NOT_INSTALLED}" if cute is None else "FA4 has no attention dropout")
    options = {"causal": causal, "softcap": softcap}
    if window >= 0:
        options["window_size"] = (window, 0)
    return lambda q, k, v: cute.flash_attn_func(q, k, v, **options)[0]


def varlen_attention(cu_seqlens, max_seqlen: int, causal: bool, dropout_p: float = 0.0):
    """fn(q, k, v) -> out on packed (total, heads, head_dim) tensors: FA4's flash_attn_varlen_func."""
    cute = _module()
    if cute is None or dropout_p > 0:
        return _refusing(f"flash-attn-4 {NOT_INSTALLED}" if cute is None else "FA4 has no attention dropout")
    return lambda q, k, v: cute.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        causal=causal)[0]
