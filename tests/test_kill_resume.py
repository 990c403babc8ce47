"""kill -9 at random points of real `python launch.py` processes, each followed by `resume=auto`: every resumed
run repeats the uninterrupted run's losses bit for bit on the CPU, and no run loads a damaged checkpoint.

Half of the kill points are aimed at checkpoint writes (the moment `checkpoints/.tmp-step_*` appears, plus a random
delay of a few milliseconds), the others at training steps (a step's record in metrics.jsonl, plus a random delay):
they land in the forward/backward pass, validation, logging, the save itself (model, optimizer, RNG files,
manifest, rename, pruning) and start-up. Before each resume the test works out, from the files alone, which
checkpoint is the newest intact one; the resumed process must name exactly that one (or start fresh when there is
none). A lineage of kills ends when a launch finishes; its metrics.jsonl must hold every step once, with the
uninterrupted run's train and validation losses exactly.

The suite runs FLASHTRAIN_KILL_POINTS (default 4) kill points; the full loop:

    FLASHTRAIN_KILL_POINTS=20 python -m pytest tests/test_kill_resume.py -s   # prints the counts (about 3 minutes)

FLASHTRAIN_KILL_SEED picks another random schedule (default 22).
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashtrain.train.checkpoint import checkpoint_problem
from flashtrain.train.trainer import read_metrics
from test_train import ROOT, tiny_overrides

KILL_POINTS = int(os.environ.get("FLASHTRAIN_KILL_POINTS", "4"))
KILL_SEED = int(os.environ.get("FLASHTRAIN_KILL_SEED", "22"))
KILLS_PER_LINEAGE = 5  # then the lineage runs to its end and is compared; the next kills start a new one
MAX_STEPS, SAVE_INTERVAL = 24, 3
# dropout everywhere (a resume must restore every RNG), checkpoints every 3 steps with 2 kept (pruning runs),
# validation every 6 steps on 8 sequences
RUN = ["model.dropout=0.1", "model.attn_dropout=0.1", f"trainer.max_steps={MAX_STEPS}", "trainer.log_interval=1",
       "trainer.eval_interval=6", f"trainer.save_interval={SAVE_INTERVAL}", "trainer.keep_checkpoints=2",
       "data.val_samples=8", "data.sample_tokens=0"]
# unbuffered: the test reads what a launch resumed, and where it writes, while it runs
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def launch(cache, run_dir: Path, *extra) -> subprocess.Popen:
    """`python launch.py` writing into run_dir (hydra.run.dir), stdout and stderr into files beside it."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.out", "w") as out, open(f"{run_dir}.err", "w") as err:
        return subprocess.Popen([sys.executable, "launch.py", *tiny_overrides(cache, *RUN, *extra),
                                 f"hydra.run.dir={run_dir}"], cwd=ROOT, env=ENV, stdout=out, stderr=err)


