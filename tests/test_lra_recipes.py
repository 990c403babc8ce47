"""The LRA recipes lra-text, lra-retrieval, lra-image, path64, pathx and path256: their LRA hyperparameters, and a
tiny offline run of each through the real Hydra path (fixtures in tests/fixtures/lra/, tiny generated Pathfinder
sets), with the test split scored at the end."""

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flashtrain.data.task import check_model_fits
from flashtrain.train import train
from flashtrain.train.model_init import load_initial_weights
from flashtrain.train.optim import lr_factor
from evaluation import evaluate_split
from hydra_config import compose_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "lra"


def test_recipes_have_lra_hyperparameters():
    text = compose_config(["name=x", "recipe=lra-text"])
    assert (text.model.n_layer, text.model.n_head, text.model.d_model, text.model.d_ff, text.model.max_len) == (
        4, 4, 256, 1024, 4001)
    assert (text.data.max_length, text.trainer.micro_batch_size, text.trainer.max_steps) == (4000, 32, 20000)
    retrieval = compose_config(["name=x", "recipe=lra-retrieval"])
    assert retrieval.model.dual and (retrieval.model.d_model, retrieval.model.d_ff) == (128, 512)
    assert (retrieval.trainer.max_steps, retrieval.optim.warmup_steps) == (5000, 8000)
    for cfg in (text, retrieval):  # LRA: 0.05 * min(1, s / 8000) / sqrt(max(s, 8000)), weight decay 0.1
        o = cfg.optim
        assert (o.schedule, o.weight_decay, o.beta2, o.eps, o.grad_clip) == ("rsqrt", 0.1, 0.98, 1e-9, 0.0)
        for step in (1, 4000, 8000, 20000):
            ours = o.lr * lr_factor(step - 1, o.warmup_steps, cfg.trainer.max_steps, o.min_lr_ratio, o.schedule)
            assert ours == pytest.approx(0.05 * min(1, step / 8000) / math.sqrt(max(step, 8000)), rel=1e-4)
    image = compose_config(["name=x", "recipe=lra-image"])
    assert (image.model.n_layer, image.model.n_head, image.model.d_model, image.model.dropout,
            image.model.attn_dropout, image.model.positions) == (1, 1, 32, 0.3, 0.2, "learned")
    assert (image.trainer.micro_batch_size, image.trainer.max_steps, image.optim.lr, image.optim.warmup_steps) == (
        256, 175 * 200, 5e-4, 175)
    path64 = compose_config(["name=x", "recipe=path64"])
    pathx = compose_config(["name=x", "recipe=pathx"])
    path256 = compose_config(["name=x", "recipe=path256"])
    for cfg, resolution, batch, epochs in ((path64, 64, 256, 200), (pathx, 128, 64, 200), (path256, 256, 32, 100)):
        steps_per_epoch = 160_000 // batch
        assert cfg.data.resolution == resolution and cfg.model.max_len == 1 + resolution ** 2
        assert (cfg.trainer.micro_batch_size, cfg.trainer.max_steps, cfg.optim.warmup_steps) == (
            batch, epochs * steps_per_epoch, steps_per_epoch)  # one epoch of warmup, then cosine to 0
        assert (cfg.optim.lr, cfg.optim.schedule, cfg.optim.min_lr_ratio) == (1e-3, "cosine", 0.0)
        assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, cfg.model.positions) == (2, 4, 32, "learned")
    assert pathx.init_from == path256.init_from == "runs/path64" and path64.init_from is None
    assert (pathx.optim.grad_clip, path256.optim.grad_clip) == (1.0, 0.0)  # LRA's pathfinder128 / 256 configs
    assert (type(path256.model.attention).__name__, path256.model.attention.kind) == ("BlockSparseConfig", "butterfly")
    assert type(pathx.model.attention).__name__ == "DenseAttentionConfig"


def tiny(recipe, tmp_path, *extra):
    return [f"recipe={recipe}", "name=test", "logger=none", f"data.cache_dir={tmp_path / 'cache'}",
            "data.num_proc=1", "model.n_layer=1", "model.n_head=2", "model.d_model=16", "model.d_ff=32",
            "model.dropout=0.0", "model.attn_dropout=0.0", "trainer.log_interval=1", "data.val_samples=null",
            "optim.warmup_steps=2", "trainer.global_batch_size=null", *extra]


def check_test_record(cfg, result, n_test):
    """The run's last record is the test split's, equal to evaluate_split on the final checkpoint; it is also in
    metrics.jsonl, and the curves PNG exists."""
    final = result.history[-1]
    assert set(final) == {"step", "tokens", "test_loss", "test_accuracy"} and final["step"] == result.final_step
    assert final["test_accuracy"] * n_test == pytest.approx(round(final["test_accuracy"] * n_test))
    on_disk = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert on_disk[-1] == final
    assert (result.run_dir / "curves.png").stat().st_size > 10_000
    model = cfg.model.build()
    model.load_state_dict(load_file(result.checkpoint / "model.safetensors"))
    test = evaluate_split(model, cfg.data.build(), "test", batch_size=3)
    assert test["samples"] == n_test
    assert test["accuracy"] == pytest.approx(final["test_accuracy"])
    assert test["loss"] == pytest.approx(final["test_loss"], rel=1e-5)
    return final


