"""Atomic, verified checkpoints on top of Accelerate's save_state / load_state.

Layout of a run directory (runs/<name>/<time>/):
    checkpoints/step_00000100/   model, optimizer, scheduler, RNG states of every process, TrainState, manifest.json
    checkpoints/latest           name of the newest complete checkpoint
The model and optimizer files are Accelerate's for the run's engine: model.safetensors + optimizer.bin (one process,
DDP), or FSDP's pytorch_model_fsdp_0/ + optimizer_0/ (sharded: every process's shard, torch.distributed.checkpoint,
loadable by any number of processes) or pytorch_model_fsdp.bin (consolidated by rank 0). `model_state` reads the
weights of any of them.
A checkpoint is written into `checkpoints/.tmp-step_...` and renamed into place only once complete, so a run killed
mid-save never leaves a half checkpoint that `resume` would pick up. Its `manifest.json` (step, the model/data
configuration and its hash, every file's size and sha256, library versions) is written last, atomically; resume
trusts a checkpoint only when every file matches it, and otherwise warns, names the file and takes the one before.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator

MANIFEST = "manifest.json"
# what Accelerate's save_state writes for the model, by engine (accelerate.utils.constants: SAFE_WEIGHTS_NAME,
# FSDP_MODEL_NAME)
MODEL_FILES = {"model.safetensors": "one process or DDP", "pytorch_model_fsdp_0": "FSDP, sharded state dict",
               "pytorch_model_fsdp.bin": "FSDP, full state dict"}
# model/data keys that change how a run is computed, stored or shown, not what it trains: free to differ on resume
RUNTIME_KEYS = frozenset({"attn_impl", "num_proc", "num_workers", "cache_dir", "sample_tokens", "sample_prompt"})
CHECKPOINT_PREFIX = "step_"


@dataclass
class TrainState:
    """Everything besides model/optimizer/scheduler/RNG that a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    # training samples taken from the sampler, all processes together (skipped non-finite steps included): where the
    # data continues, whatever the number of processes and the micro-batch of the resumed run
    samples_consumed: int = 0
    tokens_seen: int = 0  # tokens trained on, all processes
    best_val_loss: float = float("inf")
    skipped_nonfinite: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm
    processes: int = 1  # processes of the run that saved it
    global_batch_size: int = 0  # sequences per optimizer step of the run that saved it
    # a checkpoint from before samples_consumed: the micro-batches each process had taken (None otherwise)
    legacy_batches_consumed: int | None = None

    def state_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key != "legacy_batches_consumed"}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, "legacy_batches_consumed" if key == "batches_consumed" else key, value)


def check_writable(*directories: Path) -> None:
    """Create each directory and write and remove a file in it: a run or checkpoint folder that cannot be written
    stops the start, not the first save (with every step before it lost). Each process probes with its own file."""
    for directory in directories:
        probe = Path(directory) / f".write-probe-{platform.node()}-{os.getpid()}"
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"probe")
            probe.unlink()
        except OSError as error:
            raise PermissionError(f"{directory} cannot be written ({type(error).__name__}: {error.strerror or error}); "
                                  f"the run saves its logs and checkpoints there. Make it writable or choose another "
                                  f"run directory (hydra.run.dir=...)") from error


@contextmanager
def accelerate_warnings_only():
    """Accelerate's INFO lines (six per save_state, naming where each file went) stay out of the progress bar;
    its warnings still show."""
    logger = logging.getLogger("accelerate")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class DamagedCheckpointWarning(UserWarning):
    """A checkpoint whose manifest is missing or does not match its files: skipped."""


class DamagedCheckpointError(RuntimeError):
    """The checkpoint named by resume= (or every checkpoint found) cannot be trusted."""


