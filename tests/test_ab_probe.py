"""benchmarks/probes/ab_probe.py's CPU side: the sustained mode's rounds (alternating order, mean of the rounds) and
its argument checks."""

import pathlib
import subprocess
import sys

import pytest

PROBES = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "probes"


@pytest.fixture
def ab_probe(import_probe):
    return import_probe("ab_probe")


def test_sustained_rounds_alternate_and_average(ab_probe, monkeypatch):
    import attention

    order, ms = [], {"a": [2.0, 4.0], "b": [1.0, 1.0]}

    def fake_sustained_ms(call, seconds):
        name = call()
        order.append(name)
        assert seconds == 0.5
        return ms[name][sum(n == name for n in order) - 1]

    monkeypatch.setattr(attention, "sustained_ms", fake_sustained_ms)
    measured = ab_probe.sustained_measure({"a": lambda: "a", "b": lambda: "b"}, 4e12, 0.5, 2)
    assert order == ["a", "b", "b", "a"]  # the second round in reverse order
    # 4e12 FLOPs in 2 ms and 4 ms: 2000 and 1000 TFLOP/s, mean 1500; b: 4000 both rounds; no clocks unless asked
    assert measured == {"a": pytest.approx({"tflops": 1500.0}), "b": pytest.approx({"tflops": 4000.0})}


