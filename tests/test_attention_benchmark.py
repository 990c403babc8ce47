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
    result = subprocess.run([sys.executable, "attention.py", "--workloads", "--rounds", "0"], cwd=BENCHMARKS,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)})
    assert result.returncode == 2 and "--rounds >= 1" in result.stderr


def test_rounds_visit_every_cell_before_the_next_round(attention):
    """The grid and the workloads take their rounds outer (rounds_over_cells): round r of every cell, then round
    r + 1, so that a disturbance lasting a few seconds reaches at most one round of a cell; each cell keeps its best
    round (keep_best), here the second round of the cell the disturbance hit."""
    visits, rows = [], [{"cell": name} for name in ("a", "b", "c")]
    slow = {("b", 0)}  # a disturbance during the first round of cell b

    def measure(row, round_index):
        visits.append((row["cell"], round_index))
        ms = 2.0 if (row["cell"], round_index) in slow else 1.0 + 0.1 * round_index
        attention.keep_best(row, "flashtrain", {"fwd": ms, "bwd": 2 * ms, "fb": 3 * ms}, fwd_flops=1e9)

    attention.rounds_over_cells(rows, 2, measure)
    assert visits == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1)]
    assert [row["flashtrain_fwd_ms"] for row in rows] == [1.0, 1.1, 1.0]
    assert rows[1]["flashtrain_fb_ms"] == 3.3 and rows[1]["flashtrain_fwd"] == round(1e9 / 1.1 / 1e9, 1)


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


def test_record_env_names_the_board_and_the_tree(attention, monkeypatch, tmp_path):
    """A record's env carries the driver and power limit (nvidia-smi's one line for GPU 0), the L2 size with the
    dispatch it selects, and the commit it ran on, marked when tracked files differ; the board and commit are left out
    (not guessed) where the tools are missing."""
    import subprocess

    import gpu_clocks

    def fake_run(cmd, **kwargs):
        assert cmd[0] == "nvidia-smi" and "--query-gpu=driver_version,power.limit" in cmd
        return subprocess.CompletedProcess(cmd, 0, stdout="580.159.04, 700.00\n")

    monkeypatch.setattr(gpu_clocks.subprocess, "run", fake_run)
    assert gpu_clocks.board() == {"driver": "580.159.04", "power_limit_w": 700}

    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(gpu_clocks.subprocess, "run", missing)
    assert gpu_clocks.board() == {} and gpu_clocks.source_commit(tmp_path) is None
    # the L2 size and whether the short causal forwards took the small-L2 dispatch (an H100's 50 MB, an H200's 60)
    assert gpu_clocks.memory_system(50 << 20) == {"l2_mb": 50, "small_l2_dispatch": True}
    assert gpu_clocks.memory_system(60 << 20) == {"l2_mb": 60, "small_l2_dispatch": False}
    monkeypatch.undo()
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("a")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert gpu_clocks.source_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("b")
    assert gpu_clocks.source_commit(tmp_path) == head + "+changes"


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


def test_grid_and_workloads_keep_each_cells_best_round(attention, monkeypatch, capsys):
    """speed() and workload_speed() with the GPU measurement replaced (time_passes_interleaved, time_impl, the
    cases): every cell measured once per round, rounds outer; each row keeps its best round and is printed once, after
    its last round; the workloads' ratios come from the best rounds."""
    calls = []

    def interleaved(cases, repeats, label):
        calls.append(label)
        slow = 2.0 if len(calls) == 1 else 1.0  # the first cell's first round is disturbed
        return {impl: {"fwd": slow * (1 + i), "bwd": 2 * slow * (1 + i), "fb": 3 * slow * (1 + i)}
                for i, impl in enumerate(cases)}

    monkeypatch.setattr(attention, "time_passes_interleaved", interleaved)
    monkeypatch.setattr(attention, "time_impl", lambda impl, *args: {"fwd": 50.0, "bwd": 100.0, "fb": 150.0})
    monkeypatch.setattr(attention, "attention_fn", lambda impl, causal: None)
    monkeypatch.setattr(attention, "make_inputs", lambda *args, **kwargs: ())
    monkeypatch.setattr(attention, "unpack_inputs", lambda tensors: ((), None))
    rows = attention.speed([512, 1024], repeats=3, rounds=2)
    cells = [f"hd{hd} S{s} causal={c}" for hd in (64, 128) for s in (512, 1024) for c in (False, True)]
    assert calls == cells + cells  # round 0 of every cell, then round 1
    assert [(r["hd"], r["S"], r["causal"]) for r in rows] == [(hd, s, c) for hd in (64, 128) for s in (512, 1024)
                                                               for c in (False, True)]
    assert rows[0]["flashtrain_fwd_ms"] == 1.0 and rows[0]["fa4_fwd_ms"] == 2.0  # the undisturbed round
    assert rows[0]["naive_fwd_ms"] == 50.0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("hd")]) == len(cells)

    calls.clear()
    monkeypatch.setattr(attention, "workload_case", lambda impl, w: None)
    workload_rows = attention.workload_speed(repeats=3, rounds=2)
    names = [w.name for w in attention.workloads()]
    assert calls == names + names and [r["name"] for r in workload_rows] == names
    first = workload_rows[0]
    # FA4 twice flashtrain's time (the ratio of TFLOP/s rounded to 0.1)
    assert first["flashtrain_fwd_ms"] == 1.0 and first["ratio_fa4_fwd"] == pytest.approx(2.0, abs=0.005)


