"""utils.cuh poly_exp2 (2^x on the FMA pipe, the forward's MUFU relief) emulated step by step in float32 with numpy,
its constants read from the source: the relative error it claims, exact 1 at 0 and exact 0 for masked scores."""
import re
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parents[1] / "flashtrain" / "kernels" / "csrc" / "utils.cuh"


def poly_exp2_constants() -> tuple[float, list[float]]:
    body = re.search(r"float poly_exp2\(float x\) \{(.*?)\n\}", SOURCE.read_text(), re.S).group(1)
    clamp = float(re.search(r"fmaxf\(x, (-?[0-9.]+)f\)", body).group(1))
    fmas = re.findall(r"fmaf\(([^)]*)\)", body)
    first = [float(a.rstrip("f")) for a in fmas[0].split(", ") if a != "f"]  # c3 f + c2
    rest = [float(a.split(", ")[2].rstrip("f")) for a in fmas[1:]]  # p f + c1, p f + c0
    return clamp, first + rest


def emulate(x: np.ndarray) -> np.ndarray:
    clamp, (c3, c2, c1, c0) = poly_exp2_constants()
    f32 = np.float32
    x = np.maximum(x.astype(f32), f32(clamp))
    magic = f32(12582912.0)
    t = (x + magic).astype(f32)
    f = (x - (t - magic)).astype(f32)
    # fmaf rounds once; float64 products of float32 values are exact, so one rounding to float32 matches it
    p = (f32(c3).astype(np.float64) * f + c2).astype(f32)
    p = (p.astype(np.float64) * f + c1).astype(f32)
    p = (p.astype(np.float64) * f + c0).astype(f32)
    bits = (p.view(np.int32).astype(np.int64) + (t.view(np.int32).astype(np.int64) << 23)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


def test_relative_error_is_below_the_16_bit_rounding_of_p():
    x = np.linspace(-120, 8, 2_000_001, dtype=np.float32)
    rel = np.abs(emulate(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 1.1e-4  # 2^-13.2; a bf16 P is rounded to 2^-9
    assert rel.max() > 1e-5  # (a cubic: the bound is tight, not vacuous)


def test_zero_max_gives_exactly_one_and_masked_scores_exactly_zero():
    got = emulate(np.array([0.0, -np.inf, -127.0, -200.0, -1e30], dtype=np.float32))
    assert got[0] == 1.0
    assert (got[1:] == 0.0).all()


def test_underflow_stays_tiny_and_non_negative():
    x = np.linspace(-127, -120, 10_001, dtype=np.float32)
    y = emulate(x)
    assert (y >= 0).all() and (y <= 2.0**-119).all()
    assert np.isfinite(y).all()
