"""Every model/data mismatch stops the start, before training, with a message that names both configs; and the
attention entry: attn_impl names, what auto and flash pick on this machine, flash refusing a kernel that cannot run."""

import itertools

import pytest
import torch

from flashtrain.data.documents import LongDocConfig
from flashtrain.data.listops import ListOpsConfig
from flashtrain.data.lm import LMDataConfig
from flashtrain.data.lra_hf import LRARetrievalConfig
from flashtrain.data.mlm import MaskedLMDataConfig
from flashtrain.data.task import DataSpec, check_model_fits
from flashtrain.models import attention
from flashtrain.models.bert import BertConfig
from flashtrain.models.gpt2 import GPT2Config
from flashtrain.models.lra import LRAConfig
from flashtrain.train import train
from hydra_config import compose_config

TINY_BERT = dict(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_length=64, pad_token_id=0)
# model config -> (data config, the DataSpec that data would give): each pair fits
FITTING = {
    "gpt2": (GPT2Config(vocab_size=512, n_positions=64, n_embd=16, n_layer=1, n_head=2),
             LMDataConfig(), DataSpec("causal_lm", 512, 64, "data.seq_len")),
    "bert_mlm": (BertConfig(**TINY_BERT, head="masked_lm"), MaskedLMDataConfig(),
                 DataSpec("masked_lm", 100, 64, "data.seq_len", pad_id=0)),
    "bert_classifier": (BertConfig(**TINY_BERT, head="classification", num_labels=4), LongDocConfig(),
                        DataSpec("document_classification", 100, 64, "data.max_length", 0, num_classes=4)),
    "lra": (LRAConfig(vocab_size=16, max_len=65, n_layer=1, n_head=2, d_model=16, d_ff=32, num_classes=10, pad_id=0),
            ListOpsConfig(), DataSpec("classification", 16, 64, "data.max_length", 0, num_classes=10)),
    "lra_dual": (LRAConfig(vocab_size=257, max_len=65, n_layer=1, n_head=2, d_model=16, d_ff=32, num_classes=2,
                           pad_id=0, dual=True), LRARetrievalConfig(),
                 DataSpec("classification", 257, 64, "data.max_length", 0, num_classes=2, paired=True)),
}
# (model, a DataSpec change that breaks the fit, a word the message must contain)
FIELD_MISMATCHES = [
    ("gpt2", dict(vocab_size=513), "model.vocab_size"), ("gpt2", dict(max_length=65), "model.n_positions"),
    ("bert_mlm", dict(vocab_size=101), "model.vocab_size"), ("bert_mlm", dict(pad_id=1), "model.pad_token_id"),
    ("bert_mlm", dict(max_length=65), "data.seq_len=65"),
    ("bert_classifier", dict(num_classes=5), "model.num_labels"),
    ("bert_classifier", dict(problem_type="multi_label"), "model.problem_type"),
    ("bert_classifier", dict(max_length=65), "data.max_length=65"),
    ("lra", dict(vocab_size=17), "model.vocab_size"), ("lra", dict(num_classes=2), "model.num_classes"),
    ("lra", dict(pad_id=None), "model.pad_id"), ("lra", dict(max_length=65), "model.max_len"),
    ("lra", dict(paired=True), "model.dual"), ("lra_dual", dict(paired=False), "model.dual"),
]


@pytest.mark.parametrize("model_name", sorted(FITTING))
def test_fitting_pairs_pass(model_name):
    model_cfg, data_cfg, spec = FITTING[model_name]
    check_model_fits(model_cfg, data_cfg, spec)


@pytest.mark.parametrize("model_name, data_name", [
    (m, d) for m, d in itertools.product(sorted(FITTING), sorted(FITTING))
    if FITTING[m][2].task != FITTING[d][2].task])
def test_every_other_task_is_refused_naming_both_configs(model_name, data_name):
    model_cfg = FITTING[model_name][0]
    _, data_cfg, spec = FITTING[data_name]
    with pytest.raises(ValueError, match=f"model config {type(model_cfg).__name__} does not fit data config "
                                         f"{type(data_cfg).__name__}: .*{spec.task}"):
        check_model_fits(model_cfg, data_cfg, spec)


@pytest.mark.parametrize("model_name, change, word", FIELD_MISMATCHES)
def test_field_mismatches_are_refused_naming_both_configs(model_name, change, word):
    model_cfg, data_cfg, spec = FITTING[model_name]
    broken = DataSpec(**{**spec.__dict__, **change})
    with pytest.raises(ValueError, match=f"{type(model_cfg).__name__} .*{type(data_cfg).__name__}: .*{word}"):
        check_model_fits(model_cfg, data_cfg, broken)


