"""benchmarks/context_parallel_parity.py, the parity check of context parallelism against one GPU (trainings through
launch.py: one-process runs A, B and C, and parallel.context=2 over 2 processes), in its CPU smoke mode: the default
recipe's tiny GPT-2 at 256 tokens, 10 steps, the CP run on 2 gloo processes. On the CPU the one-process runs agree to
float32 round-off (ROUND_OFF), so the spread stays far below the floor, and the CP run gives A's losses within the DDP
tests' float32 tolerance; the verdict, the JSON's fields and the PNG are checked. Also: overrides the script sets
itself are refused, and the verdict's rule on given losses."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from test_processes import ENV, ROOT, TOLERANCE

# how far two one-process CPU runs' losses (~6-7) may be apart: a few float32 ulps (1 ulp = 4.8e-7 there), a tenth of
# the DDP tests' tolerance; seen: 0 in most runs, 2.4e-7 on one validation loss while other work shared the CPU
ROUND_OFF = 1e-6


def load_script():
    spec = importlib.util.spec_from_file_location("context_parallel_parity",
                                                  ROOT / "benchmarks" / "context_parallel_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--overrides", "hydra.run.dir=/tmp/x"], "--overrides: 'hydra.run.dir=/tmp/x' sets hydra.run.dir"),
    (["--overrides", "logger=none", "parallel.context=2"], "--overrides: 'parallel.context=2' sets parallel.context"),
    (["--context", "1"], "--context must be >= 2"),
    (["--one-gpu-runs", "1"], "--one-gpu-runs must be in"),
])
def test_settings_the_script_owns_are_refused_before_anything_runs(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        load_script().main([*argv, "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out.json")])
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_smoke_run_context_parallel_is_within_the_spread_of_one_process_runs(tmp_path):
    out = tmp_path / "out" / "parity.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel_parity.py"), "--smoke",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["env"]["device_name"] == "cpu" and result["env"]["torch"] == torch.__version__
    assert result["env"]["date"] and result["context"] == 2 and result["prepare"]["exit_code"] == 0
    runs, comparison = result["runs"], result["comparison"]
    assert list(runs) == ["A", "B", "C", "CP"]
    assert runs["A"]["header"][0] == runs["B"]["header"][0] == runs["C"]["header"][0] == "processes: 1 (cpu)"
    assert runs["CP"]["header"][0] == "processes: 2 (DDP over gloo, cpu; context parallel 2 x data parallel 1)"
    assert "--nproc_per_node 2" in runs["CP"]["command"] and runs["CP"]["command"].endswith(
        f"parallel.context=2 hydra.run.dir={tmp_path / 'work' / 'CP'}")

    # the same 10 steps logged by all four, a loss each
    for run in runs.values():
        assert run["exit_code"] == 0 and run["steps"] == 10
        assert sorted(map(int, run["train_loss"])) == list(range(1, 11))
        assert run["tokens_per_s"] > 0 and run["peak_memory_gib_per_gpu"] is None  # no GPU memory on the CPU
    # the weights move (the check would be empty otherwise): validation loss from ~6.95 at step 0, down by > 0.3
    assert runs["A"]["val_loss"]["10"] < runs["A"]["val_loss"]["0"] - 0.3

    # B and C repeat A to float32 round-off (ROUND_OFF, a tenth of the floor): the spread over the 3 pairs stays
    # below it, so the floor (the DDP tests' float32 tolerance) is the threshold
    for label in ("B", "C"):
        for key in ("train_loss", "val_loss"):
            assert runs[label][key].keys() == runs["A"][key].keys()
            for step, loss in runs["A"][key].items():
                assert abs(runs[label][key][step] - loss) <= ROUND_OFF, (label, key, step)
        assert 0.0 <= comparison["one_gpu_vs_a"][label]["mean"] <= comparison["one_gpu_vs_a"][label]["max"] <= ROUND_OFF
    spread = comparison["spread"]
    assert spread["pairs"] == 3 and len(spread["pair_means"]) == len(spread["pair_maxes"]) == 3
    assert spread["mean"] == max(spread["pair_means"]) and spread["max"] == max(spread["pair_maxes"]) <= ROUND_OFF
    assert comparison["floor"] == comparison["threshold"] == TOLERANCE["abs"] == 1e-5 and comparison["margin"] == 1.5
    # CP: A's losses up to float32 round-off (summation order over 2 processes), every step and validation within
    # the DDP tests' 1e-5 (seen: at most ~1e-6)
    for step, loss in runs["A"]["train_loss"].items():
        assert runs["CP"]["train_loss"][step] == pytest.approx(loss, **TOLERANCE), step
        assert comparison["cp_vs_a"]["abs_diff"][step] == pytest.approx(abs(runs["CP"]["train_loss"][step] - loss),
                                                                        abs=1e-12)
    for step, loss in runs["A"]["val_loss"].items():
        assert runs["CP"]["val_loss"][step] == pytest.approx(loss, **TOLERANCE), step
    assert comparison["cp_vs_a"]["steps"] == comparison["one_gpu_vs_a"]["B"]["steps"] == 10
    assert comparison["cp_vs_one_gpu_means"] == {label: comparison["cp_vs_a"]["mean"] for label in ("A", "B", "C")}
    assert comparison["cp_vs_a"]["max"] <= TOLERANCE["abs"]
    assert comparison["cp_vs_a"]["mean"] == pytest.approx(
        sum(comparison["cp_vs_a"]["abs_diff"].values()) / 10, rel=1e-12)
    assert comparison["cp_within_spread"] is True
    assert comparison["cp_over_spread"] == pytest.approx(comparison["cp_vs_a"]["mean"] / 1e-5, rel=1e-12)
    assert comparison["speedup_cp_vs_a"] == pytest.approx(runs["CP"]["tokens_per_s"] / runs["A"]["tokens_per_s"],
                                                          rel=1e-12)
    assert out.with_suffix(".png").stat().st_size > 10_000


def rule_runs(curves: dict[str, list[float]]) -> dict:
    return {label: {"train_loss": dict(enumerate(losses, 1)), "tokens_per_s": None} for label, losses in curves.items()}


def test_verdict_is_the_ddp_rule_over_every_pair_of_one_gpu_runs():
    """mean |CP - A| <= max(1.5 x the largest pair mean of one-GPU runs, floor), as multiprocess_gpu.py rules DDP."""
    compare = load_script().compare
    base = [6.0, 5.0, 4.0, 3.0]
    # pair means: |B - A| 0.01, |C - A| 0.04, |C - B| 0.03 -> spread 0.04, threshold 0.06
    one_gpu = {"A": base, "B": [x + 0.01 for x in base], "C": [x + 0.04 for x in base]}
    inside = compare(rule_runs({**one_gpu, "CP": [x + 0.059 for x in base]}), floor=1e-5)
    assert inside["spread"]["mean"] == pytest.approx(0.04) and inside["spread"]["pairs"] == 3
    assert inside["spread"]["pair_means"] == pytest.approx([0.01, 0.03, 0.04])
    assert inside["threshold"] == pytest.approx(0.06) and inside["cp_within_spread"] is True
    assert inside["cp_vs_one_gpu_means"] == pytest.approx({"A": 0.059, "B": 0.049, "C": 0.019})
    outside = compare(rule_runs({**one_gpu, "CP": [x + 0.061 for x in base]}), floor=1e-5)
    assert outside["cp_within_spread"] is False and outside["cp_over_spread"] == pytest.approx(0.061 / 0.06)
    # a run that logged no loss: no verdict
    assert compare(rule_runs({**one_gpu, "CP": []}), floor=1e-5)["cp_within_spread"] is None