@pytest.mark.slow  # (a python process each, importing torch)
@pytest.mark.parametrize("args", [["--sustained", "-1"], ["--sustained", "1", "--rounds", "0"]])
def test_sustained_arguments_are_checked(args):
    result = subprocess.run([sys.executable, str(PROBES / "ab_probe.py"), *args], capture_output=True, text=True,
                            timeout=120, cwd=PROBES.parents[1],
                            env={"PYTHONPATH": str(PROBES.parents[1]), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "--sustained must be >= 0 and --rounds >= 1" in result.stderr


def test_sustained_clocks_are_sampled_per_run_and_averaged(ab_probe, monkeypatch):
    """--clocks: each run's steady-state samples (after the first quarter) give its SM clock and power; the rounds'
    values are averaged like the TFLOP/s."""
    import contextlib

    import attention

    samples = {"a": [[[900.0, 100.0, 40.0]] + [[1600.0, 680.0, 60.0]] * 3, [[1700.0, 690.0, 61.0]] * 4],
               "b": [[[1500.0, 700.0, 62.0]] * 4, [[1500.0, 700.0, 62.0]] * 4]}
    runs = []

    @contextlib.contextmanager
    def fake_smi_samples():
        rows = []
        yield rows
        name = runs[-1]
        rows += samples[name][sum(n == name for n in runs) - 1]

    def fake_sustained_ms(call, seconds):
        runs.append(call())
        return 2.0

    monkeypatch.setattr(attention, "sustained_ms", fake_sustained_ms)
    import gpu_clocks

    monkeypatch.setattr(gpu_clocks, "smi_samples", fake_smi_samples)
    measured = ab_probe.sustained_measure({"a": lambda: "a", "b": lambda: "b"}, 4e12, 0.5, 2, clocks=True)
    assert runs == ["a", "b", "b", "a"]
    # a: the first run's first sample (a quarter of 4) is dropped: 1600 MHz / 680 W, then 1700 / 690; means
    assert measured["a"] == pytest.approx({"tflops": 2000.0, "sm_mhz": 1650.0, "watts": 685.0})
    assert measured["b"] == pytest.approx({"tflops": 2000.0, "sm_mhz": 1500.0, "watts": 700.0})


def test_steady_state_without_samples_is_an_error(ab_probe):
    import gpu_clocks

    with pytest.raises(RuntimeError, match="no clock / power samples"):
        gpu_clocks.steady_state([])


@pytest.mark.slow  # (a python process, importing torch)
def test_clocks_need_sustained():
    result = subprocess.run([sys.executable, str(PROBES / "ab_probe.py"), "--clocks"], capture_output=True, text=True,
                            timeout=120, cwd=PROBES.parents[1],
                            env={"PYTHONPATH": str(PROBES.parents[1]), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "--clocks needs --sustained SECONDS" in result.stderr


def test_tagged_copy_runs_the_same_variant(ab_probe):
    assert ab_probe.variant_spec("flashtrain#2") == "flashtrain"
    assert ab_probe.variant_spec("flashtrain+FT_X=1@build.Y=2#b") == "flashtrain+FT_X=1@build.Y=2"
    assert ab_probe.variant_spec("cudnn") == "cudnn"


def test_tile_table_variables_take_effect_and_are_undone(ab_probe):
    """flashtrain@FLASHTRAIN_FWD_SM90_TILES=... / @FLASHTRAIN_BWD_SM90_TILES=... (read by build at import) re-read the
    tile tables for the variant's capture and restore them after: the hd128 backward on one CTA per tile (`_grid`)."""
    from flashtrain.kernels import build

    def bwd_name():
        return build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, seqlen_q=512).name

    before, fwd_before = bwd_name(), build.FWD_SM90_TILES[64]
    with ab_probe.env_variant("flashtrain@FLASHTRAIN_BWD_SM90_TILES=128=64x2x0@FLASHTRAIN_FWD_SM90_TILES=64=128x64x2"):
        assert "_grid" not in before and bwd_name().replace("_grid", "", 1) == before and "_grid" in bwd_name()
        assert (build.FWD_SM90_TILES[64].block_m, build.FWD_SM90_TILES[64].block_n) == (128, 64)
    assert bwd_name() == before and build.FWD_SM90_TILES[64] == fwd_before


def test_variant_is_active_inside_and_undone_after(ab_probe, monkeypatch):
    """ab_probe.variant (ab_probe's captures and ncu_probe.py's profiled calls): a flashtrain implementation's `@`
    settings hold inside it, the defaults after; its `+` macros reach the kernel builds (FLASHTRAIN_EXTRA_DEFINES)."""
    import os

    from flashtrain.kernels import build

    monkeypatch.delenv("FLASHTRAIN_EXTRA_DEFINES", raising=False)
    before = build.FWD_SM90_CLUSTER
    with ab_probe.variant("flashtrain+FT_FWD_STATIC=1@build.FWD_SM90_CLUSTER=0"):
        assert build.FWD_SM90_CLUSTER == 0 and build._extra_defines() == ("FT_FWD_STATIC=1",)
    assert build.FWD_SM90_CLUSTER == before and "FLASHTRAIN_EXTRA_DEFINES" not in os.environ


def test_ncu_probe_profiles_each_variant_inside_it(ab_probe, monkeypatch):
    """ncu_probe.py runs each flashtrain implementation's warm-up and profiled calls inside its variant (`@` / `+`
    settings, a `#tag` dropped), and other implementations without one."""
    import torch

    from flashtrain.kernels import build

    import ncu_probe

    seen = []

    def attention_call(name, config, kind):
        def call():
            seen.append((name, build.FWD_SM90_CLUSTER))
        return call, None

    monkeypatch.setattr(ncu_probe, "attention_call", attention_call)
    for fn in ("synchronize",):
        monkeypatch.setattr(torch.cuda, fn, lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: None)
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)
    monkeypatch.setattr(sys, "argv", ["ncu_probe.py", "--impls", "flashtrain", "flashtrain@build.FWD_SM90_CLUSTER=0#b",
                                      "cudnn", "--config", "128:16384:full"])
    ncu_probe.main()
    assert seen == ([("flashtrain", 1)] * 4 + [("flashtrain@build.FWD_SM90_CLUSTER=0", 0)] * 4 + [("cudnn", 1)] * 4)


def test_explicit_fa4_stops_where_it_cannot_be_imported(ab_probe, monkeypatch):
    """--impls fa4 names FA4: where it cannot be imported the probe stops before allocating anything."""
    import fa4_baseline

    monkeypatch.setattr(fa4_baseline, "import_error", lambda: "ModuleNotFoundError: No module named 'flash_attn'")
    with pytest.raises(SystemExit, match=r"--impls fa4: flash-attn-4 cannot be imported"):
        ab_probe.attention_call("fa4", ab_probe.Config.parse("64:512:causal"), "fwd")


@pytest.mark.parametrize("probe", ["ab_probe", "ncu_probe", "pass_kernels_probe", "clock_probe"])
def test_probes_check_fa4_before_building_anything(probe, import_probe, monkeypatch):
    """A probe given fa4 (or fa4#tag) among its implementations stops before it builds or measures any of them."""
    module = import_probe(probe)
    import fa4_baseline

    monkeypatch.setattr(fa4_baseline, "import_error", lambda: "ModuleNotFoundError: No module named 'flash_attn'")
    monkeypatch.setattr(module.torch.cuda, "synchronize", lambda *_: pytest.fail("ran before the FA4 check"))
    monkeypatch.setattr(module.torch, "randn", lambda *a, **k: pytest.fail("allocated before the FA4 check"))
    monkeypatch.setattr(sys, "argv", [f"{probe}.py", "--impls", "flashtrain", "fa4#2"])
    with pytest.raises(SystemExit, match=r"--impls fa4: flash-attn-4 cannot be imported"):
        module.main()


def test_row_record_ratios_and_printed_line(ab_probe):
    """A configuration's record: TFLOP/s per implementation, the flashtrain variants' ratios to the first and to cuDNN
    (none for cuDNN itself), the same numbers in the printed line."""
    tflops = {"flashtrain": 500.0, "flashtrain#2": 501.0, "flashtrain+FT_X=1": 550.0, "cudnn": 400.0}
    row = ab_probe.row_record(tflops)
    assert row["tflops"] == tflops
    assert row["over_first"] == {"flashtrain#2": 1.002, "flashtrain+FT_X=1": 1.1}
    assert row["over_cudnn"] == {"flashtrain": 1.25, "flashtrain#2": 1.252, "flashtrain+FT_X=1": 1.375}
    assert "sm_mhz" not in row
    line = ab_probe.row_line("hd128 S4096 causal B4 bwd", tflops, row)
    assert line.startswith("hd128 S4096 causal B4 bwd TFLOP/s flashtrain  500.0")
    assert "/flashtrain: flashtrain+FT_X=1 1.100" in line and "flashtrain+FT_X=1/cudnn 1.375" in line
    assert "cudnn/cudnn" not in line
    # without cuDNN no such ratios; with --clocks each implementation's clock and power
    measured = {"flashtrain": {"tflops": 600.0, "sm_mhz": 1601.4, "watts": 690.2},
                "flashtrain+FT_X=1": {"tflops": 630.0, "sm_mhz": 1650.0, "watts": 689.0}}
    row = ab_probe.row_record({name: m["tflops"] for name, m in measured.items()}, measured)
    assert "over_cudnn" not in row and row["over_first"] == {"flashtrain+FT_X=1": 1.05}
    assert row["sm_mhz"] == {"flashtrain": 1601, "flashtrain+FT_X=1": 1650}
    assert row["watts"] == {"flashtrain": 690, "flashtrain+FT_X=1": 689}


def test_json_record_is_written_after_each_configuration(ab_probe, monkeypatch, tmp_path):
    """--json: the record holds the run's settings and one row per configuration, written as each one finishes (a run
    cut after the first configuration keeps it)."""
    import json
    import types

    out = tmp_path / "ab.json"
    seen = []

    class FakeGraph:
        def replay(self):
            pass

    def fake_capture(name, config, kind):
        return FakeGraph()

    def fake_interleaved(replays, repeats):
        if seen:  # the first configuration's row is on disk before the second one is measured
            assert list(json.loads(out.read_text())["rows"]) == ["hd128 S4096 causal B4"]
        seen.append(repeats)
        return {"flashtrain": [2e-3] * 3, "flashtrain+FT_X=1": [1.6e-3] * 3}  # seconds

    monkeypatch.setattr(ab_probe, "capture", fake_capture)
    monkeypatch.setattr(ab_probe, "time_interleaved", fake_interleaved)
    monkeypatch.setattr(ab_probe.torch, "cuda", types.SimpleNamespace(
        get_device_name=lambda: "Fake GPU",
        get_device_properties=lambda device: types.SimpleNamespace(L2_cache_size=50 << 20)))
    monkeypatch.setattr(ab_probe.gpu_clocks, "board", lambda: {"driver": "1.0", "power_limit_w": 700})
    monkeypatch.setattr(ab_probe.sys, "argv", ["ab_probe.py", "--impls", "flashtrain", "flashtrain+FT_X=1", "--pass",
                                               "bwd", "--repeats", "3", "--configs", "128:4096:causal",
                                               "64:16384:full", "--json", str(out)])
    ab_probe.main()
    record = json.loads(out.read_text())
    assert seen == [3, 3]
    assert record["gpu"] == "Fake GPU" and record["power_limit_w"] == 700 and record["pass"] == "bwd"
    assert record["l2_mb"] == 50 and record["small_l2_dispatch"] is True
    assert record["what"].startswith("benchmarks/probes/ab_probe.py --impls flashtrain flashtrain+FT_X=1")
    assert record["timing"] == "interleaved CUDA-graph replays, median of 3"
    assert list(record["rows"]) == ["hd128 S4096 causal B4", "hd64 S16384 full B1"]
    row = record["rows"]["hd64 S16384 full B1"]
    # 4 * 1 * 32 * 16384^2 * 64 FLOPs x 2.5 (backward) in 2.0 ms and 1.6 ms
    flops = 4 * 32 * 16384**2 * 64 * 2.5
    assert row["tflops"] == {"flashtrain": round(flops / 2e9, 1), "flashtrain+FT_X=1": round(flops / 1.6e9, 1)}
    assert row["over_first"] == {"flashtrain+FT_X=1": 1.25}


def test_gated_kernels_check_variants_are_what_they_name(ab_probe, monkeypatch):
    """benchmarks/probes/gated_kernels_check.sh's implementations, as its A/Bs run them: the hd64 forward in clusters
    at 16K, and at 4K with its threshold lowered (one CTA per tile without the switch); for the tail split the
    whole-tile kernels, the backward's split with the cost model's piece count, and capped at 4 and 8 pieces; on the
    hd64 16K row (4096 tiles on 132 SMs, 128 query blocks each) the last wave's 4 tiles in 16, 4 and 8 pieces, and no
    split without the switch. Its tail-split configurations are the dense hd64 / hd128 rows, and each is split by the
    cost model."""
    import re

    from flashtrain.kernels import build, ops

    for name, value in (("FWD_SM90_CLUSTER", 1), ("FWD_SM90_CLUSTER_HD64", 0), ("BWD_TAIL_SPLIT", 0)):
        monkeypatch.setattr(build, name, value)  # (the defaults, whatever the environment says)

    script = (PROBES / "gated_kernels_check.sh").read_text()
    clusters = re.search(r"^clusters=(\S+)$", script, re.M).group(1)
    assert clusters == "flashtrain@build.FWD_SM90_CLUSTER_HD64=1"
    assert f'"$clusters@build.FWD_SM90_CLUSTER_SEQLEN=4096"' in script
    for name, cluster_16k, cluster_4k in (("flashtrain", 1, 1), (clusters, 2, 1),
                                          (f"{clusters}@build.FWD_SM90_CLUSTER_SEQLEN=4096", 2, 2)):
        with ab_probe.env_variant(name):
            assert [build.fwd_kernel(64, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=n,
                                     seqlen_k=n).tiles.cluster for n in (16384, 4096)] == [cluster_16k, cluster_4k]
    split = re.search(r"^split=(\S+)$", script, re.M).group(1)
    names = [name.replace("$split", split) for name in re.findall(r'"(\$split[^"]*)"', script)]
    assert [split, *names] == ["flashtrain@build.BWD_TAIL_SPLIT=1", "flashtrain@build.BWD_TAIL_SPLIT=1",
                               "flashtrain@build.BWD_TAIL_SPLIT=1@ops.TAIL_MAX_PIECES=4",
                               "flashtrain@build.BWD_TAIL_SPLIT=1@ops.TAIL_MAX_PIECES=8"]
    with ab_probe.env_variant("flashtrain"):  # (no split without the switch: the whole-tile kernel)
        assert not build.bwd_tail_split(build.bwd_sm90_kernel(64, "bf16", False, seqlen_q=16384))
    chosen = []
    for name in names:
        with ab_probe.env_variant(name):
            assert build.BWD_TAIL_SPLIT == 1
            chosen.append(ops._tail_split(4096, 132, 128))
    assert chosen == [(4092, 16), (4092, 4), (4092, 8)]
    assert build.BWD_TAIL_SPLIT == 0 and ops.TAIL_MAX_PIECES == 32  # (undone after each variant)
    rows = re.search(r"^bwd_rows=\((.*)\)$", script, re.M).group(1).split()
    for row in rows:
        config = ab_probe.Config.parse(row)
        assert not config.causal and config.head_dim in (64, 128)
        tiles = build.bwd_kernel(config.head_dim, "bf16", False, False, arch=build.SM90_ARCH,
                                 seqlen_q=config.seqlen).tiles
        n_tiles = config.batch * config.nheads_kv * -(-config.seqlen // tiles.block_n)
        assert ops._tail_split(n_tiles, 132, -(-config.seqlen // tiles.block_m))[1] > 1, row