def test_lm_data_with_a_bert_config_stops_at_start_up(tmp_path):
    """Composed as a user would: the stdlib LM data with MiniLM's BERT config. The run stops before its first step."""
    cfg = compose_config(["name=x", "logger=none", "model=minilm-l6", "data.max_bytes=300000", "data.num_proc=1",
                          "data.vocab_size=512", "data.seq_len=128", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match="model config BertConfig does not fit data config LMDataConfig: "
                                         "model.head=classification trains on document_classification data; "
                                         "the data is causal_lm"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- the attention entry -----------------------------------------------------------------------------------------

def test_attn_impl_names_are_defined_once_and_checked():
    assert attention.ATTN_IMPLS == ("flash", "sdpa", "reference", "auto")
    for config in (GPT2Config, BertConfig, LRAConfig):
        with pytest.raises(ValueError, match="attn_impl must be one of"):
            config(attn_impl="cuda")


@pytest.mark.parametrize("attn_impl, header", [
    ("flash", "flash -> reference"), ("reference", "reference -> reference"), ("sdpa", "sdpa -> sdpa"),
    ("auto", "auto -> sdpa (the tensors are on cpu; the CUDA kernel needs CUDA tensors)")])
def test_what_runs_on_the_cpu(attn_impl, header):
    """CPU: flash is the reference (its CPU path); auto never picks the reference, it takes PyTorch's SDPA."""
    assert GPT2Config(attn_impl=attn_impl).attention_backend(torch.device("cpu"), torch.float32) == header


def test_flash_that_cannot_run_on_cuda_stops_with_the_reason(monkeypatch):
    """On a CUDA device where the kernel cannot run (here: it says so), flash raises with the kernel's reason and
    auto takes SDPA; neither runs the reference."""
    monkeypatch.setattr(attention, "kernel_unavailable_reason",
                        lambda device, dtype, head_dim, block_mask, features=(): "cuda-python is not installed")
    cuda = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="attn_impl=flash cannot run flashtrain's CUDA kernel: cuda-python is not"):
        GPT2Config(attn_impl="flash").attention_backend(cuda, torch.bfloat16)
    assert attention.backend("auto", cuda, torch.bfloat16, 64) == ("sdpa", "cuda-python is not installed")
    monkeypatch.setattr(attention, "kernel_unavailable_reason", lambda device, dtype, head_dim, block_mask, features=(): None)
    assert attention.backend("flash", cuda, torch.bfloat16, 64) == ("kernel", None)
    assert attention.backend("auto", cuda, torch.bfloat16, 64) == ("kernel", None)


def test_auto_on_the_cpu_computes_what_sdpa_computes():
    """auto on CPU tensors runs SDPA, padded: the same numbers as attn_impl=sdpa, for GPT-2 and the encoders."""
    torch.manual_seed(0)
    tokens = torch.randint(1, 100, (2, 20))
    tokens[1, 12:] = 0  # padding: BERT and LRA run padded under sdpa and auto
    mask = tokens.ne(0).long()
    for config in (GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=1, n_head=2),
                   BertConfig(**TINY_BERT, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0),
                   LRAConfig(vocab_size=100, max_len=32, n_layer=1, n_head=2, d_model=16, d_ff=32, dropout=0.0,
                             attn_dropout=0.0)):
        outputs = {}
        for attn_impl in ("sdpa", "auto", "reference"):
            torch.manual_seed(1)
            model = type(config)(**{**config.__dict__, "attn_impl": attn_impl}).build().eval()
            with torch.no_grad():
                outputs[attn_impl] = model(tokens, mask)[0] if isinstance(config, BertConfig) else model(tokens)[0]
        assert torch.equal(outputs["auto"], outputs["sdpa"]), type(config).__name__
        torch.testing.assert_close(outputs["reference"], outputs["sdpa"], rtol=1e-4, atol=1e-5)


def test_the_attention_check_comes_before_any_data(tmp_path, monkeypatch):
    """The trainer asks the model config what runs its attention before it prepares data: a flash that cannot run
    stops the start with nothing tokenized or cached."""
    def cannot_run(self, device, dtype):
        raise RuntimeError("attn_impl=flash cannot run flashtrain's CUDA kernel: cuda-python is not installed")

    monkeypatch.setattr(GPT2Config, "attention_backend", cannot_run)
    cfg = compose_config(["name=x", "logger=none", "data.max_bytes=300000", "data.num_proc=1",
                          f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(RuntimeError, match="cuda-python is not installed"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "cache").exists()
