"""Adding a model is one file and one config file: a model defined under tests/ trains through launch.py, with no
edit to the trainer, the tasks or the weight loader, and its run exports as a transformers model through the Hugging
Face adapter that file registers, with no edit to flashtrain.export. It defines no generate(): the run ends with a note
instead of a sample. init_from=hf:DIR starts a run from its export through the same adapter, and LongToyLM, which
defines load_pretrained() and extend_positions(), starts a longer-context run from the toy run's checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtrain.train.trainer import read_metrics

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "FLASHTRAIN_PLUGINS": "toy_model", "PYTHONPATH": str(ROOT / "tests"), "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def launch(cache_dir: Path, run_dir: Path, *overrides: str) -> str:
    """A toy run through launch.py on the toy's data (cached in cache_dir); returns its stdout (exit status 0)."""
    overrides = ["hydra.searchpath=[file://tests/conf]", "model=toy", "logger=none", "name=toy",
                 "data.max_bytes=300000", "data.val_fraction=0.1", "data.vocab_size=512", "data.num_proc=1",
                 f"data.cache_dir={cache_dir}", "data.sample_tokens=8", "trainer.micro_batch_size=8",
                 "trainer.max_steps=30", "trainer.log_interval=5", "trainer.eval_interval=15",
                 "data.val_samples=32", "trainer.save_interval=30", "optim.lr=3e-3", "optim.warmup_steps=5",
                 f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run([sys.executable, "launch.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def val_ppl(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["val_ppl"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_ppl" in r}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("toy")
    run_dir = tmp_path / "run"
    return run_dir, launch(tmp_path / "cache", run_dir)


@pytest.fixture(scope="module")
def toy_export(toy_run, tmp_path_factory):
    """The toy run exported by `python -m flashtrain.export`: a transformers GPT-2 directory."""
    run_dir, _ = toy_run
    out_dir = tmp_path_factory.mktemp("toy_export") / "hf"
    proc = subprocess.run([sys.executable, "-m", "flashtrain.export", str(run_dir), str(out_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out_dir


@pytest.mark.slow
def test_toy_model_trains_through_launch(toy_run):
    run_dir, stdout = toy_run
    assert "model: ToyConfig" in stdout and "attention: flash -> reference" in stdout
    ppl = val_ppl(run_dir)
    assert list(ppl) == [0, 15, 30]
    assert ppl[0] > 400 and ppl[30] < 0.5 * ppl[0], ppl  # from about the vocabulary size (512) to well below
    assert (run_dir / "checkpoints" / "step_00000030" / "model.safetensors").is_file()


def test_toy_lm_without_generate_ends_with_a_note_instead_of_a_sample(toy_run):
    """LM data asks for an 8-token sample (data.sample_tokens=8); the toy defines no generate(): the run still ends
    with exit status 0 (the fixture's check), its checkpoint and logs, and says why there is no sample."""
    _, stdout = toy_run
    assert "sample skipped: ToyLM defines no generate()\ncheckpoint: " in stdout
    assert "---- sample ----" not in stdout


def test_toy_run_exports_through_its_own_adapter(toy_run, toy_export):
    """The adapter registered in tests/toy_model.py makes the run a transformers GPT-2 of one layer: RUN_DIR/hf/ at
    the start of the run, `python -m flashtrain.export` after it; the same logits and greedy continuation."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import toy_model  # noqa: F401  (registers the schema and the adapter in this process, as FLASHTRAIN_PLUGINS does)
    from flashtrain.export import load_run

    run_dir, _ = toy_run
    hf_config = AutoConfig.from_pretrained(run_dir / "hf")
    assert (hf_config.model_type, hf_config.n_layer, hf_config.n_embd, hf_config.activation_function) == \
        ("gpt2", 1, 64, "gelu")
    out_dir = toy_export
    run = load_run(run_dir, attn_impl="reference")  # a strict load of the checkpoint (the tied head saved once)
    assert type(run.model).__name__ == "ToyLM" and run.model.head.weight is run.model.tok_emb.weight
    hf_model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    input_ids = torch.tensor([tokenizer("def parse(text):\n    return")["input_ids"]])
    with torch.no_grad():
        ours, theirs = run.model(input_ids)[0], hf_model(input_ids).logits
        assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, ours.abs().max().item())
        greedy = input_ids
        for _ in range(12):  # the toy has no generate(): argmax over the whole context
            greedy = torch.cat([greedy, run.model(greedy)[0][:, -1:].argmax(-1)], dim=1)
    theirs = hf_model.generate(input_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               repetition_penalty=1.0, attention_mask=torch.ones_like(input_ids))  # (1.3 exported)
    assert theirs.tolist() == greedy.tolist()


@pytest.mark.slow
def test_toy_run_starts_from_its_export_through_the_adapter(toy_run, toy_export, tmp_path):
    """init_from=hf:DIR for a model registered only through its Hugging Face adapter (ToyLM defines no
    load_pretrained): the new run's validation perplexity before its first step is the source run's last."""
    run_dir, _ = toy_run
    new_dir = tmp_path / "from_hf"
    stdout = launch(run_dir.parent / "cache", new_dir, f"init_from=hf:{toy_export}", "trainer.max_steps=1")
    assert f"initialised from hf:{toy_export}\n" in stdout
    assert val_ppl(new_dir)[0] == pytest.approx(val_ppl(run_dir)[30], rel=1e-5)


@pytest.mark.slow
def test_long_toy_starts_from_the_toy_run_with_its_positions_extended(toy_run, tmp_path):
    """model.extendable=true (LongToyLM) defines load_pretrained() and extend_positions(): a 256-position run from the
    128-position toy run's newest checkpoint, its table repeated; on the same 128-token data, the source run's last
    perplexity."""
    run_dir, _ = toy_run
    new_dir = tmp_path / "long"
    stdout = launch(run_dir.parent / "cache", new_dir, "model.extendable=true", "model.n_positions=256",
                    "data.seq_len=128", f"init_from={run_dir}", "trainer.max_steps=1")
    assert f"initialised from {run_dir / 'checkpoints' / 'step_00000030'}, positions extended 128 -> 256 " \
           "(repeat)\n" in stdout
    assert val_ppl(new_dir)[0] == pytest.approx(val_ppl(run_dir)[30], rel=1e-5)