def config_fingerprint(cfg) -> dict:
    """The model and data configuration of `cfg` (a FlashtrainConfig), flat and JSON-normal: {"model": "GPT2Config",
    "model.n_layer": 2, ..., "data.seq_len": 128, ...}, without RUNTIME_KEYS."""
    flat = {"model": type(cfg.model).__name__, "data": type(cfg.data).__name__}
    for group in ("model", "data"):
        flat.update({f"{group}.{key}": value for key, value in asdict(getattr(cfg, group)).items()
                     if key not in RUNTIME_KEYS})
    return json.loads(json.dumps(flat, default=str))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("flashtrain", "torch", "accelerate", "safetensors", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def write_manifest(ckpt: Path, step: int, config: dict) -> None:
    """Describe every file of `ckpt` in its manifest.json; written last and atomically: its presence means complete."""
    files = {p.relative_to(ckpt).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MANIFEST}
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    manifest = {"step": step, "config_hash": config_hash, "config": config, "files": files, "versions": _versions()}
    _write_text_atomic(ckpt / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_manifest(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / MANIFEST).read_text())


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be trusted (manifest missing or unreadable; a file missing, resized or changed), or None."""
    manifest_path = Path(ckpt) / MANIFEST
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (a save cut short, or a checkpoint from before manifests)"
    try:
        files = read_manifest(ckpt)["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({type(err).__name__}: {err})"
    for name, expected in files.items():
        path = Path(ckpt) / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, its manifest says {expected['bytes']}"
        if _sha256(path) != expected["sha256"]:
            return f"{path} does not match its sha256 in the manifest (same size, different bytes)"
    return None


def config_differences(ckpt: Path, config: dict) -> list[str]:
    """The model/data keys whose value in `config` differs from the checkpoint's, as "key: checkpoint X, now Y"."""
    saved = read_manifest(ckpt)["config"]
    return [f"{key}: checkpoint {saved.get(key, '<absent>')!r}, now {config.get(key, '<absent>')!r}"
            for key in sorted(set(saved) | set(config)) if saved.get(key) != config.get(key)]


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, keep: int, config: dict) -> Path:
    """Save the full training state for `step` with its manifest (`config`: config_fingerprint of the run); returns
    the final checkpoint directory."""
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / checkpoint_name(step)
    tmp = ckpt_root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_root.glob(".tmp-step_*"):  # saves cut short by a kill
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    with accelerate_warnings_only():
        accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_manifest(tmp, step, config)
        if final.exists():  # re-saving the same step (e.g. a resumed run that stops at once)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(ckpt_root / "latest", final.name + "\n")
        _prune(ckpt_root, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(ckpt_root: Path, keep: int) -> None:
    for old in run_checkpoints(ckpt_root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def prune_after_resume(resumed: Path, keep: int) -> list[Path]:
    """A run resumed from `resumed` in its own run directory: delete what a killed launch of it left beyond `keep`
    (a kill between a save and its pruning, or during the pruning, leaves older checkpoints, some half deleted, and a
    run resumed at its last step saves nothing more that would prune them), and its unfinished saves (.tmp-step_*).
    Only checkpoints older than `resumed` go, the newest keep - 1 of them stay: newer ones (damaged, or else the resume
    would have taken them) are replaced when the run saves their step again. Returns the deleted paths."""
    ckpt_root = Path(resumed).parent
    older = [c for c in run_checkpoints(ckpt_root.parent) if c.name < Path(resumed).name]
    stale = older[:max(0, len(older) - (keep - 1))] + sorted(ckpt_root.glob(".tmp-step_*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def run_checkpoints(run_dir: Path) -> list[Path]:
    """The complete (renamed into place) checkpoints of one run directory, oldest first."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of one run directory, or None (not verified: init_from reads only weights)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    pointer = ckpt_root / "latest"
    if pointer.is_file():
        candidate = ckpt_root / pointer.read_text().strip()
        if candidate.is_dir():
            return candidate
    complete = run_checkpoints(run_dir)
    return complete[-1] if complete else None


def first_intact(candidates: list[Path]) -> Path | None:
    """The first checkpoint of `candidates` (newest first) that matches its manifest; each one skipped is named in a
    DamagedCheckpointWarning."""
    for ckpt in candidates:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping checkpoint {ckpt}: {problem}", DamagedCheckpointWarning, stacklevel=2)
    return None


def checkpoint_format(ckpt: Path) -> str:
    """Which engine wrote `ckpt`'s model: a value of MODEL_FILES. Raises FileNotFoundError when none is there."""
    for name, engine in MODEL_FILES.items():
        if (Path(ckpt) / name).exists():
            return engine
    raise FileNotFoundError(f"{ckpt} holds no model weights ({', '.join(MODEL_FILES)})")


def model_state(ckpt: Path) -> dict:
    """The model's state dict (full tensors, on the CPU) from a checkpoint of any engine (MODEL_FILES); needs no
    process group."""
    ckpt = Path(ckpt)
    engine = checkpoint_format(ckpt)
    if engine == MODEL_FILES["model.safetensors"]:
        from safetensors.torch import load_file

        return load_file(str(ckpt / "model.safetensors"))
    import torch

    if engine == MODEL_FILES["pytorch_model_fsdp.bin"]:
        return torch.load(ckpt / "pytorch_model_fsdp.bin", map_location="cpu", weights_only=True)
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:  # the shards gathered into one file, as Accelerate saves them: {"model": ...}
        dcp_to_torch_save(ckpt / "pytorch_model_fsdp_0", Path(tmp) / "model.pt")
        return torch.load(Path(tmp) / "model.pt", map_location="cpu", weights_only=True)["model"]


def resolve_resume(resume: str | None, runs_of_name: Path) -> Path | None:
    """Turn the `resume` setting into a verified checkpoint directory.

    None -> fresh run. "auto" -> the newest intact checkpoint of the newest run in runs/<name>/ (the run whose last
    checkpoint was written last; never an older sibling's), None if no run there has a checkpoint.
    A run directory -> its newest intact checkpoint. A checkpoint directory -> that checkpoint, which must be intact.
    Damaged checkpoints are skipped with a warning; when some exist but none is intact, DamagedCheckpointError.
    """
    if resume is None:
        return None
    path = Path(resume).expanduser()
    if resume != "auto" and path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX):
        if (problem := checkpoint_problem(path)) is not None:
            raise DamagedCheckpointError(
                f"resume={resume}: the checkpoint is damaged: {problem}. Name an older checkpoint, or the run "
                f"directory (resume={path.parent.parent}) to take its newest intact one.")
        return path
    if resume == "auto":
        runs = [run for run in Path(runs_of_name).glob("*") if run_checkpoints(run)]
        newest = max(runs, key=lambda run: max(c.stat().st_mtime for c in run_checkpoints(run)), default=None)
        candidates = run_checkpoints(newest)[::-1] if newest is not None else []
    elif path.is_dir() and (candidates := run_checkpoints(path)[::-1]):
        pass
    else:
        raise FileNotFoundError(f"resume={resume!r}: not a checkpoint directory nor a run directory with checkpoints")
    found = first_intact(candidates)
    if found is None and candidates:
        raise DamagedCheckpointError(f"resume={resume}: none of the {len(candidates)} checkpoints found is intact "
                                     f"(each is named in a warning above); move them away or start with resume=null")
    return found
