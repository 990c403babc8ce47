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
