"""benchmarks/gpt2_context.py (what a longer context buys): the sliding-window scoring against a direct per-token
computation, the long-document selection and the buckets, on a tiny GPT-2."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashtrain.models.gpt2 import GPT2Config
from flashtrain.train.checkpoint import write_manifest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpt2_context.py"
_spec = importlib.util.spec_from_file_location("gpt2_context", _path)
gpt2_context = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpt2_context  # its dataclass looks its module up there
_spec.loader.exec_module(gpt2_context)


def tiny_model(window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2Config(vocab_size=40, n_positions=window, n_embd=32, n_layer=2, n_head=2, attn_impl="sdpa").build().eval()


def direct_losses(model, document: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """The definition, token by token: the loss of document[i + 1] after the context the sliding window gives it
    (the whole prefix while i < window; after that the window that scores i starts at the largest multiple of
    stride whose window still holds i, i.e. begin = stride * ceil((i + 1 - window) / stride))."""
    losses = []
    for i in range(len(document) - 1):
        begin = 0 if i < window else stride * math.ceil((i + 1 - window) / stride)
        logits = model(document[None, begin:i + 1])[0][0, -1]
        losses.append(F.cross_entropy(logits[None], document[i + 1:i + 2]))
    return torch.stack(losses)


@pytest.mark.parametrize("length, window, stride", [(50, 16, 8), (41, 16, 5), (17, 16, 16), (12, 16, 8)])
def test_sliding_window_scores_each_token_with_the_context_the_definition_gives(length, window, stride):
    model = tiny_model(window)
    document = torch.randint(1, 40, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        got = gpt2_context.token_losses(model, document, window, stride)
        want = direct_losses(model, document, window, stride)
    assert got.shape == (length - 1,)
    assert (got - want).abs().max().item() < 1e-5


def test_a_window_shorter_than_the_document_loses_context_past_it():
    """Tokens in the first window score the same whatever the window; the first token past it differs."""
    document = torch.randint(1, 40, (40,), generator=torch.Generator().manual_seed(3))
    model = tiny_model(64)
    with torch.no_grad():
        full = gpt2_context.token_losses(model, document, 64, 8)
        windowed = gpt2_context.token_losses(model, document, 16, 8)  # the same weights, a 16-token window
    assert (full[:16] - windowed[:16]).abs().max().item() < 1e-5
    assert (full[16:] - windowed[16:]).abs().max().item() > 1e-4


def test_long_documents_are_cut_and_short_ones_skipped():
    eos = 0
    tokens = np.array([5, 6, 7, eos, 1, 2, eos, 9, 8, 7, 6, 5, eos, 3, 3, 3, eos], dtype=np.uint16)
    documents = gpt2_context.long_documents(tokens, eos, min_tokens=3, limit=10)
    assert [d.tolist() for d in documents] == [[5, 6, 7], [9, 8, 7], [3, 3, 3]]
    assert len(gpt2_context.long_documents(tokens, eos, min_tokens=3, limit=2)) == 2
    with pytest.raises(ValueError, match="no validation document has 6 tokens"):
        gpt2_context.long_documents(tokens, eos, min_tokens=6, limit=10)


def test_buckets_sum_the_losses_of_their_positions():
    model = tiny_model(16)
    documents = [np.random.default_rng(i).integers(1, 40, 33) for i in range(2)]
    scored = gpt2_context.score("tiny", model, 16, documents, (0, 8, 16, 32), 8, torch.device("cpu"))
    with torch.no_grad():
        losses = [gpt2_context.token_losses(model, torch.from_numpy(d), 16, 8).double() for d in documents]
    assert scored.tokens.tolist() == [16, 16, 32]
    expected = [sum(l[lo:hi].sum().item() for l in losses) for lo, hi in ((0, 8), (8, 16), (16, 32))]
    np.testing.assert_allclose(scored.nll, expected, rtol=1e-9)
    table = scored.table((0, 8, 16, 32))["buckets"]
    assert set(table) == {"0-8", "8-16", "16-32", "all"}
    assert table["8-16"]["ppl"] == pytest.approx(math.exp(expected[1] / 16))
    assert gpt2_context.bucket_name(1024, 4096) == "1K-4K"


def test_an_extended_run_counts_the_tokens_of_the_run_it_started_from(tmp_path):
    source = tmp_path / "runs" / "1k"
    (source / "checkpoints" / "step_00000300").mkdir(parents=True)
    write_manifest(source / "checkpoints" / "step_00000300", 300, config={})  # the benchmark reads intact ones only
    records = [{"step": 0, "tokens": 0, "val_loss": 9.0}] + [
        {"step": s, "tokens": s * 65536, "train_loss": 5.0} for s in (100, 200, 300, 400)]
    (source / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert gpt2_context.tokens_before(str(source / "checkpoints" / "step_00000300")) == 300 * 65536
    assert gpt2_context.tokens_before(None) == 0
    assert gpt2_context.tokens_before("hf:openai-community/gpt2") == 0
    assert gpt2_context.tokens_before(str(tmp_path / "gone")) == 0


@pytest.mark.slow
def test_llama_extension_smoke(tmp_path, monkeypatch):
    """The RoPE extension experiment end to end on the CPU (--smoke --smoke-family llama): a 64-token Llama-style
    pretraining, its YaRN continuation at 256 tokens (the same weights, its curve continuing the pretraining's
    tokens), and 256 tokens from scratch, each scored on the same held-out documents by position bucket."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    summary = gpt2_context.main(["--smoke", "--smoke-family", "llama", "--smoke-steps", "40", "--cache-dir",
                                 str(tmp_path / "cache"), "--out", str(tmp_path / "ctx")])
    runs = summary["runs"]
    assert {label: row["window"] for label, row in runs.items()} == {"64": 64, "64-then-256-yarn": 256,
                                                                      "256-scratch": 256}
    for row in runs.values():
        assert all(math.isfinite(b["ppl"]) and b["ppl"] > 1 for b in row["buckets"].values())
        assert row["buckets"]["all"]["tokens"] == sum(b["tokens"] for n, b in row["buckets"].items() if n != "all")
    curves = summary["curves"]
    pretraining_tokens = curves["64"][-1][0]
    assert curves["64-then-256-yarn"][:len(curves["64"])] == curves["64"]  # the continuation's curve starts there
    assert curves["64-then-256-yarn"][-1][0] == pretraining_tokens + 10 * 4096  # 40 / 4 steps of 4K tokens
    assert (tmp_path / "ctx.png").is_file()