def check_val_record(cfg, result, n_val):
    """The run's last validation record equals evaluate_split of the final checkpoint over the whole val split."""
    last = [r for r in result.history if "val_accuracy" in r][-1]
    model = cfg.model.build()
    model.load_state_dict(load_file(result.checkpoint / "model.safetensors"))
    val = evaluate_split(model, cfg.data.build(), "val", batch_size=2)
    assert val["samples"] == n_val and last["step"] == result.final_step
    assert val["accuracy"] == pytest.approx(last["val_accuracy"], abs=1e-12)
    assert val["loss"] == pytest.approx(last["val_loss"], rel=1e-5)
    assert last["val_accuracy"] * n_val == pytest.approx(round(last["val_accuracy"] * n_val), abs=1e-9)


def test_tiny_lra_text_run(tmp_path):
    cfg = compose_config(tiny("lra-text", tmp_path, f"data.source={FIXTURES / 'text'}", "data.max_length=32",
                              "model.max_len=33", "model.attn_impl=sdpa", "trainer.micro_batch_size=3",
                              "trainer.max_steps=3",
                              "trainer.eval_interval=3", "trainer.save_interval=3"))
    result = train(cfg, tmp_path / "run")
    evals = [r for r in result.history if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert abs(evals[0]["val_loss"] - math.log(2)) < 1.0  # two classes, untrained
    # tokens are real bytes only: reviews of 28 bytes or more cut at 32, 3 reviews per step
    seen = [0] + [r["tokens"] for r in result.history if "train_loss" in r]
    assert len(seen) == 4 and all(3 * 28 <= b - a <= 3 * 32 for a, b in zip(seen, seen[1:])), seen
    check_val_record(cfg, result, n_val=4)  # LRA validates Text on the test reviews
    check_test_record(cfg, result, n_test=4)


def test_tiny_lra_retrieval_run(tmp_path):
    cfg = compose_config(tiny("lra-retrieval", tmp_path, f"data.source={FIXTURES / 'retrieval'}",
                              "data.max_length=64", "model.max_len=65", "trainer.micro_batch_size=2",
                              "trainer.max_steps=2", "trainer.eval_interval=2", "trainer.save_interval=2"))
    result = train(cfg, tmp_path / "run")
    assert [r["step"] for r in result.history if "val_accuracy" in r] == [0, 2]
    check_val_record(cfg, result, n_val=2)
    check_test_record(cfg, result, n_test=2)
    single = compose_config(tiny("lra-retrieval", tmp_path, f"data.source={FIXTURES / 'retrieval'}",
                                 "data.max_length=64", "model.max_len=65", "model.dual=false"))
    with pytest.raises(ValueError, match="model.dual"):  # a single-tower model cannot read the pairs
        check_model_fits(single.model, single.data, single.data.build().spec)


@pytest.mark.slow
def test_tiny_lra_image_run(tmp_path):
    # the last 5 of the 10 training images validate
    cfg = compose_config(tiny("lra-image", tmp_path, f"data.source={FIXTURES / 'image'}", "model.attn_impl=sdpa",
                              "data.val_fraction=0.5", "trainer.micro_batch_size=3", "trainer.max_steps=2",
                              "trainer.eval_interval=2", "trainer.save_interval=2"))
    result = train(cfg, tmp_path / "run")
    assert [r["tokens"] for r in result.history if "train_loss" in r] == [3 * 1024, 6 * 1024]  # no padding
    assert [r["step"] for r in result.history if "val_accuracy" in r] == [0, 2]
    check_val_record(cfg, result, n_val=5)
    check_test_record(cfg, result, n_test=4)


@pytest.mark.slow
def test_tiny_path64_then_pathx_and_path256(tmp_path):
    """path64 on 32 x 32 images, then pathx and path256 on 64 x 64 (2 x 2 blocks; the real recipes upsample
    64 -> 128 and 64 -> 256, factors tested exactly in test_lra_models.py), from the newest checkpoint of a
    runs/path64 directory. Their first validation pass is that of the upsampled path64 weights."""
    pathfinder = ["data.n_train=4", "data.n_val=2", "data.n_test=2"]
    source = compose_config(tiny("path64", tmp_path, *pathfinder, "data.resolution=32", "model.max_len=1025",
                                 "model.attn_impl=sdpa", "trainer.micro_batch_size=2", "trainer.max_steps=2",
                                 "trainer.eval_interval=2", "trainer.save_interval=2"))
    runs = tmp_path / "runs" / "path64"
    path64 = train(source, runs / "2026-01-01_00-00-00")
    check_test_record(source, path64, n_test=2)

    for recipe, extra in (("pathx", ["model.attn_impl=sdpa"]),
                          # block-sparse attention on the CPU reference costs ~20 s at 4K tokens: dense here; the
                          # block-sparse model is tested against masked dense attention in test_lra_models.py
                          ("path256", ["model/attention=dense", "model.attn_impl=sdpa"])):
        cfg = compose_config(tiny(recipe, tmp_path, *pathfinder, "data.resolution=64", "model.max_len=4097",
                                  f"init_from={runs}", "trainer.micro_batch_size=1", "trainer.max_steps=1",
                                  "trainer.eval_interval=1", "data.val_samples=1", "trainer.save_interval=1",
                                  "data.n_val=1", "data.n_test=1", *extra))
        result = train(cfg, tmp_path / recipe)
        start = cfg.model.build()
        assert "32x32 -> 64x64 (2x2 blocks)" in load_initial_weights(start, cfg.model, str(runs), "repeat")
        val = evaluate_split(start, cfg.data.build(), "val", batch_size=1)
        first = next(r for r in result.history if "val_loss" in r)
        assert first["step"] == 0 and first["val_loss"] == pytest.approx(val["loss"], rel=1e-5)
        check_test_record(cfg, result, n_test=1)
