"""benchmarks/listops_variants.py on the CPU: two variants through real launch.py processes on a tiny ListOps
split; the JSON holds each run's numbers from its metrics.jsonl."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.min_length=10", "data.max_length=200", "data.max_depth=4", "data.num_proc=1", "model.n_layer=1",
        "model.d_model=16", "model.n_head=2", "model.d_ff=16", "model.max_len=300", "trainer.micro_batch_size=8",
        "trainer.global_batch_size=null", "optim.warmup_steps=1"]


@pytest.mark.slow
def test_two_variants_run_through_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("listops_variants", ROOT / "benchmarks" / "listops_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {"dense", "linformer", "bigbird", "performer"} <= set(module.PRESETS)
    path = module.main(["--variants", "dense", "performer", "--steps", "4", "--n-train", "64", "--n-eval", "16",
                        "--override", *TINY, "--out", str(tmp_path)])
    result = json.loads(path.read_text())
    assert path.name == "listops_variants-cpu.json" and path.with_suffix(".png").exists()
    assert [r["variant"] for r in result["rows"]] == ["dense", "performer"]
    for row in result["rows"]:
        assert row["returncode"] == 0 and row["steps"] == 4, row
        assert math.isfinite(row["train_loss"]) and 0 <= row["test_accuracy"] <= 1
        assert row["tokens_per_s"] > 0
        assert (tmp_path / "runs" / row["variant"] / "metrics.jsonl").exists()
