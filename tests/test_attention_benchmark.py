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
