"""Can flashtrain's CUDA kernels run here? Prints what they depend on, then compiles and runs one tiny attention call
through the real path (flash_attn_func, impl="cuda": NVRTC or nvcc, the disk cache, cuda-python's launch) and checks
it against the plain-PyTorch reference.

    python -m flashtrain.kernels.doctor

Exit status 0: the kernels ran and matched the reference on every visible GPU ("verdict: OK"). 1: they cannot run or
gave wrong numbers; the verdict says why (on a machine without a GPU: "no CUDA GPU is visible to torch").
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

from flashtrain.kernels import build

SHAPE = (1, 128, 2, 64)  # batch, seqlen, heads, head_dim of the tiny call


def _line(name: str, value: object) -> None:
    print(f"{name:<22} {value}")


def _environment() -> None:
    import flashtrain

    _line("flashtrain", os.path.dirname(flashtrain.__file__))
    _line("python", f"{platform.python_version()} ({sys.executable})")
    _line("torch", f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none (CPU-only build)'}")
    _line("cuda-python", build.cuda_python_version() or "not installed (pip install -e '.[cuda12]' or '.[cuda13]')")
    mismatch = build.cuda_version_mismatch()
    if mismatch is not None:
        _line("version mismatch", mismatch)
    _line("NVRTC", build.nvrtc_version() or "not found")
    _line("nvcc", f"{build.nvcc_path()} ({build.nvcc_version()})" if build.nvcc_path() else "not found")
    cache = build.cache_dir()
    cubins = len(list(cache.glob("*.cubin"))) if cache.is_dir() else 0
    _line("kernel cache", f"{cache} ({cubins} cubins; FLASHTRAIN_KERNEL_CACHE moves it)")
    host = build.host_library_path()
    _line("C++ host layer", f"{host}" if host.is_file() else
          f"not built yet (first use compiles it with {build.cxx_path() or 'g++: not found'}, ~30 s)")
    _line(build.SMEM_ENV, os.environ.get(build.SMEM_ENV, "not set"))
    _line("FLASHTRAIN_SM90", os.environ.get("FLASHTRAIN_SM90", "not set (Hopper kernels on)"))


def _check_device(index: int) -> str | None:
    """Describe cuda:index, run the tiny call there; None when it matched the reference, else why not."""
    from flashtrain.kernels import flash_attn_func, naive_attention, ops

    device = torch.device("cuda", index)
    major, minor = torch.cuda.get_device_capability(device)
    _line(f"cuda:{index}", f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}")
    reason = ops.unavailable_reason(device, head_dim=SHAPE[-1], dtype=torch.bfloat16, block_mask=False)
    try:
        from flashtrain.kernels import launch
    except ImportError:  # no cuda-python: the reason says so
        launch = None
    if launch is not None and major >= 8:
        _line("  arch", launch.device_arch(device))
        _line("  shared memory", f"{launch.device_smem_limit(device)} bytes per block (opt-in"
                                 f"{', capped by ' + build.SMEM_ENV if build.smem_cap() else ''})")
    if reason is not None:
        return reason
    generator = torch.Generator(device).manual_seed(0)
    q, k, v, dout = (torch.randn(SHAPE, device=device, generator=generator) for _ in range(4))

    def run(fn, dtype):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]  # fresh leaves for every run
        out = fn(*inputs)
        out.backward(dout.to(dtype))
        return [out.detach().float()] + [x.grad.float() for x in inputs]

    start = time.perf_counter()
    kernel = run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, impl="cuda"), torch.bfloat16)
    torch.cuda.synchronize(device)
    _line("  tiny call", f"forward + backward {SHAPE} bf16 causal in {time.perf_counter() - start:.2f} s "
                         "(first use compiles the kernels, or reads them from the cache)")
    reference = run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, impl="reference"), torch.float32)
    lowp = run(lambda q, k, v: naive_attention(q, k, v, causal=True)[0], torch.bfloat16)
    for name, got, ref, low in zip(("out", "dq", "dk", "dv"), kernel, reference, lowp):
        error, bound = (got - ref).abs().max().item(), 2 * (low - ref).abs().max().item() + 1e-3
        _line(f"  {name} error", f"{error:.2e} (bound {bound:.2e}: twice plain PyTorch's bf16 error)")
        if not error <= bound:
            return f"the kernel's {name} differs from the reference by {error:.3g} (bound {bound:.3g})"
    return None


def main() -> int:
    _environment()
    if not torch.cuda.is_available():
        build_note = "torch is a CPU-only build" if torch.version.cuda is None else "no driver or device found"
        print(f"verdict: NOT OK, no CUDA kernel can run here: no CUDA GPU is visible to torch ({build_note})")
        return 1
    failures = {}
    for index in range(torch.cuda.device_count()):
        reason = _check_device(index)
        if reason is not None:
            failures[index] = reason
    if failures:
        for index, reason in failures.items():
            print(f"verdict: NOT OK on cuda:{index}: {reason}")
        return 1
    print(f"verdict: OK, flashtrain's CUDA kernels compile, run and match the reference on "
          f"{torch.cuda.device_count()} GPU(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
