"""benchmarks/attention_zoo.py on the CPU: its smallest configuration end to end (every method, both default
settings, the JSON and both plots), the out-of-memory stop, FlexAttention's block mask against the definition, the
file names, and that it loads without hydra."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "attention_zoo.py"


@pytest.fixture(scope="module")
def zoo():
    spec = importlib.util.spec_from_file_location("attention_zoo", SCRIPT)
    module = sys.modules["attention_zoo"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["attention_zoo"]


SMALLEST = ["--device", "cpu", "--max-len", "128", "--batch", "4", "--heads", "2", "--warmup", "1", "--repeats", "1"]


@pytest.mark.slow
def test_smallest_configuration_on_the_cpu(zoo, tmp_path):
    paths = zoo.main([*SMALLEST, "--out", str(tmp_path)])
    assert [p.name for p in paths] == ["attention_zoo-cpu.json", "attention_zoo-cpu-runtime.png",
                                       "attention_zoo-cpu-memory.png"]
    for png in paths[1:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(paths[0].read_text())
    assert result["env"]["device"] == "cpu" and result["env"]["torch"] == torch.__version__
    assert result["env"]["date"].startswith("20") and result["env"]["gpu"] is None
    assert result["config"]["seqlens"] == [128] and result["config"]["settings"] == ["plain", "dropout+padding"]
    rows = {(r["setting"], r["method"]): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) == 2 * len(result["methods"]) == 2 * 16
    ran = {"flashtrain", "naive", "flashtrain-longformer", "flashtrain-bigbird", "flashtrain-butterfly", "linformer",
           "linformer-n8", "performer", "local", "lsh"}
    for setting in ("plain", "dropout+padding"):
        for method in ran:
            row = rows[setting, method]
            assert row["status"] == "ok", row
            assert all(isinstance(row[f"{p}_ms"], float) and 0 < row[f"{p}_ms"] < 60_000 for p in zoo.PASSES), row
            assert row["fwd_peak_mib"] is None and row["fb_peak_mib"] is None  # not measured on the CPU
        for layout in zoo.LAYOUTS:  # skipped, with the reason
            assert rows[setting, f"flex-{layout}"]["status"].startswith("skipped: FlexAttention has no backward")
    assert rows["plain", "sdpa-flash"]["status"] == "ok"  # PyTorch's CPU flash kernel
    assert rows["plain", "sdpa-cudnn"]["status"].startswith("error: RuntimeError")  # CUDA only
    assert {r["family"] for r in result["rows"]} == {"exact", "sparse", "approximate"}
    assert any("fastest sparse/approximate" in line for line in result["summary"])


@pytest.mark.slow  # (two zoo runs and their merge, ~7 s on 2 cores)
def test_split_runs_merge_into_one_result(zoo, tmp_path):
    """Two runs split by --settings / --methods (as a machine's time limit needs) merge into the result one run of both
    would give: every cell once, in setting / method / N order; --partial keeps the cells of a run as it goes."""
    small = ["--device", "cpu", "--min-len", "64", "--max-len", "128", "--batch", "2", "--heads", "2",
             "--warmup", "0", "--repeats", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    partial = tmp_path / "partial.json"
    zoo.main([*small, "--settings", "plain", "--methods", "flashtrain,linformer", "--out", str(a),
              "--partial", str(partial)])
    zoo.main([*small, "--settings", "plain,dropout", "--methods", "naive,flashtrain", "--out", str(b)])
    assert [(r["method"], r["seqlen"]) for r in json.loads(partial.read_text())["rows"]] == [
        ("flashtrain", 64), ("flashtrain", 128), ("linformer", 64), ("linformer", 128)]
    paths = zoo.main(["--merge", str(a / "attention_zoo-cpu.json"), str(b / "attention_zoo-cpu.json"),
                      "--out", str(tmp_path / "m")])
    merged = json.loads(paths[0].read_text())
    assert merged["config"]["settings"] == ["plain", "dropout"]
    assert list(merged["methods"]) == ["flashtrain", "linformer", "naive"]
    keys = [(r["setting"], r["method"], r["seqlen"]) for r in merged["rows"]]
    assert keys == [("plain", m, n) for m in ("flashtrain", "linformer", "naive") for n in (64, 128)] + [
        ("dropout", m, n) for m in ("flashtrain", "naive") for n in (64, 128)]
    later = json.loads((b / "attention_zoo-cpu.json").read_text())["rows"]
    assert merged["rows"][0] == next(r for r in later if r["method"] == "flashtrain" and r["seqlen"] == 64)
    assert [m["methods"] for m in merged["config"]["merged_from"]] == [["flashtrain", "linformer"],
                                                                      ["naive", "flashtrain"]]
    assert all(p.exists() for p in paths[1:])
    mismatched = json.loads((b / "attention_zoo-cpu.json").read_text())
    mismatched["config"]["head_dim"] = 128
    (tmp_path / "x.json").write_text(json.dumps(mismatched))
    with pytest.raises(SystemExit, match="head_dim"):
        zoo.main(["--merge", str(a / "attention_zoo-cpu.json"), str(tmp_path / "x.json"), "--out", str(tmp_path)])


def test_out_of_memory_stops_the_method(zoo, tmp_path, monkeypatch):
    """An OOM at N = 256 is recorded and the method's longer lengths are skipped; the other methods go on."""
    def build(case):
        if case.seqlen >= 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        q, k, v, dout = case.qkv_dout("bhnd")
        return (lambda q, k, v: q * k + v), (q, k, v), dout

    methods = {"fake": zoo.Method("exact", build), "naive": zoo.Method("exact", zoo.naive_build)}
    monkeypatch.setattr(zoo, "build_methods", lambda: methods)
    result = zoo.run(zoo.parse_args([*SMALLEST, "--max-len", "512", "--settings", "plain"]))
    status = {(r["method"], r["seqlen"]): r["status"] for r in result["rows"]}
    assert status == {("fake", 128): "ok", ("fake", 256): "OOM", ("fake", 512): "skipped: out of memory at N=256",
                      ("naive", 128): "ok", ("naive", 256): "ok", ("naive", 512): "ok"}


def test_flex_block_mask_is_the_layout_and_the_padding(zoo):
    """flex_attention (eager, forward: what the CPU has) with the BlockMask built from a BigBird layout and padded
    lengths equals softmax attention over the keys that the layout and the lengths allow, written per token."""
    case = zoo.Case(batch=2, seqlen=640, heads=2, head_dim=16, dtype=torch.float32, device=torch.device("cpu"),
                    setting=zoo.SETTINGS["padding"])
    lengths = case.lengths
    assert all(620 <= n <= 640 for n in lengths) and lengths != [640, 640]
    layout = zoo.LAYOUTS["bigbird"].block_mask(640)  # (5, 5)
    block_mask = zoo.flex_block_mask(layout, case)
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 640, 16, generator=g) for _ in range(3))
    with pytest.warns(UserWarning, match="without torch.compile"):
        out = flex_attention(q, k, v, block_mask=block_mask)
    i = torch.arange(640)
    allowed = layout[i[:, None] // 128, i[None, :] // 128]  # (N, N)
    for b, n in enumerate(lengths):
        visible = allowed & (i[None, :] < n)
        scores = (q[b] @ k[b].transpose(-1, -2) / math.sqrt(16)).masked_fill(~visible, -math.inf)
        torch.testing.assert_close(out[b], torch.softmax(scores, -1) @ v[b], atol=1e-5, rtol=1e-5)


def test_device_tags(zoo):
    tags = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100",
            "NVIDIA L40S": "l40s", "NVIDIA GeForce RTX 4090": "nvidia_geforce_rtx_4090"}
    for gpu, tag in tags.items():
        assert zoo.device_tag({"gpu": gpu}) == tag
    assert zoo.device_tag({"gpu": None}) == "cpu"


def test_loads_without_hydra():
    # the GPU machine may have none of them: the module must load with their imports failing
    code = ("import sys, importlib.util\n"
            "for name in ('hydra', 'omegaconf', 'datasets', 'wandb', 'accelerate', 'transformers'):\n"
            "    sys.modules[name] = None\n"
            f"spec = importlib.util.spec_from_file_location('zoo', {str(SCRIPT)!r})\n"
            "module = sys.modules['zoo'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_sparse_layouts_are_the_model_presets(zoo):
    """The benchmark's block masks are those that `model/attention=NAME` gives the LRA encoder."""
    from hydra_config import compose_config

    for name, layout in zoo.LAYOUTS.items():
        assert compose_config(["name=x", "recipe=listops", f"model/attention={name}"]).model.attention == layout
