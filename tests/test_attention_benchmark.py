"""benchmarks/attention.py's CPU side (its --selftest on synthetic times): FLOPs, best-round folding, the ratios
against the fastest SDPA backend and against FlashAttention-4, the sustained-speed table, the markdown tables with
FA4 installed and "not installed", and the plots."""

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
