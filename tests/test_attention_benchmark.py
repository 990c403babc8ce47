"""benchmarks/attention.py's CPU side (its --selftest on synthetic times): FLOPs, best-round folding, the ratios
against the fastest SDPA backend and against FlashAttention-4, the sustained-speed table, the markdown tables with
FA4 installed and "not installed", and the plots."""

import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_attention_benchmark_selftest():
    result = subprocess.run([sys.executable, "attention.py", "--selftest"], cwd=BENCHMARKS, capture_output=True,
                            text=True, timeout=300, env={"MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "| flashtrain / FA4 |" in out and "ft/FA4 | ft/cuDNN |" in out
    assert "not installed" in out  # the sustained table without FA4
    assert "| fwd: SM MHz (flashtrain / FA4 / cuDNN) | W | TFLOP/s per GHz |" in out  # its clocks table
    assert "worst flashtrain/fa4:" in out


@pytest.fixture
def attention(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import attention

    return attention


def test_sustained_rounds_alternate_and_average(attention):
    order, values = [], {"flashtrain": [500.0, 520.0], "fa4": [480.0, 490.0], "cudnn": [450.0, None]}

    def measure(impl):
        order.append(impl)
        value = values[impl][sum(name == impl for name in order) - 1]
        return {"fwd": value, "fb": value and value / 2}

    results = attention.sustained_rounds(measure, 2)
    assert order == ["flashtrain", "fa4", "cudnn", "cudnn", "fa4", "flashtrain"]  # the second round reversed
    row = attention.sustained_fields(results)
    assert row["flashtrain_fwd_sustained"] == 510.0 and row["fa4_fb_sustained"] == 242.5
    assert row["flashtrain_fwd_sustained_rounds"] == [500.0, 520.0]
    assert row["ft_over_fa4_fwd"] == round(510.0 / 485.0, 3)
    # a round that could not run leaves the mean (and its ratio) empty instead of averaging what is left
    assert row["cudnn_fwd_sustained"] is None and row["ft_over_cudnn_fwd"] is None


def test_sustained_arguments_are_checked():
    result = subprocess.run([sys.executable, "attention.py", "--sustained-only", "--sustained-rounds", "0"],
                            cwd=BENCHMARKS, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)})
    assert result.returncode == 2
    assert "--sustained-rounds >= 1" in result.stderr


def test_sustained_clocks_come_with_the_speed(attention, monkeypatch):
    """Each sustained run samples the SM clock and board power (gpu_clocks) around its calls; without nvidia-smi the
    speed is still measured and the clocks are None."""
    import contextlib

    import gpu_clocks

    calls = []
    monkeypatch.setattr(attention, "sustained_ms", lambda call, seconds: calls.append(call()) or 2.0)

    @contextlib.contextmanager
    def samples():
        rows = []
        yield rows
        rows += [[900.0, 300.0, 40.0]] + [[1603.4, 680.2, 60.0]] * 3  # the first quarter is the clocks settling

    monkeypatch.setattr(gpu_clocks, "smi_samples", samples)
    assert attention.sustained_ms_clocks(lambda: "a", 3.0) == (2.0, (1603, 680))

    def missing():
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(gpu_clocks, "smi_samples", missing)
    assert attention.sustained_ms_clocks(lambda: "b", 3.0) == (2.0, (None, None))
    assert calls == ["a", "b"]  # one run each: the missing sampler does not repeat the measurement


def test_sustained_markdown_shows_clocks_and_work_per_ghz(attention):
    row = {"hd": 128, "S": 16384, "causal": False, "seconds": 3, "rounds": 2}
    for impl, (fwd, mhz) in {"flashtrain": (632.0, 1600.0), "fa4": (659.0, 1650.0), "cudnn": (598.0, 1650.0)}.items():
        row.update({f"{impl}_fwd_sustained": fwd, f"{impl}_fb_sustained": None, f"{impl}_fwd_mhz_sustained": mhz,
                    f"{impl}_fwd_watts_sustained": 680.0, f"{impl}_fb_mhz_sustained": None,
                    f"{impl}_fb_watts_sustained": None})
    for other in ("fa4", "cudnn"):
        row[f"ft_over_{other}_fwd"] = round(632.0 / row[f"{other}_fwd_sustained"], 3)
        row[f"ft_over_{other}_fb"] = None
    lines = attention.sustained_markdown([row], "4.0").splitlines()
    clocks = lines[lines.index(next(line for line in lines if "SM MHz" in line)) + 2]
    # 632 TFLOP/s at 1.6 GHz: 395 per GHz; FA4 659 / 1.65: 399
    assert clocks.startswith(
        "| 128 | full | 16384 | 1600 / 1650 / 1650 | 680 / 680 / 680 | 395 / 399 / 362 | - / - / - |")
