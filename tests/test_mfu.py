"""MFU: the models' training FLOPs per token, the GPU peak table, the measured-and-cached peak, the arithmetic."""
import json

import pytest
import torch

from flashtrain.models.attention_variants.block_sparse import BlockSparseConfig
from flashtrain.models.bert import BertConfig
from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models.lra import LRAConfig
from flashtrain.train import mfu


def test_gpt2_small_flops_per_token_is_palms_6n_plus_attention():
    model = GPT2(GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12))
    n = 124_439_808 - 1024 * 768  # GPT-2 small's parameters (the LM head tied) without the position table
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    assert model.flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024 == 855_166_464
    assert model.flops_per_token(4096) - model.flops_per_token(1024) == 12 * 12 * 768 * 3072
    assert model.flops_per_token() == model.flops_per_token(1024)  # default: n_positions


def test_bert_flops_leave_out_every_embedding_table():
    sizes = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                 max_position_embeddings=128)
    for head in ("masked_lm", "classification"):
        model = BertConfig(**sizes, head=head).build()
        tables = model.encoder.embeddings
        lookups = sum(t.weight.numel() for t in (tables.word_embeddings, tables.position_embeddings,
                                                  tables.token_type_embeddings))
        n = sum(p.numel() for p in model.parameters()) - lookups
        assert model.flops_per_token(100) == 6 * n + 12 * 2 * 64 * 100, head
        assert model.flops_per_token() == model.flops_per_token(128), head


def test_lra_attention_term_follows_the_variant():
    dense = LRAConfig(vocab_size=20, max_len=1024, n_layer=2, n_head=2, d_model=32, d_ff=64, num_classes=10).build()
    sparse = LRAConfig(vocab_size=20, max_len=1024, n_layer=2, n_head=2, d_model=32, d_ff=64, num_classes=10,
                       attention=BlockSparseConfig(kind="local_global", local_blocks=1, global_blocks=1)).build()
    attention = 12 * 2 * 32 * 1024
    # 8 x 8 blocks of 128: kept where |i - j| <= 1 (22 tiles) or in row or column 0 (12 more): 34 of 64
    kept = sum(abs(i - j) <= 1 or i == 0 or j == 0 for i in range(8) for j in range(8))
    assert kept == 34 and sparse.config.attention.attention_flops_fraction(1024) == 34 / 64
    assert dense.flops_per_token(1024) - sparse.flops_per_token(1024) == pytest.approx(attention * (1 - 34 / 64))


def test_peak_table_knows_the_data_sheet_numbers(monkeypatch):
    cuda = torch.device("cuda", 0)
    for name, tflops in (("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0),
                         ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
                         ("NVIDIA GH200 480GB", 989.4)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert mfu.peak_bf16_tflops(cuda) == (tflops, f"{name}, data sheet")
    assert mfu.peak_bf16_tflops(torch.device("cpu")) is None


def test_unknown_gpu_is_measured_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHTRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    calls = []
    monkeypatch.setattr(mfu, "measure_bf16_tflops", lambda device: calls.append(device) or 1234.56)
    cuda = torch.device("cuda", 0)
    first = mfu.peak_bf16_tflops(cuda)
    assert first[0] == 1234.6 and "measured" in first[1] and len(calls) == 1
    assert mfu.peak_bf16_tflops(cuda) == first and len(calls) == 1  # the cache answers
    cached = json.loads((tmp_path / "peak_bf16_tflops.json").read_text())
    assert cached == {f"Some Future GPU / torch {torch.__version__}": 1234.6}


def test_mfu_is_model_flops_over_the_processes_peak():
    util = mfu.Utilisation(flops_per_token=855e6, peak=(989.4, "H200"), processes=2)
    assert util.mfu(500_000) == pytest.approx(500_000 * 855e6 / (2 * 989.4e12))
    assert util.describe() == "MFU: 0.855 GFLOP per token against 989.4 TFLOP/s bf16 per GPU (H200)"
    assert mfu.Utilisation(None, (989.4, "H200"), 1).mfu(1e6) is None
    assert mfu.Utilisation(855e6, None, 1).mfu(1e6) is None
    assert "CPU" in mfu.Utilisation(855e6, None, 1).describe()
