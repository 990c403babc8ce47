"""trainer.lagged_finite_check: each step's finiteness read one step later, the update of a non-finite step skipped on
the device (fused AdamW's found_inf). On the CPU the trainer's AdamW is not fused, so these tests make it fused (torch
has a fused CPU AdamW) and compare the lagged run with the step-by-step one: the same records, skips, messages and
weights."""

import pytest
import torch
from safetensors.torch import load_file

from flashtrain.data.lm import LMTask
from flashtrain.train import train
from flashtrain.train import trainer as trainer_module
from flashtrain.train.optim import ShardLocalAdamW
from hydra_config import compose_config
from test_resilience import EXACT, _poison
from test_train import tiny_overrides

KEYS = ("train_loss", "lr", "val_loss", "val_ppl")
LOSS = LMTask.loss  # unpoisoned: each run poisons it afresh (_poison wraps whatever LMTask.loss is)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache-lagged")


@pytest.fixture
def fused_adamw(monkeypatch):
    """The trainer's AdamW fused on the CPU too; counts the steps that took the lagged path."""
    original = trainer_module.build_optimizer

    def build(model, cfg):
        optimizer = original(model, cfg)
        if type(optimizer) is ShardLocalAdamW:
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
            d = optimizer.defaults
            return ShardLocalAdamW(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], fused=True)
        return optimizer

    monkeypatch.setattr(trainer_module, "build_optimizer", build)
    lagged_steps = []
    lagged_update = trainer_module.Trainer._lagged_update

    def counting(self, *args):
        lagged_steps.append(self.state.step)
        return lagged_update(self, *args)

    monkeypatch.setattr(trainer_module.Trainer, "_lagged_update", counting)
    return lagged_steps


def _run(cache_dir, path, lagged: bool, *extra):
    overrides = tiny_overrides(cache_dir, *EXACT, f"trainer.lagged_finite_check={str(lagged).lower()}", *extra)
    return train(compose_config(overrides), path)


def _records(result):
    """(step, key, value) of every record's losses, learning rate and validation metrics."""
    return [(r.get("step"), key, r[key]) for r in result.history for key in KEYS if key in r]


def _weights(result):
    return load_file(str(result.checkpoint / "model.safetensors"))


def _same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_lagged_run_repeats_the_stepwise_run(fused_adamw, cache_dir, tmp_path, capsys):
    stepwise = _run(cache_dir, tmp_path / "stepwise", False)
    assert fused_adamw == [] and "finiteness check" not in capsys.readouterr().out
    lagged = _run(cache_dir, tmp_path / "lagged", True)
    assert "finiteness check: read one step later (trainer.lagged_finite_check)" in capsys.readouterr().out
    assert len(fused_adamw) == 9  # every step took the lagged path
    assert lagged.final_step == stepwise.final_step == 9
    assert _records(lagged) == _records(stepwise)
    assert _same_weights(_weights(lagged), _weights(stepwise))


def _equal(a, b) -> bool:
    """Deep equality of checkpoint contents (tensors, numpy arrays, dicts, sequences)."""
    import numpy as np

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _checkpoint_files(result):
    """Every checkpoint's train state, scheduler and random state, by checkpoint name."""
    files = {}
    for ckpt in sorted(p for p in (result.run_dir / "checkpoints").iterdir() if p.name.startswith("step_")):
        for name in ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl"):
            files[ckpt.name, name] = torch.load(ckpt / name, weights_only=False)
    return files


