"""What one optimizer step computes, checked on the gradients and updates themselves (AdamW hides a gradient's scale,
so loss curves alone miss these): gradient accumulation equals the large batch, clipping equals a manual
clip_grad_norm_, validation leaves the model training, the logged lr is the schedule's, exactly the newest
keep_checkpoints checkpoints stay."""

from contextlib import contextmanager

import pytest
import torch

from flashtrain.train import train
from flashtrain.train.checkpoint import run_checkpoints
from flashtrain.train.optim import lr_factor
from flashtrain.train.trainer import Trainer
from hydra_config import compose_config
from test_train import tiny_overrides

# no dropout: two runs of one seed compute the same thing; no clipping unless a test asks
EXACT = ["data.sample_tokens=0", "optim.grad_clip=0", "model.dropout=0.0", "model.attn_dropout=0.0",
         "data.val_samples=8", "trainer.log_interval=1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache-math")


@contextmanager
def set_up(cache_dir, run_dir, *extra):
    """A Trainer after setup (data, model, optimizer, the step-0 validation), closed afterwards."""
    trainer = Trainer(compose_config(tiny_overrides(cache_dir, *EXACT, *extra)))
    trainer.setup(run_dir, None)
    try:
        yield trainer
    finally:
        trainer.pbar.close()
        trainer.restore_signal_handlers()
        trainer.accelerator.end_training()


def first_step(trainer) -> tuple[dict, dict, dict]:
    """(weights before, the gradients the optimizer step receives, weights after) of the first training step."""
    names = [name for name, _ in trainer.model.named_parameters()]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    grads = {}
    optimizer_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):  # the real step runs; the gradients it gets are copied first
        grads.update({name: p.grad.detach().clone() for name, p in trainer.model.named_parameters()})
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    try:
        trainer.train_step()
        trainer.flush_log()  # the step's record (logging reads the device at the next point that waits for it)
    finally:
        trainer.optimizer.step = optimizer_step
    after = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    assert sorted(grads) == sorted(names)
    return before, grads, after


def assert_close_dicts(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def total_norm(grads: dict) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()


def test_accumulated_step_equals_the_large_batch_step(cache_dir, tmp_path):
    """2 micro-batches of 4 accumulate to the gradient of 1 batch of the same 8 sequences (the sampler deals them in
    the same order), so the update is the same; a loss not divided by the accumulation steps doubles it."""
    with set_up(cache_dir, tmp_path / "large", "trainer.micro_batch_size=8", "trainer.global_batch_size=8") as large:
        large_before, large_grads, large_after = first_step(large)
    with set_up(cache_dir, tmp_path / "accum", "trainer.micro_batch_size=4", "trainer.global_batch_size=8") as accum:
        accum_before, accum_grads, accum_after = first_step(accum)
    assert_close_dicts(large_before, accum_before, rtol=0, atol=0)  # one seed: one initialisation
    assert_close_dicts(accum_grads, large_grads, rtol=1e-5, atol=1e-8)
    assert total_norm(large_grads) > 0.1  # a real gradient, compared entry by entry above
    # AdamW's first update is about lr * sign(gradient): the same, except where a gradient is within rounding of 0
    assert_close_dicts(accum_after, large_after, rtol=0, atol=1e-5)
    # the logged loss: the mean over the step's micro-batches, the large batch's mean
    assert accum.log.records[-1]["train_loss"] == pytest.approx(large.log.records[-1]["train_loss"], rel=1e-6)
    # the step-0 validation scored the same 8 sequences in 1 batch of 8 and in 2 of 4 (data.val_samples)
    assert accum.log.records[0]["val_loss"] == pytest.approx(large.log.records[0]["val_loss"], rel=1e-6)


def test_clipping_equals_a_manual_clip_grad_norm(cache_dir, tmp_path):
    with set_up(cache_dir, tmp_path / "raw") as raw:
        _, raw_grads, _ = first_step(raw)
    max_norm = 0.05
    assert total_norm(raw_grads) > 4 * max_norm  # clipping acts
    params = {name: torch.nn.Parameter(torch.zeros_like(g)) for name, g in raw_grads.items()}
    for name, param in params.items():
        param.grad = raw_grads[name].clone()
    torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    expected = {name: param.grad for name, param in params.items()}
    with set_up(cache_dir, tmp_path / "clipped", f"optim.grad_clip={max_norm}") as clipped:
        _, clipped_grads, _ = first_step(clipped)
    assert_close_dicts(clipped_grads, expected, rtol=1e-5, atol=1e-9)
    assert total_norm(clipped_grads) == pytest.approx(max_norm, rel=1e-5)


def test_validation_leaves_the_model_training_and_scores_without_dropout(cache_dir, tmp_path):
    with set_up(cache_dir, tmp_path / "run", "model.dropout=0.3", "model.attn_dropout=0.3") as trainer:
        assert all(module.training for module in trainer.model.modules())
        first = trainer.evaluate()
        assert all(module.training for module in trainer.model.modules())  # as after_step leaves it
        again = trainer.evaluate()
        assert first["val_loss"] == again["val_loss"]  # eval mode: no dropout, the same number twice
        generator_state = torch.get_rng_state()
        trainer.train_step()  # dropout in training draws random numbers
        assert not torch.equal(generator_state, torch.get_rng_state())


@pytest.mark.parametrize("schedule", ["cosine", "linear", "rsqrt"])
def test_logged_lr_is_the_schedule_of_each_step_and_the_newest_checkpoints_stay(cache_dir, tmp_path, schedule):
    """The lr logged with step s's loss is the one step s used: optim.lr * lr_factor(s - 1) (0-based optimizer
    steps); the optimizer holds the next one. Checkpoints every step with keep_checkpoints=3: exactly the newest 3."""
    max_steps, warmup = 7, 3
    overrides = tiny_overrides(cache_dir, *EXACT, f"trainer.max_steps={max_steps}", "trainer.log_interval=1",
                               "trainer.save_interval=1", "trainer.keep_checkpoints=3", "trainer.eval_interval=100",
                               f"optim.schedule={schedule}", f"optim.warmup_steps={warmup}", "optim.lr=2e-3",
                               "optim.min_lr_ratio=0.25")
    result = train(compose_config(overrides), tmp_path / "run")
    logged = {r["step"]: r["lr"] for r in result.history if "lr" in r}
    expected = {s: 2e-3 * lr_factor(s - 1, warmup, max_steps, 0.25, schedule) for s in range(1, max_steps + 1)}
    assert logged == pytest.approx(expected, rel=1e-12)
    assert logged[warmup] == 2e-3 and logged[1] == 2e-3 / warmup  # the peak at the end of warmup
    assert [c.name for c in run_checkpoints(tmp_path / "run")] == [f"step_{s:08d}" for s in (5, 6, 7)]