def test_interleaved_passes_hold_the_gpu_and_keep_host_times(attention, monkeypatch):
    """time_passes_interleaved with the GPU timing replaced: each pass's calls are timed with the GPU held for 1.5x the
    host time of all its timed calls + 2 ms (from each implementation's least warm-up host time; the first warm-up
    call compiles), an implementation that refuses the pass is left out of it and of the hold, the host time per call
    comes back beside the GPU time, keep_best keeps the least over rounds; the hold is capped at HOLD_MAX_S and is a
    sleep of at least its length."""
    import attention_timing as timing
    import torch
    import train_gpt2

    ran, warmups = [], {"a": 0, "b": 0}
    host = {"a": (0.004, 0.001, 0.0012), "b": (0.003, 0.0005, 0.0006)}  # seconds per warm-up call, in turn

    def fn(name):
        def call(x):
            if name == "c":
                raise RuntimeError("c refuses the shape")
            ran.append(name)
            return 2 * x
        return call

    def host_seconds(call):
        call()
        name = ran[-1]  # (the backward pass: its forward ran just before its warm-ups)
        warmups[name] += 1
        return host[name][(warmups[name] - 1) % 3]

    holds = []

    def interleaved(ready, repeats, hold_s=0.0):
        holds.append((sorted(ready), round(hold_s, 6)))
        return {name: [0.001 * (1 + i)] for i, name in enumerate(sorted(ready))}

    monkeypatch.setattr(timing, "host_seconds", host_seconds)
    monkeypatch.setattr(timing, "time_interleaved", interleaved)
    cases = {name: (fn(name), (torch.ones(3, requires_grad=True),), torch.ones(3)) for name in ("a", "b", "c")}
    times = timing.time_passes_interleaved(cases, repeats=4, label="cell", warmup=3)
    # two implementations: 4 calls each (time_interleaved's circuits); 1.5 * 4 * (1 + 0.5) ms + 2 ms
    assert holds == [(["a", "b"], 0.011)] * 3
    assert times["a"] == {"fwd": 1.0, "fwd_host_us": 1000.0, "bwd": 1.0, "bwd_host_us": 1000.0, "fb": 1.0,
                          "fb_host_us": 1000.0}
    assert times["b"]["fb"] == 2.0 and times["b"]["fwd_host_us"] == 500.0 and times["c"] == {}
    holds.clear()  # passes: one pass only (benchmarks/probes/neighbors_probe.py profiles them one at a time)
    one = timing.time_passes_interleaved(cases, repeats=4, label="cell", warmup=3, passes=(("bwd", 2.5),))
    assert len(holds) == 1 and one["a"] == {"bwd": 1.0, "bwd_host_us": 1000.0} and one["c"] == {}

    row = {}
    for host_us in (1000.0, 800.0, 1200.0):
        timing.keep_best(row, "a", {"fwd": 1.0, "fwd_host_us": host_us}, fwd_flops=1e9)
    assert row["a_fwd_host_us"] == 800.0 and row["a_fwd_ms"] == 1.0 and "a_bwd_host_us" not in row

    assert timing.hold_seconds({"a": 0.01, "b": 0.02}, 100) == timing.HOLD_MAX_S
    cycles = []
    monkeypatch.setattr(torch.cuda, "_sleep", cycles.append)
    train_gpt2.hold_gpu(0.01)
    assert cycles == [20_000_000]  # 10 ms at 2 GHz, above an H100 / H200's highest SM clock


