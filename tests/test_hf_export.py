"""Hugging Face out: a tiny run trained through launch.py, exported with `python -m flashtrain.export`, reloaded with
transformers' Auto classes offline: same logits, same greedy continuation, same tokenizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtrain.export import export, load_run
from test_train import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A 20-step tiny GPT-2 run started as a user starts one (launch.py writes .hydra/config.yaml)."""
    cache_dir = tmp_path_factory.mktemp("export-cache")
    run_dir = tmp_path_factory.mktemp("export") / "run"
    proc = subprocess.run([sys.executable, "launch.py", *tiny_overrides(cache_dir), "trainer.max_steps=20",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_gpt2_export_reloads_with_transformers(gpt2_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "flashtrain.export", str(gpt2_run), str(out_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= \
        {p.name for p in out_dir.iterdir()}

    run = load_run(gpt2_run, attn_impl="reference")
    hf_model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert type(hf_model).__name__ == "GPT2LMHeadModel" and hf_tokenizer.is_fast

    text = "def main(argv):\n    return sorted(argv)\n"
    ids = hf_tokenizer(text)["input_ids"]
    assert ids == run.tokenizer(text)["input_ids"] and hf_tokenizer.decode(ids) == text
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        ours = run.model(input_ids)[0]
        theirs = hf_model(input_ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, ours.abs().max().item())

    n_new = 24
    greedy_ours = run.model.generate(input_ids, max_new_tokens=n_new, temperature=0.0)
    greedy_theirs = hf_model.generate(input_ids, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new,
                                      attention_mask=torch.ones_like(input_ids))
    assert greedy_ours.tolist() == greedy_theirs.tolist()

    generation = GenerationConfig.from_pretrained(out_dir)
    assert generation.eos_token_id == hf_tokenizer.eos_token_id == hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
