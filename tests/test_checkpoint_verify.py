"""Every reader of a checkpoint verifies it as resume=auto does (its manifest: every file's size and sha256): export,
generation and init_from take a run's newest intact checkpoint, naming each damaged one they skip, and stop, naming
the file, on a damaged checkpoint named explicitly. Pruning never counts a damaged checkpoint toward
trainer.keep_checkpoints, and never deletes the newest verified one. A run stopped by a signal or by non-finite steps
says what to do; after non-finite steps, the test follows the suggested command (the signal's is followed in
test_resilience.py)."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flashtrain.train.checkpoint as checkpoint_module
from flashtrain import generate
from flashtrain.export import export, load_run, load_run_config
from flashtrain.train import train
from flashtrain.train.checkpoint import (DamagedCheckpointError, DamagedCheckpointWarning, checkpoint_problem,
                                         init_from_verified, model_state, prune_after_resume, run_checkpoints,
                                         write_manifest)
from flashtrain.train.model_init import load_initial_weights
from flashtrain.train.optim import lr_factor
from flashtrain.train.trainer import read_metrics
from hydra_config import compose_config
from test_train import ROOT, tiny_overrides

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
STEP_3, STEP_6 = "step_00000003", "step_00000006"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache-verify")


@pytest.fixture(scope="module")
def launched_run(cache_dir, tmp_path_factory):
    """A 6-step tiny GPT-2 run started by launch.py (its .hydra/config.yaml and hf/ tokenizer, as export and generate
    need them), checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("verify") / "run"
    overrides = [o for o in tiny_overrides(cache_dir) if o != "name=test"]
    proc = subprocess.run([sys.executable, "launch.py", *overrides, "trainer.max_steps=6", "trainer.save_interval=3",
                           "trainer.eval_interval=3", "trainer.keep_checkpoints=3", "data.sample_tokens=0",
                           "data.val_samples=8", f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c.name for c in run_checkpoints(run_dir)] == [STEP_3, STEP_6]
    return run_dir


def _corrupt_4000_bytes(path: Path) -> None:
    """4000 bytes in the middle overwritten (0xff: NaN floats), the size unchanged."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 4000] = b"\xff" * 4000
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {  # name: (file, damage, what the message says of it)
    "weights corrupted at the same size": ("model.safetensors", _corrupt_4000_bytes,
                                           r"does not match its sha256 in the manifest \(same size, different bytes\)"),
    "weights truncated": ("model.safetensors", _truncate, r"has \d+ bytes, its manifest says \d+"),
    "manifest deleted": ("manifest.json", lambda p: p.unlink(), r"is missing \(a save cut short"),
}


@pytest.fixture(params=sorted(DAMAGES))
def damaged_run(launched_run, tmp_path, request):
    """A copy of the run whose newest checkpoint (step 6) is damaged: (run dir, damaged file, message words)."""
    filename, apply, words = DAMAGES[request.param]
    run = tmp_path / "run"
    shutil.copytree(launched_run, run)
    apply(run / "checkpoints" / STEP_6 / filename)
    return run, run / "checkpoints" / STEP_6 / filename, words


def _skipped(run: Path, damaged_file: Path, words: str) -> str:
    return f"skipping checkpoint {re.escape(str(run / 'checkpoints' / STEP_6))}: {re.escape(str(damaged_file))} {words}"


def _stops(run: Path, damaged_file: Path, words: str, setting: str = "") -> str:
    return (f"{re.escape(setting + str(run / 'checkpoints' / STEP_6))}: the checkpoint is damaged: "
            f"{re.escape(str(damaged_file))} {words}")


def _equal_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_takes_the_newest_intact_checkpoint_or_stops(damaged_run, tmp_path):
    run, damaged_file, words = damaged_run
    export(run / "checkpoints" / STEP_3, tmp_path / "step3")  # what the intact checkpoint exports
    with pytest.warns(DamagedCheckpointWarning, match=_skipped(run, damaged_file, words)):
        export(run, tmp_path / "fallback")
    exported = load_file(str(tmp_path / "fallback" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in exported.values())
    assert _equal_tensors(exported, load_file(str(tmp_path / "step3" / "model.safetensors")))  # bit for bit
    with pytest.raises(DamagedCheckpointError, match=_stops(run, damaged_file, words)):
        export(run / "checkpoints" / STEP_6, tmp_path / "named")
    assert not (tmp_path / "named").exists()


@pytest.mark.slow
def test_export_command_names_the_damaged_file(launched_run, tmp_path):
    """`python -m flashtrain.export`: the warning on stderr and `wrote` from a run directory; exit status 1 and the
    message naming the file for a damaged checkpoint named explicitly (no traceback, nothing written)."""
    run = tmp_path / "run"
    shutil.copytree(launched_run, run)
    damaged = run / "checkpoints" / STEP_6 / "model.safetensors"
    _corrupt_4000_bytes(damaged)
    command = [sys.executable, "-m", "flashtrain.export"]
    proc = subprocess.run([*command, str(run), str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"DamagedCheckpointWarning: skipping checkpoint {run / 'checkpoints' / STEP_6}: {damaged} does not match "
            f"its sha256 in the manifest (same size, different bytes)") in proc.stderr
    assert f"wrote {tmp_path / 'out'}" in proc.stdout
    proc = subprocess.run([*command, str(run / "checkpoints" / STEP_6), str(tmp_path / "named")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and not (tmp_path / "named").exists()
    assert proc.stderr.strip().splitlines()[-1] == (
        f"python -m flashtrain.export: {run / 'checkpoints' / STEP_6}: the checkpoint is damaged: {damaged} does not "
        f"match its sha256 in the manifest (same size, different bytes). Name an older checkpoint, or the run "
        f"directory ({run}) to take its newest intact one.")


def test_generate_takes_the_newest_intact_checkpoint_or_stops(damaged_run, capsys):
    run, damaged_file, words = damaged_run
    args = ["--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu"]
    generate.main([str(run / "checkpoints" / STEP_3), *args])
    intact = capsys.readouterr().out
    with pytest.warns(DamagedCheckpointWarning, match=_skipped(run, damaged_file, words)):
        generate.main([str(run), *args])
    out, err = capsys.readouterr()
    assert out == intact and f"({run / 'checkpoints' / STEP_3}, cpu" in err  # greedy: the same text as step 3's
    with pytest.raises(SystemExit, match="python -m flashtrain.generate: " + _stops(run, damaged_file, words)):
        generate.main([str(run / "checkpoints" / STEP_6), *args])


def test_init_from_takes_the_newest_intact_checkpoint_or_stops(damaged_run):
    run, damaged_file, words = damaged_run
    model_cfg = load_run_config(run).model
    intact = model_state(run / "checkpoints" / STEP_3)
    for init_from in (run, run.parent):  # a run directory; a directory of runs (runs/<name>: its newest run)
        model = model_cfg.build()
        with pytest.warns(DamagedCheckpointWarning, match=_skipped(run, damaged_file, words)):
            load_initial_weights(model, model_cfg, str(init_from), "repeat")
        loaded = {k: v for k, v in model.state_dict().items() if k in intact}
        assert _equal_tensors(loaded, intact)  # bit for bit the step-3 weights
    with pytest.raises(DamagedCheckpointError, match=_stops(run, damaged_file, words, "init_from=")):
        load_initial_weights(model_cfg.build(), model_cfg, str(run / "checkpoints" / STEP_6), "repeat")


def test_a_damaged_init_from_stops_the_start_before_data_is_prepared(damaged_run, tmp_path):
    run, damaged_file, words = damaged_run
    cache = tmp_path / "cache"
    init_from = f"init_from={run / 'checkpoints' / STEP_6}"
    with pytest.raises(DamagedCheckpointError, match=_stops(run, damaged_file, words, "init_from=")):
        train(compose_config(tiny_overrides(cache, init_from)), tmp_path / "new")
    assert not cache.exists()  # no data prepared


def test_the_loaders_read_the_checkpoint_the_start_verified_without_hashing_it_again(launched_run, monkeypatch):
    model_cfg = load_run_config(launched_run).model
    hashed = []
    monkeypatch.setattr(checkpoint_module, "_sha256", lambda path: hashed.append(path) or "")
    model = model_cfg.build()
    with init_from_verified(str(launched_run), launched_run / "checkpoints" / STEP_3):  # not its newest: that exact one
        note = load_initial_weights(model, model_cfg, str(launched_run), "repeat")
    assert hashed == [] and note.startswith("initialised from")
    intact = model_state(launched_run / "checkpoints" / STEP_3)
    assert _equal_tensors({k: v for k, v in model.state_dict().items() if k in intact}, intact)


def test_every_checkpoint_damaged_stops_each_reader(launched_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(launched_run, run)
    for ckpt in run_checkpoints(run):
        _truncate(ckpt / "model.safetensors")
    model_cfg = load_run_config(run).model
    none_intact = re.escape("none of the 2 checkpoints found is intact (each is named in a warning above); move them "
                            "away or ")
    with pytest.warns(DamagedCheckpointWarning), pytest.raises(DamagedCheckpointError,
                                                               match=f"{re.escape(str(run))}: {none_intact}name "
                                                                     f"another run"):
        load_run(run)
    with pytest.warns(DamagedCheckpointWarning), pytest.raises(DamagedCheckpointError,
                                                               match=f"init_from={re.escape(str(run))}: "
                                                                     f"{none_intact}name another init_from"):
        load_initial_weights(model_cfg.build(), model_cfg, str(run), "repeat")


# ---- pruning: damaged checkpoints are not counted toward trainer.keep_checkpoints ----------------------------------

EXACT = ["model.dropout=0.1", "model.attn_dropout=0.1", "trainer.max_steps=9", "trainer.log_interval=1",
         "trainer.eval_interval=3", "trainer.save_interval=3", "trainer.keep_checkpoints=3", "data.sample_tokens=0",
         "data.val_samples=16"]


@pytest.fixture(scope="module")
def nine_steps(cache_dir, tmp_path_factory):
    """A 9-step run, its checkpoints at steps 3, 6 and 9."""
    return train(compose_config(tiny_overrides(cache_dir, *EXACT)),
                 tmp_path_factory.mktemp("runs") / "test" / "2026-01-01_00-00-00")


@pytest.mark.parametrize("keep, after_stop, at_the_end", [(2, [6, 7], [7, 9]), (1, [7], [9])])
def test_a_damaged_checkpoint_skipped_by_resume_never_costs_an_intact_one(nine_steps, cache_dir, tmp_path, keep,
                                                                          after_stop, at_the_end):
    """resume=auto skips the damaged step 9 and resumes from step 6; the next save (step 7) keeps step 6 (keep=2)
    and itself (keep=1), and the damaged step 9, named, not counted; the run's own save of step 9 replaces it."""
    runs = tmp_path / "test"
    run = runs / "2026-01-01_00-00-00"
    shutil.copytree(nine_steps.run_dir / "checkpoints", run / "checkpoints")
    damaged = run / "checkpoints" / "step_00000009"
    _corrupt_4000_bytes(damaged / "model.safetensors")
    resume = [f"trainer.keep_checkpoints={keep}", "resume=auto"]
    with pytest.warns(DamagedCheckpointWarning) as caught:
        stopped = train(compose_config(tiny_overrides(cache_dir, *EXACT, *resume, "trainer.stop_step=7")),
                        runs / "later", runs)
    assert stopped.run_dir == run and stopped.checkpoint == run / "checkpoints" / "step_00000007"
    assert [c.name for c in run_checkpoints(run)] == [f"step_{s:08d}" for s in (*after_stop, 9)]
    assert checkpoint_problem(damaged) is not None and checkpoint_problem(stopped.checkpoint) is None
    named = (f"checkpoint {damaged} is damaged ({damaged / 'model.safetensors'} does not match its sha256 in the "
             f"manifest (same size, different bytes)): kept, not counted toward trainer.keep_checkpoints={keep}")
    assert [str(w.message) for w in caught].count(named) == 1  # named once, not at every save

    with pytest.warns(DamagedCheckpointWarning, match=f"skipping checkpoint {damaged}"):
        finished = train(compose_config(tiny_overrides(cache_dir, *EXACT, *resume)), runs / "last", runs)
    assert finished.run_dir == run and finished.final_step == 9
    assert [c.name for c in run_checkpoints(run)] == [f"step_{s:08d}" for s in at_the_end]
    assert all(checkpoint_problem(c) is None for c in run_checkpoints(run))


def test_pruning_counts_checkpoints_without_hashing(tmp_path, monkeypatch):
    """Pruning counts a checkpoint toward keep_checkpoints by the cheap check (its manifest readable, every file there
    at its recorded size): every save would otherwise hash up to keep - 1 checkpoints. Loading hashes."""
    run = tmp_path / "run"
    for step in (3, 6, 9, 12):
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * step)
        write_manifest(ckpt, step, config={})
    hashed = []
    original = checkpoint_module._sha256
    monkeypatch.setattr(checkpoint_module, "_sha256", lambda path: hashed.append(Path(path).parent.name) or
                        original(path))
    newest = run / "checkpoints" / "step_00000012"
    assert prune_after_resume(newest, keep=3) == [run / "checkpoints" / "step_00000003"]
    assert hashed == []
    changed = run / "checkpoints" / "step_00000009" / "model.safetensors"
    time.sleep(0.01)
    changed.write_bytes(changed.read_bytes()[::-1])  # the same size, other bytes: the cheap check counts it
    assert prune_after_resume(newest, keep=3) == [] and hashed == []
    changed.write_bytes(changed.read_bytes()[:100])  # resized: not counted, so step 6 stays too
    named = f"step_00000009 is damaged ({changed} has 100 bytes, its manifest says 2304)"
    with pytest.warns(DamagedCheckpointWarning, match=re.escape(named)):
        assert prune_after_resume(newest, keep=2) == []
    assert hashed == []
    assert [c.name for c in run_checkpoints(run)] == ["step_00000006", "step_00000009", "step_00000012"]


