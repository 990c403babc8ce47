"""Model FLOPs utilisation: the FLOPs a model's training step needs per token (the model's `flops_per_token(seq_len)`)
times tokens per second, over the GPU's peak dense bf16 tensor-core rate.

The peak comes from the vendors' data sheets for GPUs this table knows (dense, no sparsity, boost clock); for others
it is measured once (a large bf16 matmul, the best of a few) and cached per GPU name and torch version, so MFU stays
comparable between runs on the same GPU. The FLOPs follow PaLM's convention (flashtrain.models.flops)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

# (substring of torch.cuda.get_device_name, dense bf16 TFLOP/s); the first match wins, so longer names come first
PEAK_BF16_TFLOPS = (
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H800 PCIe", 756.0),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
)
MEASURE_SIZE = 8192  # square bf16 matmul for GPUs the table does not know


def _cache_path() -> Path:
    root = os.environ.get("FLASHTRAIN_CACHE_DIR") or Path.home() / ".cache" / "flashtrain"
    return Path(root) / "peak_bf16_tflops.json"


def measure_bf16_tflops(device: torch.device, size: int = MEASURE_SIZE, repeats: int = 10) -> float:
    """The best TFLOP/s of `repeats` size^3 bf16 matmuls on `device` (after a warm-up)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(repeats + 2):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_bf16_tflops(device: torch.device) -> tuple[float, str] | None:
    """(peak dense bf16 TFLOP/s of `device`, where the number comes from); None on a CPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops, f"{name}, data sheet"
    path, key = _cache_path(), f"{name} / torch {torch.__version__}"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached.get(key), (int, float)):
        cached[key] = round(measure_bf16_tflops(device), 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1) + "\n")
        os.replace(tmp, path)
    return float(cached[key]), f"{name}, measured ({path})"


class Utilisation:
    """tokens/s -> MFU for one run: flops_per_token of its model at its sequence length, the peak of each of its
    `processes` GPUs."""

    def __init__(self, flops_per_token: float | None, peak: tuple[float, str] | None, processes: int):
        self.flops_per_token, self.peak, self.processes = flops_per_token, peak, processes

    @property
    def enabled(self) -> bool:
        return self.flops_per_token is not None and self.peak is not None

    def mfu(self, tokens_per_s: float) -> float | None:
        """The fraction of the processes' summed peak that tokens_per_s (all processes) uses; None if unknown."""
        if not self.enabled:
            return None
        return tokens_per_s * self.flops_per_token / (self.peak[0] * 1e12 * self.processes)

    def describe(self) -> str:
        if self.flops_per_token is None:
            return "MFU: not reported (the model defines no flops_per_token)"
        if self.peak is None:
            return f"MFU: not reported on a CPU ({self.flops_per_token / 1e9:.3f} GFLOP per token)"
        return (f"MFU: {self.flops_per_token / 1e9:.3f} GFLOP per token against {self.peak[0]:.1f} TFLOP/s bf16 per "
                f"GPU ({self.peak[1]})")
