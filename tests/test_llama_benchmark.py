"""benchmarks/train_llama.py on the CPU (its --tiny smoke configuration): every implementation's step runs, flashtrain's
Llama and transformers' LlamaForCausalLM built with the same sizes have the same parameter count, and the FLOPs per
token are 6 N + 12 L T d."""

import json
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_train_llama_smoke(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import train_llama

    out = tmp_path / "llama.json"
    train_llama.main(["--device", "cpu", "--tiny", "--configs", "tiny:64", "--impls", "flashtrain", "flashtrain-sdpa",
                      "hf-sdpa", "hf-eager", "--warmup", "1", "--steps", "2", "--out", str(out)])
    rows = {row["impl"]: row for row in json.loads(out.read_text())["rows"]}
    assert all(row["status"] == "ok" for row in rows.values()), {k: r["status"] for k, r in rows.items()}
    n_layer, width = train_llama.MODEL_SHAPES["tiny"][:2]
    counts = {row["n_params"] for row in rows.values()}
    assert len(counts) == 1, counts  # the same model in both libraries
    assert rows["flashtrain"]["flops_per_token"] == 6 * counts.pop() + 12 * n_layer * 64 * width
    assert rows["flashtrain"]["speedup_vs_hf-sdpa"] > 0 and out.with_suffix(".png").is_file()