# ---- stop messages: the command that continues the run in place ---------------------------------------------------

NAN_PLUGIN = '''"""Test plugin: every training loss from the NAN_FROM_CALL-th call of LMTask.loss on is NaN."""
import itertools
import os

from flashtrain.data.lm import LMTask

_calls, _loss, _from = itertools.count(), LMTask.loss, int(os.environ["NAN_FROM_CALL"])


def _nan_loss(self, model, batch):
    value = _loss(self, model, batch)
    return value * float("nan") if next(_calls) >= _from else value


LMTask.loss = _nan_loss
'''


def _launch(args: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    """Run `args` in the repository, stdout and stderr in files beside `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.out", "w") as stdout, open(f"{out}.err", "w") as stderr:
        return subprocess.Popen(args, cwd=ROOT, env=env or ENV, stdout=stdout, stderr=stderr)


def _finish(proc: subprocess.Popen, out: Path) -> tuple[int, str, str]:
    code = proc.wait(timeout=500)
    return code, Path(f"{out}.out").read_text(), Path(f"{out}.err").read_text()


def _follow(command: str) -> list[str]:
    """The suggested command as this test runs it: `python` is this interpreter."""
    words = shlex.split(command)
    assert words[:2] == ["python", "launch.py"], command
    return [sys.executable, *words[1:]]


@pytest.mark.slow
def test_nonfinite_stop_suggests_a_lower_lr_and_the_suggestion_continues_the_run_in_place(cache_dir, tmp_path):
    run = tmp_path / "runs" / "nan"
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / "nan_after.py").write_text(NAN_PLUGIN)
    overrides = tiny_overrides(cache_dir, "trainer.max_steps=10", "trainer.log_interval=1", "trainer.save_interval=4",
                               "trainer.eval_interval=100", "trainer.keep_checkpoints=2",
                               "trainer.max_nonfinite_steps=2", "data.sample_tokens=0", "data.val_samples=8")
    env = {**ENV, "FLASHTRAIN_PLUGINS": "nan_after", "NAN_FROM_CALL": "6",  # steps 7, 7: NaN
           "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    code, out, err = _finish(_launch([sys.executable, "launch.py", *overrides, f"hydra.run.dir={run}"], run, env),
                             run)
    assert code == 1, err[-3000:]
    ckpt, earlier = run / "checkpoints" / STEP_6, run / "checkpoints" / "step_00000004"
    given = " ".join(shlex.quote(o) for o in overrides if not o.startswith("optim.lr="))
    # in place: this run's directory and resume=<it> (resume=auto could take a concurrent run of the recipe); back:
    # without hydra.run.dir, so a new run directory is made
    in_place = f"python launch.py {given} optim.lr=0.0015 hydra.run.dir={run} resume={run}"
    back = f"python launch.py {given} optim.lr=0.0015 resume={earlier}"
    assert (f"stopped: 2 steps in a row had a non-finite loss or gradient norm (trainer.max_nonfinite_steps=2); the "
            f"weights are those after step 6, the last finite one; checkpoint: {ckpt}. The same command would meet "
            f"the same steps again: lower the learning rate (optim.lr=0.003 now, e.g. optim.lr=0.0015) and continue "
            f"this run in place: {in_place}; or go back to the earlier checkpoint step_00000004 as well, in a new "
            f"run directory: {back}. Check the data too\n") in out

    code, out, err = _finish(_launch(_follow(in_place), tmp_path / "continued"), tmp_path / "continued")
    assert code == 0, err[-3000:]
    assert (f"resumed from {ckpt} at step 6; optim.lr=0.0015: the schedule continues at this peak learning rate (the "
            f"checkpoint's: 0.003)\n") in out
    records = read_metrics(run / "metrics.jsonl")  # the one history, continued
    assert [r["step"] for r in records if "train_loss" in r] == list(range(1, 11))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["nan", "nan.err", "nan.out"]  # no new run
    optim = load_run_config(run).optim
    lrs = {r["step"]: r["lr"] for r in records if "lr" in r}
    for step in range(1, 11):  # the schedule's factor at each step, times the peak of the launch that took it
        peak = 0.003 if step <= 6 else 0.0015
        factor = lr_factor(step - 1, optim.warmup_steps, 10, optim.min_lr_ratio, optim.schedule)
        assert lrs[step] == pytest.approx(peak * factor, rel=1e-12), step
