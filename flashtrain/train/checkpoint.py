"""Atomic checkpoints on top of Accelerate's save_state / load_state.

Layout of a run directory (runs/<name>/<time>/):
    checkpoints/step_00000100/   model, optimizer, scheduler, RNG states of every process, TrainState
    checkpoints/latest           name of the newest complete checkpoint
A checkpoint is written into `checkpoints/.tmp-step_...` and renamed into place only once complete, so a run killed
mid-save never leaves a half checkpoint that `resume` would pick up.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator

CHECKPOINT_PREFIX = "step_"


@dataclass
class TrainState:
    """Everything besides model/optimizer/scheduler/RNG that a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    batches_consumed: int = 0  # micro-batches taken from the training sampler (per process)
    tokens_seen: int = 0  # tokens trained on, all processes
    best_val_loss: float = float("inf")

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, keep: int) -> Path:
    """Save the full training state for `step`; returns the final checkpoint directory."""
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / checkpoint_name(step)
    tmp = ckpt_root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # re-saving the same step (e.g. a resumed run that stops at once)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(ckpt_root / "latest", final.name + "\n")
        _prune(ckpt_root, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    complete = sorted(p for p in ckpt_root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of one run directory, or None."""
    ckpt_root = Path(run_dir) / "checkpoints"
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        candidate = ckpt_root / pointer.read_text().strip()
        if candidate.is_dir():
            return candidate
    complete = sorted(p for p in ckpt_root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
    return complete[-1] if complete else None


def resolve_resume(resume: str | None, runs_of_name: Path) -> Path | None:
    """Turn the `resume` setting into a checkpoint directory.

    None -> fresh run. "auto" -> the newest checkpoint among all runs in runs/<name>/ (None if there is none).
    A path -> that checkpoint directory, or the newest checkpoint of that run directory.
    """
    if resume is None:
        return None
    if resume == "auto":
        found = [c for run in Path(runs_of_name).glob("*") if (c := latest_checkpoint(run)) is not None]
        if not found:
            return None
        return max(found, key=lambda c: (int(c.name[len(CHECKPOINT_PREFIX):]), c.stat().st_mtime))
    path = Path(resume).expanduser()
    if path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX):
        return path
    if path.is_dir() and (found := latest_checkpoint(path)) is not None:
        return found
    raise FileNotFoundError(f"resume={resume!r}: not a checkpoint directory nor a run directory with checkpoints")