def test_grid_record_is_written_before_and_during_the_sustained_rows(attention, monkeypatch, tmp_path):
    """run_grid writes its record once the grid and memory sweep are measured, again after each sustained row, and
    marks it complete at the end: a run cut short keeps what it measured (and says it was cut). run_workloads keeps
    its rows the same way while the feature rows run."""
    import argparse
    import json

    out = tmp_path / "grid.json"
    grid = []
    for hd, causal in ((64, False), (64, True), (128, False), (128, True)):
        row = {"hd": hd, "S": 4096, "B": 4, "H": 2048 // hd, "causal": causal}
        row.update({f"{impl}_{kind}": 400.0 + 10 * i for i, impl in enumerate(attention.IMPLS)
                    for kind, _ in attention.PASSES})
        grid.append(row)
    monkeypatch.setattr(attention, "speed", lambda *args, **kwargs: grid)
    monkeypatch.setattr(attention, "memory", lambda seqlens: [{"S": 1024, "flashtrain": 49.5}])
    seen = []

    def fake_sustained(seqlens, seconds, rounds, on_row=None, done=()):
        rows = []
        for causal in (False, True):
            record = json.loads(out.read_text())
            seen.append((len(record["sustained"]), record["complete"], len(record["rows"])))
            row = {"hd": 128, "S": 4096, "B": 4, "H": 16, "causal": causal, "seconds": seconds, "rounds": rounds}
            row.update(attention.sustained_fields(attention.sustained_rounds(
                lambda impl: {"fwd": 600.0, "fb": 500.0, "fwd_mhz": 1600, "fwd_watts": 680, "fb_mhz": 1600,
                              "fb_watts": 690}, rounds)))
            rows.append(row)
            on_row(rows)
            if cut:
                raise TimeoutError("the run's time limit")
        return rows

    monkeypatch.setattr(attention, "sustained", fake_sustained)
    args = argparse.Namespace(seqlens=None, quick=False, repeats=3, rounds=1, timing="interleaved", sustained=5.0,
                              sustained_rounds=1, resume=False)
    env = {"gpu": "test", "fa4": "4.0", "bf16_matmul_tflops": 800.0}
    cut = True
    with pytest.raises(TimeoutError):
        attention.run_grid(args, env, out)
    record = json.loads(out.read_text())
    assert seen == [(0, False, 4)] and len(record["sustained"]) == 1 and record["complete"] is False
    assert record["rows"] == grid and record["memory"] == [{"S": 1024, "flashtrain": 49.5}]
    assert not list(tmp_path.glob("*.part"))

    cut, seen[:] = False, []
    attention.run_grid(args, env, out)
    record = json.loads(out.read_text())
    assert seen == [(0, False, 4), (1, False, 4)] and len(record["sustained"]) == 2 and record["complete"] is True
    assert out.with_suffix(".png").exists()

    import attention_features

    workloads_out = tmp_path / "workloads.json"
    workload_rows = [{"name": "hd64 4K causal", "flashtrain_fwd": 510.4, "ratio_fwd": 1.18}]

    def features(repeats, rounds):
        kept = json.loads(workloads_out.read_text())
        assert kept["rows"] == workload_rows and kept["features"] == [] and kept["complete"] is False
        raise TimeoutError("cut during the feature rows")

    monkeypatch.setattr(attention, "workload_speed", lambda *args, **kwargs: workload_rows)
    monkeypatch.setattr(attention_features, "run", features)
    with pytest.raises(TimeoutError):
        attention.run_workloads(args, env, workloads_out)
    assert json.loads(workloads_out.read_text())["rows"] == workload_rows


def test_resume_continues_a_cut_all_run(attention, tmp_path, monkeypatch):
    """--all --resume: a cut run's grid record (same GPU, commit, FA4, torch and settings) keeps its grid rows, memory
    and measured sustained rows, and only the missing sustained rows are measured; a complete record is reported as
    it is; a record of another commit stops the run. The workloads record keeps its rows and measures the feature
    rows. (sustained_rounds stands for the GPU: one value per implementation, pass and round.)"""
    import argparse
    import json

    import attention_features

    args = argparse.Namespace(seqlens=[4096, 8192], quick=False, repeats=30, rounds=3, timing="interleaved",
                              sustained=3.0, sustained_rounds=2, resume=True)
    env = {"gpu": "NVIDIA H200", "commit": "abc1234", "fa4": "4.0.0b36", "torch": "2.11.0+cu130",
           "bf16_matmul_tflops": 800.0, "date": "2026-12-03T09:00:00+00:00"}
    settings = {"seqlens": [4096, 8192], "repeats": 30, "rounds": 3, "timing": "interleaved", "sustained": 3.0,
                "sustained_rounds": 2}
    grid_rows = [{"hd": 128, "S": 4096, "causal": False, "flashtrain_fwd": 600.0}]
    done = {"hd": 128, "S": 4096, "causal": False, "flashtrain_fwd_sustained": 610.0}
    cut = {"env": {**env, "date": "2026-12-03T08:00:00+00:00"}, "settings": settings, "rows": grid_rows,
           "memory": [{"S": 1024, "flashtrain_mib": 49.5}], "sustained": [done], "complete": False}
    out = tmp_path / "attention.json"
    out.write_text(json.dumps(cut))

    def not_again(*args, **kwargs):
        raise AssertionError("a kept part was measured again")

    calls = []

    def rounds(measure, n):
        calls.append(n)
        return {(impl, kind): [500.0 + len(calls)] * n for impl in attention.SUSTAINED_IMPLS for kind in ("fwd", "fb")}

    for name in ("speed", "memory", "workload_speed"):
        monkeypatch.setattr(attention, name, not_again)
    monkeypatch.setattr(attention, "sustained_rounds", rounds)
    monkeypatch.setattr(attention, "plot", lambda rows, path: None)
    monkeypatch.setattr(attention, "plot_workloads", lambda rows, path, gpu: None)
    monkeypatch.setattr(attention, "grid_summary", lambda rows, peak: "summary")
    monkeypatch.setattr(attention, "grid_markdown", lambda rows, fa4="": f"{len(rows)} grid rows")
    monkeypatch.setattr(attention, "sustained_markdown", lambda rows, fa4="": f"{len(rows)} sustained rows")
    monkeypatch.setattr(attention, "workloads_markdown", lambda rows, fa4="": f"{len(rows)} workload rows")

    assert attention.run_grid(args, env, out) == "1 grid rows\n\n4 sustained rows"
    record = json.loads(out.read_text())
    assert record["complete"] and record["rows"] == grid_rows and record["memory"] == cut["memory"]
    assert [(row["S"], row["causal"]) for row in record["sustained"]] == [(4096, False), (4096, True), (8192, False),
                                                                           (8192, True)]
    assert record["sustained"][0] == done and calls == [2, 2, 2]
    assert [row["flashtrain_fwd_sustained"] for row in record["sustained"]] == [610.0, 501.0, 502.0, 503.0]
    assert record["sustained"][3]["ft_over_fa4_fb"] == 1.0
    assert record["env"]["date"] == "2026-12-03T08:00:00+00:00" and len(record["env"]["resumed"]) == 1
    assert attention.run_grid(args, env, out) == "1 grid rows\n\n4 sustained rows" and calls == [2, 2, 2]
    with pytest.raises(SystemExit, match="commit 'abc1234'"):
        attention.run_grid(args, {**env, "commit": "def5678"}, out)
    with pytest.raises(SystemExit, match="settings"):
        attention.run_grid(argparse.Namespace(**{**vars(args), "sustained": 5.0}), env, out)

    workloads = tmp_path / "attention_workloads.json"
    rows = [{"name": "hd64 4K causal", "flashtrain_fwd": 516.0, "ratio_fwd": 1.18}]
    workloads.write_text(json.dumps({"env": env, "settings": {"repeats": 30, "rounds": 3, "timing": "interleaved"},
                                     "rows": rows, "features": [], "complete": False}))
    monkeypatch.setattr(attention_features, "run",
                        lambda repeats, rounds: [{"name": "window 1024 at 16K", "vs_fa4_fwd": 1.02, "repeats": repeats}])
    monkeypatch.setattr(attention_features, "markdown", lambda rows, fa4="": f"{len(rows)} feature rows")
    assert attention.run_workloads(args, env, workloads) == "1 workload rows\n\n1 feature rows"
    record = json.loads(workloads.read_text())
    assert record["complete"] and record["rows"] == rows and len(record["env"]["resumed"]) == 1
    assert record["features"] == [{"name": "window 1024 at 16K", "vs_fa4_fwd": 1.02, "repeats": 30}]



@pytest.mark.parametrize("script,argv", [("attention", ["--all", "--require-fa4"]),
                                         ("attention_features", ["--require-fa4"])])
def test_require_fa4_stops_before_measuring(script, argv, monkeypatch):
    """--require-fa4 where flash-attn-4 cannot be imported: SystemExit naming the option, the import error and how to
    keep FA4's PYTHONPATH, before the benchmark touches the GPU (torch.cuda is never asked for the device name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import importlib

    import fa4_baseline
    module = importlib.import_module(script)
    monkeypatch.setattr(fa4_baseline, "import_error", lambda: "ModuleNotFoundError: No module named 'flash_attn'")
    monkeypatch.setattr(module.torch.cuda, "get_device_name",
                        lambda *_: pytest.fail("measured without FA4 although --require-fa4 was given"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit, match=r"--require-fa4: flash-attn-4 cannot be imported "
                                         r"\(ModuleNotFoundError: No module named 'flash_attn'\).*PYTHONPATH"):
        module.main()


def test_require_fa4_returns_the_version_where_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import fa4_baseline

    monkeypatch.setattr(fa4_baseline, "import_error", lambda: None)
    monkeypatch.setattr(fa4_baseline, "version", lambda: "4.0.0b36")
    assert fa4_baseline.require() == "4.0.0b36"