@pytest.mark.parametrize("bad_calls, extra", [
    ({3, 4}, ()),  # steps 4 and 5: two in a row
    ({5}, ()),  # step 6, an eval / save step: its answer is read by after_step
    ({8}, ()),  # the last step
    ({6, 9}, ("trainer.global_batch_size=16",)),  # two micro-batches per step: the first of step 4, the second of 5
], ids=["two-in-a-row", "on-a-save-step", "last-step", "accumulation"])
@pytest.mark.slow
def test_lagged_check_skips_as_the_stepwise_check(bad_calls, extra, fused_adamw, cache_dir, tmp_path, monkeypatch,
                                                  capsys):
    runs, outputs = {}, {}
    for lagged in (False, True):
        monkeypatch.setattr(LMTask, "loss", LOSS)
        _poison(monkeypatch, bad_calls=bad_calls)
        runs[lagged] = _run(cache_dir, tmp_path / str(lagged), lagged, *extra)
        outputs[lagged] = [line.strip() for line in capsys.readouterr().out.splitlines() if "non-finite" in line]
    assert fused_adamw  # the lagged run took the lagged path
    assert outputs[True] and [o[o.index("step "):] for o in outputs[True]] == \
        [o[o.index("step "):] for o in outputs[False]]
    assert runs[True].final_step == runs[False].final_step == 9
    # no record of a skipped step, the same LR schedule, and the throughput of the next record leaves the skip out
    assert _records(runs[True]) == _records(runs[False])
    assert all(r["tokens_per_s"] > 0 for r in runs[True].history if "tokens_per_s" in r)
    assert [r.get("tokens") for r in runs[True].history] == [r.get("tokens") for r in runs[False].history]
    assert _same_weights(_weights(runs[True]), _weights(runs[False]))
    stepwise, lagged = _checkpoint_files(runs[False]), _checkpoint_files(runs[True])
    assert stepwise.keys() == lagged.keys()
    for key in stepwise:
        assert _equal(stepwise[key], lagged[key]), key  # train state, schedule, random states
    optimizer = torch.load(runs[True].checkpoint / "optimizer.bin", weights_only=False)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {9.0}  # the skipped updates left no count


@pytest.mark.slow
def test_lagged_check_stops_with_the_last_finite_weights(fused_adamw, cache_dir, tmp_path, monkeypatch, capsys):
    runs = {}
    for lagged in (False, True):
        monkeypatch.setattr(LMTask, "loss", LOSS)
        _poison(monkeypatch, bad_calls=set(range(3, 100)))  # every micro-batch after step 3
        runs[lagged] = _run(cache_dir, tmp_path / str(lagged), lagged, "trainer.max_nonfinite_steps=3")
        assert ("stopped: 3 steps in a row had a non-finite loss or gradient norm (trainer.max_nonfinite_steps=3); "
                "the weights are those after step 3, the last finite one") in capsys.readouterr().out
    for result in runs.values():
        assert result.final_step == 3 and result.exit_code == 1
        assert result.checkpoint.name == "step_00000003"
    assert _same_weights(_weights(runs[True]), _weights(runs[False]))
    # the stop comes before another batch is read: the same data position and random states to resume from
    stepwise, lagged = _checkpoint_files(runs[False]), _checkpoint_files(runs[True])
    assert stepwise.keys() == lagged.keys() and all(_equal(stepwise[k], lagged[k]) for k in stepwise)


def test_signal_of_several_processes_is_read_one_step_later():
    """Under several processes every rank reads the summed signal flags of the step before (no host wait per step):
    a signal during step s stops every rank after step s + 1."""
    import signal

    class TwoProcesses:  # accelerate's reduce over 2 processes, both with this process's flag
        num_processes, device = 2, torch.device("cpu")

        @staticmethod
        def reduce(tensor, reduction):
            return tensor * 2

    trainer = trainer_module.Trainer.__new__(trainer_module.Trainer)
    trainer.accelerator, trainer.received_signal, trainer.signal_pending = TwoProcesses(), None, None
    assert trainer._signalled() is False  # step 1
    trainer.received_signal = signal.SIGTERM  # during step 2
    assert trainer._signalled() is False  # after step 2: step 1's flags
    assert trainer._signalled() is True  # after step 3


@pytest.mark.slow
def test_lagged_check_says_when_it_is_not_in_effect(cache_dir, tmp_path, capsys):
    """The CPU's AdamW is not fused: the lagged check (on by default) says it is off and why (the run goes step by
    step)."""
    from flashtrain.train.config import TrainerConfig

    assert TrainerConfig.lagged_finite_check is True
    _run(cache_dir, tmp_path / "run", True, "trainer.max_steps=2")
    assert ("finiteness check: step by step (trainer.lagged_finite_check needs one process without FSDP, a fused "
            "AdamW and no fp16 loss scaler)") in capsys.readouterr().out
