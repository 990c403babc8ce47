"""LRA classifier, ClassificationTask and the ListOps / Pathfinder-32 recipes: Hydra composition, the model's
padding handling across attention implementations, and a tiny ListOps run through `train`."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from flashtrain.data.task import check_model_fits
from flashtrain.models.lra import LRAClassifier, LRAConfig, sinusoidal_positions
from flashtrain.train import train
from flashtrain.train.optim import lr_factor
from evaluation import evaluate_split
from hydra_config import compose_config

ROOT = Path(__file__).resolve().parents[1]


def test_listops_recipe_has_lra_hyperparameters():
    cfg = compose_config(["name=x", "recipe=listops"])
    m, o, t = cfg.model, cfg.optim, cfg.trainer
    assert type(m).__name__ == "LRAConfig" and type(cfg.data).__name__ == "ListOpsConfig"
    assert (m.n_layer, m.n_head, m.d_model, m.d_ff, m.max_len, m.pooling) == (4, 8, 512, 1024, 2048, "mean")
    assert (cfg.data.n_train, cfg.data.n_val, cfg.data.n_test, cfg.data.max_length) == (96_000, 2_000, 2_000, 2000)
    assert (t.micro_batch_size, t.global_batch_size, t.max_steps) == (32, 32, 5000)
    assert (o.schedule, o.warmup_steps, o.weight_decay, o.beta2, o.grad_clip) == ("rsqrt", 1000, 0.1, 0.98, 0.0)
    # LRA: 0.05 * min(1, s / 1000) / sqrt(max(s, 1000)); ours: lr * lr_factor(s - 1) (LambdaLR's 0-based step)
    for step in (1, 500, 1000, 2000, 5000):
        ours = o.lr * lr_factor(step - 1, o.warmup_steps, t.max_steps, o.min_lr_ratio, o.schedule)
        assert ours == pytest.approx(0.05 * min(1, step / 1000) / math.sqrt(max(step, 1000)), rel=1e-4), step


def test_pathfinder32_recipe_composes():
    cfg = compose_config(["name=x", "recipe=pathfinder32"])
    m, o, t = cfg.model, cfg.optim, cfg.trainer
    assert type(cfg.data).__name__ == "PathfinderConfig" and cfg.data.resolution == 32
    assert (m.n_layer, m.n_head, m.d_model, m.pooling, m.pad_id, m.max_len, m.vocab_size) == (4, 4, 32, "mean", None,
                                                                                               1024, 256)
    assert (t.micro_batch_size, t.max_steps, o.warmup_steps) == (512, 200 * (160_000 // 512), 160_000 // 512)
    assert (o.lr, o.schedule, o.min_lr_ratio, o.weight_decay) == (1e-3, "cosine", 0.0, 0.0)


def test_bad_lra_values_name_the_field():
    with pytest.raises(ValueError, match="pooling"):
        compose_config(["name=x", "recipe=listops", "model.pooling=max"])
    with pytest.raises(ValueError, match="optim.schedule"):
        compose_config(["name=x", "recipe=listops", "optim.schedule=exponential"])
    with pytest.raises(ConfigCompositionException, match="Could not override 'model.n_layers'"):
        compose_config(["name=x", "recipe=listops", "model.n_layers=2"])


def tiny_model(impl: str, pooling: str, pad_id=0, positions="learned") -> LRAClassifier:
    torch.manual_seed(0)
    model = LRAClassifier(LRAConfig(vocab_size=16, max_len=64, n_layer=2, n_head=2, d_model=24, d_ff=40,
                                    positions=positions, pooling=pooling, num_classes=10, pad_id=pad_id,
                                    attn_impl=impl)).eval()
    with torch.no_grad():  # weights far from init so logits depend strongly on every input token
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def padded_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 16, (4, 23), generator=g)  # (B, T), no pads yet
    for row, length in enumerate((23, 17, 1, 9)):  # awkward lengths: 1 real token, a full row
        tokens[row, length:] = 0
    return tokens


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_padding_invariance_and_impls_agree(pooling):
    tokens = padded_batch()
    more_padding = torch.nn.functional.pad(tokens, (0, 11))  # (4, 34): 11 more pad columns
    logits = {}
    for impl in ("flash", "sdpa", "reference"):
        model = tiny_model(impl, pooling)
        short, long = model(tokens)[0], model(more_padding)[0]
        torch.testing.assert_close(long, short, atol=1e-5, rtol=1e-5)
        logits[impl] = short
    for impl in ("sdpa", "reference"):
        torch.testing.assert_close(logits[impl], logits["flash"], atol=1e-5, rtol=1e-5)
    # the comparison means something: logits differ by O(1) between rows and change with a real token
    assert (logits["flash"][0] - logits["flash"][1]).abs().max() > 0.1
    changed = tokens.clone()
    changed[1, 3] = 1 + changed[1, 3] % 15
    assert (tiny_model("flash", pooling)(changed)[0][1] - logits["flash"][1]).abs().max() > 1e-3


def pooled_vectors(model: LRAClassifier, tokens) -> torch.Tensor:
    """The (B, d_model) input of the classifier head."""
    pooled = {}
    handle = model.head.register_forward_hook(lambda module, args, out: pooled.update(x=args[0]))
    model(tokens)
    handle.remove()
    return pooled["x"]


@pytest.mark.parametrize("impl", ["flash", "sdpa"])
def test_mean_pooling_ignores_pads(impl):
    model = tiny_model(impl, "mean")
    tokens = padded_batch()
    batch = pooled_vectors(model, tokens)
    for row in range(tokens.shape[0]):  # each row alone with its pads cut off: the same pooled vector
        length = int(tokens[row].ne(0).sum())
        alone = pooled_vectors(model, tokens[row:row + 1, :length])[0]
        torch.testing.assert_close(batch[row], alone, atol=1e-5, rtol=1e-5)
    # and it is the mean over the real tokens of the final-norm outputs (pad rows hold other, non-zero values)
    hidden = {}
    model.final_norm.register_forward_hook(lambda module, args, out: hidden.update(x=out))
    model(tokens[3:4, :9])
    torch.testing.assert_close(batch[3], hidden["x"].reshape(-1, 24).mean(dim=0), atol=1e-5, rtol=1e-5)
    # pad_id None: no padding, the mean runs over every token (pad id 0 included) and so differs
    everything = tiny_model(impl, "mean", pad_id=None)
    assert (pooled_vectors(everything, tokens)[3] - batch[3]).abs().max() > 1e-2


def test_sinusoidal_table():
    table = sinusoidal_positions(50, 6)  # (50, 6): columns sin, cos at frequencies 1, 10000^(-1/3), 10000^(-2/3)
    t = torch.arange(50.0)
    torch.testing.assert_close(table[:, 2], torch.sin(t * 10000 ** (-2 / 6)))
    torch.testing.assert_close(table[:, 5], torch.cos(t * 10000 ** (-4 / 6)))
    cls_model = tiny_model("flash", "cls", positions="sinusoidal")
    assert not any(name.startswith("pos_") for name in cls_model.state_dict())  # fixed: not a parameter
    torch.testing.assert_close(cls_model.pos_table, sinusoidal_positions(64, 24))
    with pytest.raises(ValueError, match="seqlen <= 63"):
        cls_model(torch.ones(1, 64, dtype=torch.long))  # the CLS token takes one of the 64 positions


def tiny_listops_overrides(cache_dir, *extra):
    """ListOps of 10-40 tokens (depth <= 4), 40 train / 50 val / 50 test sequences, a 2-layer 32-wide model: 100
    steps of 20 sequences memorise the train split in about 8 s on 2 CPU cores."""
    return [
        "name=test", "recipe=listops", "logger=none",
        "data.n_train=40", "data.n_val=50", "data.n_test=50", "data.min_length=10", "data.max_length=40",
        "data.max_depth=4", "data.num_proc=1", f"data.cache_dir={cache_dir}",
        "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_ff=64", "model.max_len=64",
        "model.dropout=0.0", "model.attn_dropout=0.0",
        "trainer.micro_batch_size=20", "trainer.global_batch_size=null", "trainer.max_steps=100", "trainer.log_interval=10",
        "trainer.eval_interval=50", "data.val_samples=50", "trainer.save_interval=100",
        "optim.lr=1e-2", "optim.warmup_steps=10",
        *extra,
    ]


@pytest.mark.slow
def test_tiny_listops_run(tmp_path):
    cfg = compose_config(tiny_listops_overrides(tmp_path / "cache"))
    result = train(cfg, tmp_path / "run")
    train_losses = [r["train_loss"] for r in result.history if "train_loss" in r]
    evals = [r for r in result.history if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 50, 100]
    # untrained: near uniform over 10 digits (LRA's init gives O(1) logits, so somewhat above log(10))
    assert math.log(10) - 0.3 < evals[0]["val_loss"] < math.log(10) + 1.0
    # 40 sequences seen 50 times each: the model memorises them (validation loss rises meanwhile: it overfits)
    first, last = sum(train_losses[:2]) / 2, sum(train_losses[-2:]) / 2
    assert last < first - 0.6, train_losses
    for r in evals:  # an accuracy over the 50 validation sequences: k / 50
        assert r["val_accuracy"] * 50 == pytest.approx(round(r["val_accuracy"] * 50), abs=1e-9)

    # the final checkpoint's weights, evaluated again in one process: the trainer's numbers, and the test split
    from safetensors.torch import load_file
    task = cfg.data.build()
    model = cfg.model.build()
    model.load_state_dict(load_file(result.checkpoint / "model.safetensors"))
    val = evaluate_split(model, task, "val", batch_size=7)
    assert val["samples"] == 50
    assert val["accuracy"] == pytest.approx(evals[-1]["val_accuracy"])
    assert val["loss"] == pytest.approx(evals[-1]["val_loss"], rel=1e-5)
    test = evaluate_split(model, task, "test", batch_size=16)
    final = result.history[-1]  # the test split, scored by the trainer at the end of the run
    assert test["samples"] == 50 and final["step"] == 100
    assert test["accuracy"] == pytest.approx(final["test_accuracy"], abs=1e-12)
    assert test["loss"] == pytest.approx(final["test_loss"], rel=1e-5)


def test_check_model_rejects_mismatch(tmp_path):
    cfg = compose_config(tiny_listops_overrides(tmp_path / "cache", "model.pooling=cls"))
    task = cfg.data.build()
    assert 10 < task.seq_len < 40 and task.tokens(next(iter(task.eval_loader("val", 50)))) == sum(
        len(tokens[tokens.ne(0)]) for tokens, _ in task.dataset("val"))
    check_model_fits(cfg.model, cfg.data, task.spec)
    for change, field in ((dict(max_len=task.seq_len), "max_len"),  # the CLS token needs one more position
                          (dict(num_classes=2), "num_classes"), (dict(vocab_size=12), "vocab_size"),
                          (dict(pad_id=None), "pad_id")):
        with pytest.raises(ValueError, match=field):
            check_model_fits(dataclasses.replace(cfg.model, **change), cfg.data, task.spec)


@pytest.mark.slow
def test_tiny_pathfinder32_run(tmp_path):
    # no padding (pad_id None): every pixel is a token, attention on (B, 1024) through flash_attn_func
    cfg = compose_config(["name=test", "recipe=pathfinder32", "logger=none", "data.n_train=40", "data.n_val=10",
                          "data.n_test=10", "data.num_proc=1", f"data.cache_dir={tmp_path / 'cache'}",
                          "model.n_layer=1", "model.d_model=16", "model.d_ff=32", "trainer.micro_batch_size=8",
                          "trainer.global_batch_size=null",
                          "trainer.max_steps=4", "trainer.eval_interval=4", "data.val_samples=10",
                          "trainer.save_interval=4", "trainer.log_interval=1", "optim.warmup_steps=2"])
    result = train(cfg, tmp_path / "run")
    evals = [r for r in result.history if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=0.1)  # two classes, untrained
    assert [r["tokens"] for r in result.history if "train_loss" in r] == [8 * 1024 * s for s in (1, 2, 3, 4)]
    task = cfg.data.build()
    assert task.seq_len == 1024 and task.pad_id is None
    assert [int(label) for _, label in task.dataset("val")] == [0, 1] * 5  # balanced: even indices negative