def whole_records(metrics: Path) -> list[dict]:
    """The records of a metrics.jsonl being written (a last line cut short is left out)."""
    records = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def losses(records, key="train_loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def checkpoints(lineage: Path) -> list[Path]:
    """Every complete-named checkpoint (renamed into place) of every run directory of a lineage, oldest step first."""
    return sorted(lineage.glob("*/checkpoints/step_*"), key=lambda p: p.name)


def newest_intact(lineage: Path) -> Path | None:
    """What resume=auto must take, worked out from the files: the newest checkpoint that matches its manifest."""
    return next((c for c in reversed(checkpoints(lineage)) if checkpoint_problem(c) is None), None)


def run_dir_of(out: Path) -> Path | None:
    """The run directory a launch writes into, from its start-up line ("...; run dir: PATH")."""
    found = re.search(r"run dir: (\S+)", out.read_text()) if out.is_file() else None
    return Path(found.group(1)) if found else None


def kill_at(proc, out: Path, kind: str, rng: random.Random, resumed_step: int) -> dict | None:
    """kill -9 `proc` at a point of `kind` ("save": a checkpoint write starting; "step": a step's record) after
    resumed_step; None when the process ended first."""
    deadline = time.monotonic() + 300
    saves = range(resumed_step + SAVE_INTERVAL - resumed_step % SAVE_INTERVAL, MAX_STEPS + 1, SAVE_INTERVAL)
    if resumed_step >= MAX_STEPS:  # killed after the last checkpoint: the resume only finishes
        return None
    # a step or a checkpoint write still ahead of this launch, the last ones included
    target = rng.choice(saves) if kind == "save" else rng.randint(resumed_step + 1, MAX_STEPS)
    delay = rng.uniform(0, 0.012 if kind == "save" else 0.03)
    run_dir = None
    while proc.poll() is None and time.monotonic() < deadline:
        run_dir = run_dir or run_dir_of(out)
        if run_dir is not None:
            if kind == "save":
                hit = (run_dir / "checkpoints" / f".tmp-step_{target:08d}").exists()
            else:
                hit = any(r["step"] >= target for r in whole_records(run_dir / "metrics.jsonl") if "train_loss" in r)
            if hit:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=60)
                cut = (run_dir / "checkpoints" / f".tmp-step_{target:08d}").exists()
                return {"kind": kind, "target": target, "delay_ms": round(delay * 1000, 1), "save_cut_short": cut}
        time.sleep(0.001)
    return None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (its data cache is shared with every later launch)."""
    tmp = tmp_path_factory.mktemp("kill")
    proc = launch(tmp / "cache", tmp / "reference")
    assert proc.wait(timeout=600) == 0, Path(f"{tmp / 'reference'}.err").read_text()[-3000:]
    return tmp, read_metrics(tmp / "reference" / "metrics.jsonl")


def wait_for_start(proc, out: Path) -> str:
    """The launch's stdout once it says where it runs (after saying what it resumed), or once it ended."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and run_dir_of(out) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return out.read_text()


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_auto_repeats_the_uninterrupted_run(reference):
    tmp, ref = reference
    assert sorted(losses(ref)) == list(range(1, MAX_STEPS + 1))
    rng = random.Random(KILL_SEED)
    kills, lineages, resumes, fresh_starts, damaged_on_disk = [], 0, 0, 0, 0
    while len(kills) < KILL_POINTS:
        lineage = tmp / f"lineage{lineages}"
        lineages += 1
        number, expected = 0, None
        while True:  # launches of one lineage: each killed, and resumed by the next, until one finishes
            out = lineage / f"launch{number}"
            proc = launch(tmp / "cache", out, *(("resume=auto",) if number else ()))
            resumed_step = 0
            if number:  # the resume must take the checkpoint worked out from the files, or start fresh
                said = wait_for_start(proc, Path(f"{out}.out"))
                resumed = re.search(r"resumed from (\S+) at step (\d+)", said)
                if expected is None:
                    assert resumed is None and "no checkpoint found" in said and "starting fresh" in said, said
                    fresh_starts += 1
                else:
                    assert resumed is not None and resumed.group(1) == str(expected), (said, kills[-1])
                    resumed_step, resumes = int(resumed.group(2)), resumes + 1
            kind = "save" if len(kills) % 2 == 0 else "step"
            kill = kill_at(proc, Path(f"{out}.out"), kind, rng, resumed_step) \
                if len(kills) < KILL_POINTS and number < KILLS_PER_LINEAGE else None
            if kill is None:  # no kill left to make, or the launch ended first: it must have finished the run
                assert proc.wait(timeout=300) == 0, Path(f"{out}.err").read_text()[-3000:]
                break
            expected = newest_intact(lineage)
            damaged = [c for c in checkpoints(lineage) if checkpoint_problem(c) is not None]
            damaged_on_disk += bool(damaged)
            kills.append({**kill, "lineage": lineages - 1, "resumed_step": resumed_step,
                          "next_resumes": expected and expected.name, "damaged_on_disk": [c.name for c in damaged]})
            number += 1
        finished = run_dir_of(Path(f"{out}.out"))
        records = read_metrics(finished / "metrics.jsonl")
        assert [r["step"] for r in records if "train_loss" in r] == list(range(1, MAX_STEPS + 1)), finished
        assert losses(records) == losses(ref), finished  # bit for bit, over the whole history
        assert losses(records, "val_loss") == losses(ref, "val_loss")
        assert [c.name for c in sorted((finished / "checkpoints").glob("step_*"))] == \
            [f"step_{MAX_STEPS - SAVE_INTERVAL:08d}", f"step_{MAX_STEPS:08d}"]  # exactly the newest 2 kept
    cut = sum(k["save_cut_short"] for k in kills)
    print(f"\nkill -9 points: {len(kills)} ({sum(k['kind'] == 'save' for k in kills)} aimed at checkpoint writes, "
          f"{cut} of them cutting a write short), lineages: {lineages}, resumes from a checkpoint: {resumes}, fresh "
          f"starts: {fresh_starts}, resumes with a damaged checkpoint on disk: {damaged_on_disk}; every lineage "
          f"matched the uninterrupted run's {MAX_STEPS} losses bit for bit; no damaged checkpoint was loaded")
    for k in kills:
        print(f"  {k}")
    assert len(kills) == KILL_POINTS and cut >= 1
