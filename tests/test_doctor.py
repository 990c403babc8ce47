"""python -m flashtrain.kernels.doctor, and the CUDA version check it reports."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashtrain.kernels import build

ROOT = Path(__file__).resolve().parent.parent


def _doctor(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashtrain.kernels.doctor"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def test_doctor_without_a_gpu_says_why_no_kernel_can_run(tmp_path):
    result = _doctor({"CUDA_VISIBLE_DEVICES": "", "FLASHTRAIN_KERNEL_CACHE": str(tmp_path)})
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("verdict: NOT OK, no CUDA kernel can run here: no CUDA GPU is visible to torch (")
    fields = {line.split()[0] for line in lines[:-1]}
    assert {"flashtrain", "torch", "cuda-python", "NVRTC", "nvcc", "kernel"} <= fields
    assert f"kernel cache           {tmp_path} (0 cubins" in result.stdout
    assert f"flashtrain             {ROOT / 'flashtrain'}" in result.stdout


@pytest.mark.cuda
def test_doctor_runs_the_tiny_call_on_the_gpu():
    result = _doctor({})
    assert result.returncode == 0 and "verdict: OK" in result.stdout, result.stdout + result.stderr
    assert "  out error" in result.stdout and "  dv error" in result.stdout


def test_cuda_version_mismatch_names_the_fix():
    message = build.cuda_version_mismatch(torch_cuda="12.8", cuda_python="13.0.2")
    assert message == ("cuda-python 13.0.2 is for CUDA 13 but torch was built with CUDA 12.8: its NVRTC "
                       "(libnvrtc.so.13) is not the one torch's wheel installs. Fix: pip install "
                       "'cuda-python>=12.4,<13' (or pip install -e '.[cuda12]')")
    assert "'cuda-python>=13.0,<14'" in build.cuda_version_mismatch(torch_cuda="13.0", cuda_python="12.9.0")
    assert build.cuda_version_mismatch(torch_cuda="12.6", cuda_python="12.9.0") is None
    assert build.cuda_version_mismatch(torch_cuda="13.0", cuda_python="13.0.0") is None


def test_cuda_extras_pin_the_cuda_major_version():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda12"] == ["cuda-python>=12.4,<13"] and extras["cuda13"] == ["cuda-python>=13.0,<14"]
