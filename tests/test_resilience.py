"""Runs that survive damage: verified checkpoints (manifest, fallback to the last good one, config check),
non-finite steps skipped and stopped, SIGINT/SIGTERM ending with a checkpoint."""

import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from flashtrain.data.lm import LMTask

from flashtrain.train import train
from flashtrain.train.checkpoint import (DamagedCheckpointError, DamagedCheckpointWarning, checkpoint_problem,
                                         prune_after_resume, read_manifest, resolve_resume, run_checkpoints,
                                         write_manifest)
from flashtrain.train.trainer import read_metrics
from hydra_config import compose_config
from test_train import ROOT, tiny_overrides

# 9 steps, dropout on (a resume must restore the RNG states), checkpoints at 3, 6 and 9 (all kept)
EXACT = ["model.dropout=0.1", "model.attn_dropout=0.1", "trainer.max_steps=9", "trainer.log_interval=1",
         "trainer.eval_interval=3", "trainer.save_interval=3", "trainer.keep_checkpoints=3", "data.sample_tokens=0",
         "data.val_samples=16"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache-resilience")


@pytest.fixture(scope="module")
def full_run(cache_dir, tmp_path_factory):
    """The uninterrupted run, its checkpoints at steps 3, 6 and 9."""
    runs = tmp_path_factory.mktemp("runs")
    return train(compose_config(tiny_overrides(cache_dir, *EXACT)), runs / "test" / "2026-01-01_00-00-00")


def losses(history, key="train_loss"):
    return {r["step"]: r[key] for r in history if key in r}


@pytest.mark.slow
def test_manifest_describes_every_file(full_run):
    ckpt = full_run.checkpoint
    manifest = read_manifest(ckpt)
    files = sorted(p.name for p in ckpt.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == files and "model.safetensors" in files and "random_states_0.pkl" in files
    assert all(manifest["files"][f]["bytes"] == (ckpt / f).stat().st_size for f in files)
    assert manifest["step"] == 9 and manifest["config"]["model.n_embd"] == 64
    assert manifest["config"]["model"] == "GPT2Config" and "data.cache_dir" not in manifest["config"]
    assert len(manifest["config_hash"]) == 64 and manifest["versions"]["torch"]
    assert [c.name for c in run_checkpoints(full_run.run_dir)] == ["step_00000003", "step_00000006", "step_00000009"]
    assert all(checkpoint_problem(c) is None for c in run_checkpoints(full_run.run_dir))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt_same_size(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))


DAMAGES = {  # name: (file, damage, words the warning uses)
    "weights truncated": ("model.safetensors", _truncate, "bytes, its manifest says"),
    "weights deleted": ("model.safetensors", lambda p: p.unlink(), "is missing"),
    "weights same-size corrupted": ("model.safetensors", _corrupt_same_size, "does not match its sha256"),
    "optimizer truncated": ("optimizer.bin", _truncate, "bytes, its manifest says"),
    "optimizer deleted": ("optimizer.bin", lambda p: p.unlink(), "is missing"),
    "rng states truncated": ("random_states_0.pkl", _truncate, "bytes, its manifest says"),
    "rng states deleted": ("random_states_0.pkl", lambda p: p.unlink(), "is missing"),
    "rng states same-size corrupted": ("random_states_0.pkl", _corrupt_same_size, "does not match its sha256"),
    "manifest missing": ("manifest.json", lambda p: p.unlink(), "is missing \\(a save cut short"),
    "manifest half-written": ("manifest.json", _truncate, "is unreadable \\(JSONDecodeError"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_checkpoint_falls_back_to_the_last_good_one(full_run, tmp_path, damage):
    filename, apply, words = DAMAGES[damage]
    runs = tmp_path / "test"
    run = runs / "2026-01-01_00-00-00"
    shutil.copytree(full_run.run_dir / "checkpoints", run / "checkpoints")
    (run / "checkpoints" / "step_00000003").rename(run / "checkpoints" / "old-step_3")  # the good one is step 6
    newest = run / "checkpoints" / "step_00000009"
    apply(newest / filename)
    with pytest.warns(DamagedCheckpointWarning, match=f"skipping checkpoint {newest}: .*{filename}.*{words}"):
        assert resolve_resume("auto", runs) == run / "checkpoints" / "step_00000006"
    with pytest.warns(DamagedCheckpointWarning, match=filename):
        assert resolve_resume(str(run), runs) == run / "checkpoints" / "step_00000006"
    # named explicitly, a damaged checkpoint stops the start, naming the file
    with pytest.raises(DamagedCheckpointError, match=f"the checkpoint is damaged: .*{filename}"):
        resolve_resume(str(newest), runs)


def test_resume_falls_back_and_continues_exactly(full_run, cache_dir, tmp_path, capsys):
    """The newest checkpoint's weights corrupted at the same size: resume=auto warns, takes step 6, and the resumed
    losses equal the uninterrupted run's bit for bit."""
    runs = tmp_path / "test"
    run = runs / "2026-01-01_00-00-00"
    shutil.copytree(full_run.run_dir / "checkpoints", run / "checkpoints")
    _corrupt_same_size(run / "checkpoints" / "step_00000009" / "model.safetensors")
    with pytest.warns(DamagedCheckpointWarning, match="step_00000009/model.safetensors does not match"):
        resumed = train(compose_config(tiny_overrides(cache_dir, *EXACT, "resume=auto")), runs / "later", runs)
    assert f"resumed from {run / 'checkpoints' / 'step_00000006'} at step 6" in capsys.readouterr().out
    assert resumed.final_step == 9 and sorted(losses(resumed.history)) == [7, 8, 9]
    for step in (7, 8, 9):
        assert losses(resumed.history)[step] == losses(full_run.history)[step], step
    assert losses(resumed.history, "val_loss")[9] == losses(full_run.history, "val_loss")[9]


def test_resume_auto_continues_the_newest_run_in_its_own_directory(full_run, cache_dir, tmp_path):
    """resume=auto takes the newest run (an older run's higher step is not its lineage), writes into that run's
    directory, drops the records after its checkpoint (work lost, redone) and appends: one history, one curves.png."""
    runs = tmp_path / "test"
    run = runs / "2026-01-02_00-00-00"
    shutil.copytree(full_run.run_dir, run)
    shutil.rmtree(run / "checkpoints" / "step_00000009")  # interrupted after step 9's records, before its save
    older = runs / "2026-01-01_00-00-00"  # an older sibling with a higher step
    shutil.copytree(full_run.run_dir / "checkpoints" / "step_00000009", older / "checkpoints" / "step_00000012")
    os.utime(older / "checkpoints" / "step_00000012", (1e9, 1e9))
    (run / "curves.png").unlink()
    assert resolve_resume("auto", runs) == run / "checkpoints" / "step_00000006"

    resumed = train(compose_config(tiny_overrides(cache_dir, *EXACT, "resume=auto")), runs / "this-launch", runs)
    assert resumed.run_dir == run and not (runs / "this-launch").exists()
    assert read_metrics(run / "metrics.jsonl") == resumed.history
    assert [r["step"] for r in resumed.history if "train_loss" in r] == list(range(1, 10))  # each step once
    assert losses(resumed.history) == losses(full_run.history)  # bit for bit, over the whole history
    assert losses(resumed.history, "val_loss") == losses(full_run.history, "val_loss")
    assert (run / "curves.png").stat().st_size > 10_000
    assert [c.name for c in run_checkpoints(run)] == ["step_00000003", "step_00000006", "step_00000009"]


def test_a_resumed_run_prunes_what_a_killed_launch_left(tmp_path):
    """A launch killed between its last save and that save's pruning (or during the pruning) leaves older
    checkpoints, one half deleted; the launch that resumes the run at its last step saves nothing more. So the
    resume prunes: older checkpoints beyond keep - 1 go, with unfinished saves; the resumed one and newer ones stay."""
    run = tmp_path / "run"

    def make(*steps, damaged=()):
        shutil.rmtree(run, ignore_errors=True)
        for step in steps:
            ckpt = run / "checkpoints" / f"step_{step:08d}"
            ckpt.mkdir(parents=True)
            (ckpt / "model.safetensors").write_bytes(bytes(step))
            if step not in damaged:
                write_manifest(ckpt, step, config={})
        (run / "checkpoints" / ".tmp-step_00000027").mkdir()

    def names():
        return [c.name for c in run_checkpoints(run)] + [p.name for p in (run / "checkpoints").glob(".tmp-*")]

    make(15, 18, 21, 24, damaged=(15,))  # killed while deleting step 15, after saving step 24
    removed = prune_after_resume(run / "checkpoints" / "step_00000024", keep=2)
    assert names() == ["step_00000021", "step_00000024"] and len(removed) == 3
    named = "step_00000021 is damaged .*manifest.json is missing.*: kept, not counted toward trainer.keep_checkpoints"
    make(15, 18, 21, damaged=(21,))  # the newest one damaged: the run resumes from 18 and will save 21 again
    with pytest.warns(DamagedCheckpointWarning, match=named + "=2"):
        prune_after_resume(run / "checkpoints" / "step_00000018", keep=2)
    assert names() == ["step_00000015", "step_00000018", "step_00000021"]
    make(15, 18, 21, damaged=(21,))
    with pytest.warns(DamagedCheckpointWarning, match=named + "=1"):
        prune_after_resume(run / "checkpoints" / "step_00000018", keep=1)
    assert names() == ["step_00000018", "step_00000021"]


@pytest.mark.slow
def test_resume_auto_logs_into_the_same_wandb_run(cache_dir, tmp_path):
    runs = tmp_path / "test"
    wandb = ["logger=wandb", "logger.mode=offline"]
    first = train(compose_config(tiny_overrides(cache_dir, *EXACT, *wandb, "trainer.stop_step=3")), runs / "a", runs)
    run_id = (first.run_dir / "wandb_run_id").read_text().strip()
    second = train(compose_config(tiny_overrides(cache_dir, *EXACT, *wandb, "resume=auto")), runs / "b", runs)
    assert second.run_dir == first.run_dir and second.final_step == 9
    offline_runs = sorted((first.run_dir / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, where wandb adds -1, -2, ... when two runs of one id start in the same second
    same_run = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(offline_runs) == 2 and all(same_run.fullmatch(p.name) for p in offline_runs)


def test_every_checkpoint_damaged_stops(full_run, tmp_path):
    run = tmp_path / "test" / "run"
    shutil.copytree(full_run.run_dir / "checkpoints", run / "checkpoints")
    for ckpt in run_checkpoints(run):
        (ckpt / "manifest.json").unlink()
    with pytest.warns(DamagedCheckpointWarning), pytest.raises(DamagedCheckpointError, match="none of the 3"):
        resolve_resume("auto", tmp_path / "test")


def test_resume_with_another_configuration_lists_the_keys(full_run, cache_dir, tmp_path):
    other = tiny_overrides(cache_dir, *EXACT, "model.n_embd=32", "data.seq_len=64", f"resume={full_run.run_dir}")
    with pytest.raises(ValueError, match=r"another model/data configuration:\n  data.seq_len: checkpoint 128, now 64"
                                         r"\n  model.n_embd: checkpoint 64, now 32\nresume with the same"):
        train(compose_config(other), tmp_path / "run")
    # a key that changes only how the run is computed (attention implementation, cache) is free to differ
    same = tiny_overrides(cache_dir, *EXACT, "model.attn_impl=sdpa", "trainer.max_steps=10",
                          f"resume={full_run.run_dir}")
    assert train(compose_config(same), tmp_path / "run2").final_step == 10


def test_resume_allow_config_change_continues_with_the_new_configuration(full_run, cache_dir, tmp_path, capsys):
    changed = tiny_overrides(cache_dir, *EXACT, "data.seq_len=64", "trainer.max_steps=10",
                             f"resume={full_run.run_dir}", "resume_allow_config_change=true")
    result = train(compose_config(changed), tmp_path / "run")
    assert result.final_step == 10
    assert "resume_allow_config_change=true: continuing" in capsys.readouterr().out
    assert read_manifest(result.checkpoint)["config"]["data.seq_len"] == 64


# ---- non-finite steps --------------------------------------------------------------------------------------------


def _poison(monkeypatch, bad_calls, weights=False):
    """LMTask.loss returns NaN for the training micro-batches whose call number (from 0) is in `bad_calls`; with
    weights=True those calls also set a weight to NaN first (so every later loss is NaN too)."""
    calls, original = itertools.count(), LMTask.loss

    def loss(self, model, batch):
        bad = next(calls) in bad_calls
        if bad and weights:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        value = original(self, model, batch)
        return value * float("nan") if bad else value

    monkeypatch.setattr(LMTask, "loss", loss)


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_counted(full_run, cache_dir, tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, bad_calls={3, 4})  # the micro-batches of steps 4 and 5 (1 micro-batch per step)
    result = train(compose_config(tiny_overrides(cache_dir, *EXACT)), tmp_path / "run")
    out = capsys.readouterr().out
    assert "step 4: non-finite loss (nan) or gradient norm (nan): step skipped, 1 in a row " \
           "(trainer.max_nonfinite_steps=10), 1 in this run" in out
    assert "step 4: non-finite loss (nan) or gradient norm (nan): step skipped, 2 in a row " \
           "(trainer.max_nonfinite_steps=10), 2 in this run" in out
    assert result.final_step == 9 and result.exit_code == 0
    clean = losses(full_run.history)
    assert [losses(result.history)[s] for s in (1, 2, 3)] == [clean[s] for s in (1, 2, 3)]
    assert all(math.isfinite(v) for v in losses(result.history).values()) and sorted(losses(result.history)) == \
        list(range(1, 10))
    # no update and no scheduler step for a skipped step: 9 AdamW steps, the lr of step s is the clean run's
    assert losses(result.history, "lr") == losses(full_run.history, "lr")
    optimizer = torch.load(result.checkpoint / "optimizer.bin", weights_only=False)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {9.0}
    weights = load_file(str(result.checkpoint / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.slow
def test_nonfinite_steps_in_a_row_stop_with_the_last_finite_state(full_run, cache_dir, tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, bad_calls=set(range(3, 100)))  # every micro-batch after step 3
    result = train(compose_config(tiny_overrides(cache_dir, *EXACT, "trainer.max_nonfinite_steps=3")),
                   tmp_path / "run")
    assert result.final_step == 3 and result.exit_code == 1
    assert result.checkpoint == tmp_path / "run" / "checkpoints" / "step_00000003"
    assert ("stopped: 3 steps in a row had a non-finite loss or gradient norm (trainer.max_nonfinite_steps=3); the "
            "weights are those after step 3, the last finite one") in capsys.readouterr().out
    # exactly the uninterrupted run's weights after step 3
    saved = load_file(str(result.checkpoint / "model.safetensors"))
    clean = load_file(str(full_run.run_dir / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert saved.keys() == clean.keys() and all(torch.equal(saved[k], clean[k]) for k in saved)


def test_no_checkpoint_from_nonfinite_weights(cache_dir, tmp_path, monkeypatch):
    # step 5 makes a weight NaN: every later loss is NaN; 2 in a row stop the run, whose save is refused
    _poison(monkeypatch, bad_calls={4}, weights=True)
    overrides = tiny_overrides(cache_dir, *EXACT, "trainer.max_nonfinite_steps=2", "trainer.save_interval=2")
    with pytest.raises(FloatingPointError, match=r"step 4: the weights are not finite; no checkpoint written \(the "
                                                 r"last one: .*step_00000004\)"):
        train(compose_config(overrides), tmp_path / "run")
    assert [c.name for c in run_checkpoints(tmp_path / "run")] == ["step_00000002", "step_00000004"]


# ---- signals: a real `python launch.py` process -------------------------------------------------------------------

# ~13 ms a step on 2 idle CPU cores: signalled at step 10, 90 steps leave time to stop mid-run
LAUNCH = ["trainer.max_steps=100", "trainer.log_interval=1", "trainer.eval_interval=1000", "data.val_samples=16",
          "trainer.save_interval=1000", "data.sample_tokens=0", "model.dropout=0.1"]


def _launch(cache_dir, run_dir: Path, *extra):
    """`python launch.py` into run_dir, its stdout and stderr in files beside it (no pipe to fill)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.out", "w") as out, open(f"{run_dir}.err", "w") as err:
        return subprocess.Popen([sys.executable, "launch.py", *tiny_overrides(cache_dir, *LAUNCH, *extra),
                                 f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=out, stderr=err)


def _finish(proc, run_dir: Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a _launch process."""
    code = proc.wait(timeout=500)
    return code, Path(f"{run_dir}.out").read_text(), Path(f"{run_dir}.err").read_text()


def _whole_record(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _signal_at_step(proc, run_dir: Path, step: int, *signums):
    """Send `signums` once metrics.jsonl shows training step `step`."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        # the last line may be half-written: only whole records count
        if any(r["step"] >= step and "train_loss" in r for r in map(json.loads, filter(_whole_record, lines))):
            for signum in signums:
                proc.send_signal(signum)
            return
        time.sleep(0.002)
    raise AssertionError(f"the run ended before step {step}: {_finish(proc, run_dir)}")


@pytest.mark.slow
def test_sigint_saves_and_resume_repeats_the_uninterrupted_run(cache_dir, tmp_path):
    code, _, err = _finish(_launch(cache_dir, tmp_path / "full"), tmp_path / "full")
    assert code == 0, err[-3000:]
    interrupted = _launch(cache_dir, tmp_path / "interrupted")
    _signal_at_step(interrupted, tmp_path / "interrupted", 10, signal.SIGINT)
    code, out, err = _finish(interrupted, tmp_path / "interrupted")
    assert code == 130, err[-3000:]
    assert "SIGINT received: finishing step" in err
    stopped = [r["step"] for r in read_metrics(tmp_path / "interrupted" / "metrics.jsonl") if "train_loss" in r][-1]
    assert 10 <= stopped < 100
    ckpt = tmp_path / "interrupted" / "checkpoints" / f"step_{stopped:08d}"
    # the command that continues this run in place: its own overrides, hydra.run.dir=RUN and resume=RUN (not
    # resume=auto, which could take a concurrent run of the same recipe)
    run = tmp_path / "interrupted"
    command = "python launch.py " + " ".join(shlex.quote(o) for o in tiny_overrides(cache_dir, *LAUNCH)) + \
        f" hydra.run.dir={run} resume={run}"
    assert (f"stopped by SIGINT after step {stopped}; checkpoint: {ckpt}. Continue this run in place (its "
            f"metrics.jsonl and checkpoints) with: {command}\n") in out
    assert checkpoint_problem(ckpt) is None

    # followed as given: the same run directory continues, one metrics.jsonl with every step once
    words = shlex.split(command)
    with open(tmp_path / "resumed.out", "w") as stdout, open(tmp_path / "resumed.err", "w") as stderr:
        proc = subprocess.Popen([sys.executable, *words[1:]], cwd=ROOT, stdout=stdout, stderr=stderr,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    code, out, err = _finish(proc, tmp_path / "resumed")
    assert code == 0, err[-3000:]
    assert f"resumed from {ckpt} at step {stopped}" in out
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["full", "interrupted"]  # no new run
    full_records, resumed_records = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("full", "interrupted"))
    assert [r["step"] for r in resumed_records if "train_loss" in r] == list(range(1, 101))
    assert losses(resumed_records) == losses(full_records)  # bit for bit, before the signal and after
    assert losses(resumed_records, "val_loss")[100] == losses(full_records, "val_loss")[100]


@pytest.mark.slow
def test_second_signal_exits_at_once_without_a_checkpoint(cache_dir, tmp_path):
    proc = _launch(cache_dir, tmp_path / "run")
    _signal_at_step(proc, tmp_path / "run", 10, signal.SIGINT, signal.SIGTERM)
    code, out, err = _finish(proc, tmp_path / "run")
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGINT received: finishing step" in err
    assert "SIGTERM again: exiting now, without a checkpoint (the last one: None)" in err
    assert run_checkpoints(tmp_path / "run") == [] and "stopped by" not in out


@pytest.mark.slow
def test_sweep_jobs_resume_only_their_own_checkpoints(cache_dir, tmp_path):
    """`launch.py -m optim.lr=1e-3,3e-3 resume=auto`: each job continues its own run (its directory is keyed by its
    overrides), never the sibling job's."""
    base = [o for o in tiny_overrides(cache_dir, *EXACT) if not o.startswith("optim.lr=")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def sweep(*extra):
        proc = subprocess.run([sys.executable, "launch.py", "-m", *base, "optim.lr=1e-3,3e-3", *extra,
                               f"hydra.sweep.dir={tmp_path / 'test'}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=500)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    sweep("trainer.stop_step=3")
    time.sleep(1.1)  # the second launch's run directories would be named for another second anyway
    out = sweep("resume=auto")
    jobs = {}  # lr -> the job's run; each job's runs share one directory, named for its overrides
    for job_dir in (p for p in (tmp_path / "test").iterdir() if p.is_dir()):
        (run,) = [run for run in job_dir.iterdir() if (run / "metrics.jsonl").is_file()]  # the 2nd launch continued
        (lr,) = [o for o in yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text()) if o.startswith("optim.lr=")]
        jobs[lr] = run
        assert f"resumed from {run / 'checkpoints' / 'step_00000003'} at step 3" in out
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "train_loss" in r] == list(range(1, 10))
    assert sorted(jobs) == ["optim.lr=0.001", "optim.lr=0.003"]
    lrs = {lr: losses(read_metrics(run / "metrics.jsonl"), "lr") for lr, run in jobs.items()}
    assert all(lrs["optim.lr=0.003"][step] == pytest.approx(3 * lrs["optim.lr=0.001"][step], rel=1e-9)
               for step in range(1, 10))
