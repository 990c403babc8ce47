"""Hugging Face out: a tiny run trained through launch.py, exported with `python -m flashtrain.export`, reloaded with
transformers' Auto classes offline: same logits, same greedy continuation, same tokenizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtrain.export import export, load_run
from flashtrain.models.gpt2 import SAMPLING
from test_train import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A 20-step tiny GPT-2 run started as a user starts one (launch.py writes .hydra/config.yaml)."""
    cache_dir = tmp_path_factory.mktemp("export-cache")
    run_dir = tmp_path_factory.mktemp("export") / "run"
    overrides = [o for o in tiny_overrides(cache_dir) if o != "name=test"]  # name: ${hydra:runtime.choices.recipe}
    proc = subprocess.run([sys.executable, "launch.py", *overrides, "trainer.max_steps=20",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
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
                                      repetition_penalty=1.0, attention_mask=torch.ones_like(input_ids))
    assert greedy_ours.tolist() == greedy_theirs.tolist()  # (repetition_penalty: generation_config.json's is 1.3)
    # the repetition penalty is transformers' (the same tokens, greedy), and it changes the continuation
    penalised_ours = run.model.generate(input_ids, max_new_tokens=n_new, temperature=0.0, repetition_penalty=1.3)
    penalised_theirs = hf_model.generate(input_ids, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new,
                                         repetition_penalty=1.3, attention_mask=torch.ones_like(input_ids))
    assert penalised_ours.tolist() == penalised_theirs.tolist() != greedy_ours.tolist()

    generation = GenerationConfig.from_pretrained(out_dir)
    assert generation.eos_token_id == hf_tokenizer.eos_token_id == hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert (generation.do_sample, generation.temperature, generation.top_k, generation.repetition_penalty) == \
        (True, SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["repetition_penalty"])


def test_run_directory_holds_tokenizer_and_hf_config(gpt2_run):
    """RUN_DIR/hf/ (written by the trainer at the start): a fast tokenizer and a config.json transformers reads."""
    from transformers import AutoConfig, AutoTokenizer

    from flashtrain.data.lm import prepare_lm_data
    from flashtrain.export import load_run_config

    tokenizer = AutoTokenizer.from_pretrained(gpt2_run / "hf")
    hf_config = AutoConfig.from_pretrained(gpt2_run / "hf")
    cfg = load_run_config(gpt2_run)
    assert cfg.name == "gpt2-tiny-stdlib"  # Hydra's ${hydra:...} in the saved config, filled from hydra.yaml
    assert (hf_config.model_type, hf_config.n_layer, hf_config.n_embd, hf_config.n_head, hf_config.n_positions,
            hf_config.vocab_size) == ("gpt2", 2, 64, 2, 128, cfg.model.vocab_size)
    text = "for i in range(10):\n    print(i)  # <|endoftext|> inside\n"
    bpe = prepare_lm_data(cfg.data).tokenizer  # what the run trained on
    assert tokenizer(text)["input_ids"][:12] == bpe.encode(text).ids[:12]
    assert tokenizer.eos_token_id == hf_config.eos_token_id == bpe.token_to_id("<|endoftext|>")


def test_older_run_directories_still_load(gpt2_run, tmp_path):
    """A run from before RUN_DIR/hf/ existed (the tokenizer then comes from the data, as training had it) and before
    logger.kind listed trackers (logger.kind: none) loads, strictly, with the same tokenizer and weights."""
    import shutil

    old = tmp_path / "old-run"
    shutil.copytree(gpt2_run, old, ignore=shutil.ignore_patterns("hf"))
    config = old / ".hydra" / "config.yaml"
    assert "kind: []" in config.read_text()
    config.write_text(config.read_text().replace("kind: []", "kind: none"))
    run, old_run = load_run(gpt2_run), load_run(old)
    assert old_run.cfg.logger.kind == [] and old_run.tokenizer.model_max_length == run.cfg.model.n_positions == 128
    text = "class Point:\n    x: int = 0  # <|endoftext|>\n"
    assert old_run.tokenizer(text)["input_ids"] == run.tokenizer(text)["input_ids"]
    assert old_run.tokenizer.eos_token_id == run.tokenizer.eos_token_id
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(old_run.model.state_dict()[name], tensor), name


@pytest.mark.slow
def test_generate_command_streams_the_greedy_continuation(gpt2_run):
    """python -m flashtrain.generate on the run (KV cache) prints what uncached greedy decoding gives (with the default
    repetition penalty), and tokens/s."""
    proc = subprocess.run([sys.executable, "-m", "flashtrain.generate", str(gpt2_run), "--prompt", "import os\n",
                           "--max-new-tokens", "30", "--temperature", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = load_run(gpt2_run)
    prompt = torch.tensor([run.tokenizer("import os\n")["input_ids"]])
    expected = run.tokenizer.decode(run.model.generate(prompt, 30, temperature=0.0, use_cache=False,
                                                       repetition_penalty=SAMPLING["repetition_penalty"])[0].tolist())
    assert proc.stdout == expected + "\n"
    assert "30 tokens in" in proc.stderr and "tokens/s" in proc.stderr and "KV cache" in proc.stderr


# ---- BERT / RoBERTa: the masked-LM and the classification head -----------------------------------------------------

from test_bert_tasks import FIXTURES, roberta_bpe_dir, tiny_model_overrides, wordpiece_dir  # noqa: E402,F401


def launch(run_dir: Path, overrides: list[str]) -> Path:
    proc = subprocess.run([sys.executable, "launch.py", "name=test", "logger=none", *overrides,
                           "trainer.max_steps=2", "trainer.eval_interval=2", "data.val_samples=4",
                           "trainer.save_interval=2", "trainer.micro_batch_size=4", "trainer.global_batch_size=null",
                           "optim.warmup_steps=1", f"data.cache_dir={run_dir.parent / 'cache'}",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("kind", ["bert-mlm", "roberta-classification"])
@pytest.mark.slow
def test_bert_export_reloads_with_transformers(kind, tmp_path, wordpiece_dir, roberta_bpe_dir):
    import transformers

    if kind == "bert-mlm":
        overrides = ["recipe=bert-large-mlm", "data.corpus=stdlib", "data.max_bytes=60000",
                     f"data.tokenizer={wordpiece_dir}", "data.num_proc=1", "data.streaming=false",
                     "data.val_fraction=0.1", *tiny_model_overrides(400, 64)]
        auto, hf_class = transformers.AutoModelForMaskedLM, "BertForMaskedLM"
    else:
        overrides = ["recipe=roberta-longdoc-ecthr", "init_from=null", f"data.path={FIXTURES / 'ecthr'}",
                     f"data.tokenizer={roberta_bpe_dir}", *tiny_model_overrides(400, 48), "model.num_labels=10"]
        auto, hf_class = transformers.AutoModelForSequenceClassification, "RobertaForSequenceClassification"
    run_dir = launch(tmp_path / "run", overrides)
    out_dir = export(run_dir, tmp_path / "hf")

    run = load_run(run_dir, attn_impl="reference")
    hf_model = auto.from_pretrained(out_dir).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert type(hf_model).__name__ == hf_class and hf_tokenizer.is_fast
    if kind == "roberta-classification":
        assert hf_model.config.problem_type == "multi_label_classification" and hf_model.config.num_labels == 10
    batch = hf_tokenizer(["the court held that article 6 was violated", "def f(x): return x"], padding=True,
                         return_tensors="pt")
    assert batch["attention_mask"].eq(0).any()  # padding included
    with torch.no_grad():
        ours = run.model(batch["input_ids"], batch["attention_mask"])[0]
        theirs = hf_model(**batch).logits
    if kind == "bert-mlm":  # ours are zeros at pads
        mask = batch["attention_mask"].bool()
        ours, theirs = ours[mask], theirs[mask]
    assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, ours.abs().max().item())
