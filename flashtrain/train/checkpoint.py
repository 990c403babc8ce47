"""Atomic, verified checkpoints on top of Accelerate's save_state / load_state.

Layout of a run directory (runs/<name>/<time>/):
    checkpoints/step_00000100/   model, optimizer, scheduler, RNG states of every process, TrainState, manifest.json
The model and optimizer files are Accelerate's for the run's engine: model.safetensors + optimizer.bin (one process,
DDP), or FSDP's pytorch_model_fsdp_0/ + optimizer_0/ (sharded: every process's shard, torch.distributed.checkpoint,
loadable by any number of processes) or pytorch_model_fsdp.bin (consolidated by rank 0). `model_state` reads the
weights of any of them.
A checkpoint is written into `checkpoints/.tmp-step_...` and renamed into place only once complete, so a run killed
mid-save never leaves a half checkpoint that `resume` would pick up. Its `manifest.json` (step, the model/data
configuration and its hash, every file's size and sha256, library versions) is written last, atomically; resume
trusts a checkpoint only when every file matches it, and otherwise warns, names the file and takes the one before.
Export, generation and `init_from` read weights through the same verification (`intact_checkpoint`). Pruning keeps
the newest `trainer.keep_checkpoints` intact checkpoints; damaged ones are not counted (`_prune`: a cheap check, the
manifest readable and every file there at its recorded size, or what a full verification of this process found).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import shutil
import sys
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


# what this process found of each checkpoint it wrote or fully verified: str(path) -> (the files' sizes, mtimes and
# inodes then, its problem or None). Pruning, on every save, counts through it and otherwise through the cheap check
# (`size_problem`): it never hashes. Loading (resume, export, generation, init_from) always hashes.
_KNOWN: dict[str, tuple[tuple, str | None]] = {}


def _file_stats(ckpt: Path) -> tuple:
    return tuple(sorted((p.relative_to(ckpt).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino)
                        for p in Path(ckpt).rglob("*") if p.is_file() and (st := p.stat())))


def _remember(ckpt: Path, problem: str | None) -> None:
    _KNOWN[str(ckpt)] = (_file_stats(ckpt), problem)


def _known_problem(ckpt: Path) -> str | None:
    """For pruning: what this process found when it wrote or fully verified `ckpt`, if its files are unchanged since;
    otherwise the cheap check (`size_problem`). Never hashes."""
    known = _KNOWN.get(str(ckpt))
    if known is not None and known[0] == _file_stats(ckpt):
        return known[1]
    return size_problem(ckpt)


def _manifest_files(ckpt: Path) -> tuple[dict | None, str | None]:
    """(the manifest's files, None) or (None, why the manifest cannot be read)."""
    manifest_path = Path(ckpt) / MANIFEST
    if not manifest_path.is_file():
        return None, f"{manifest_path} is missing (a save cut short, or a checkpoint from before manifests)"
    try:
        return dict(read_manifest(ckpt)["files"]), None
    except (ValueError, KeyError, TypeError) as err:
        return None, f"{manifest_path} is unreadable ({type(err).__name__}: {err})"


def size_problem(ckpt: Path) -> str | None:
    """The cheap check: why `ckpt` cannot be trusted by its manifest (missing or unreadable) and its files' presence
    and sizes, or None; no file is hashed (`checkpoint_problem` does, for loading)."""
    files, problem = _manifest_files(ckpt)
    if problem is not None:
        return problem
    for name, expected in files.items():
        path = Path(ckpt) / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, its manifest says {expected['bytes']}"
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be trusted (manifest missing or unreadable; a file missing, resized or changed), or None."""
    if (problem := size_problem(ckpt)) is not None:
        return problem
    for name, expected in _manifest_files(ckpt)[0].items():
        if _sha256(Path(ckpt) / name) != expected["sha256"]:
            return f"{Path(ckpt) / name} does not match its sha256 in the manifest (same size, different bytes)"
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
        if final.exists():  # re-saving the same step (e.g. a resumed run that stops at once, or a damaged one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _remember(final, None)  # written here, its manifest from these very files: known intact
        _prune(final, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(newest: Path, keep: int) -> list[Path]:
    """Delete what trainer.keep_checkpoints lets go, `newest` being the run's newest verified checkpoint (the one just
    written, or the one a run resumed from): it and the newest keep - 1 intact checkpoints before it stay; everything
    older than the oldest of those goes, damaged or not. Damaged checkpoints are not counted: one among the kept ones,
    or newer than `newest` (a resume skipped it; the run replaces it when it saves that step again), stays, named in
    a DamagedCheckpointWarning. Returns the deleted paths."""
    checkpoints = run_checkpoints(Path(newest).parent.parent)
    stale, intact_kept = [], 1
    for ckpt in reversed([c for c in checkpoints if c.name < Path(newest).name]):  # newest first
        if intact_kept >= keep:
            stale.append(ckpt)
        elif (problem := _known_problem(ckpt)) is None:
            intact_kept += 1
        else:
            _name_damaged(ckpt, problem, keep)
    for ckpt in (c for c in checkpoints if c.name > Path(newest).name):
        if (problem := _known_problem(ckpt)) is not None:
            _name_damaged(ckpt, problem, keep)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        _KNOWN.pop(str(path), None)
    return stale


_NAMED: dict[str, tuple] = {}  # damaged checkpoints _prune has named in this process: their files then


def _name_damaged(ckpt: Path, problem: str, keep: int) -> None:
    """Name a damaged checkpoint that pruning keeps, once (again when its files change)."""
    if _NAMED.get(str(ckpt)) != (stats := _file_stats(ckpt)):
        _NAMED[str(ckpt)] = stats
        warnings.warn(f"checkpoint {ckpt} is damaged ({problem}): kept, not counted toward "
                      f"trainer.keep_checkpoints={keep}", DamagedCheckpointWarning, stacklevel=3)


def prune_after_resume(resumed: Path, keep: int) -> list[Path]:
    """A run resumed from `resumed` in its own run directory: delete what a killed launch of it left beyond `keep`
    (a kill between a save and its pruning, or during the pruning, leaves older checkpoints, some half deleted, and a
    run resumed at its last step saves nothing more that would prune them), and its unfinished saves (.tmp-step_*).
    As every save prunes (`_prune`): `resumed` and the newest keep - 1 intact checkpoints before it stay, older ones go;
    newer ones (damaged, or else the resume would have taken them) are replaced when the run saves their step again.
    Returns the deleted paths."""
    stale = _prune(Path(resumed), keep)
    for path in sorted(Path(resumed).parent.glob(".tmp-step_*")):
        shutil.rmtree(path, ignore_errors=True)
        stale.append(path)
    return stale


def run_checkpoints(run_dir: Path) -> list[Path]:
    """The complete (renamed into place) checkpoints of one run directory, oldest first."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def first_intact(candidates: list[Path]) -> Path | None:
    """The first checkpoint of `candidates` (newest first) that matches its manifest; each one skipped is named in a
    DamagedCheckpointWarning."""
    for ckpt in candidates:
        problem = checkpoint_problem(ckpt)
        _remember(ckpt, problem)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping checkpoint {ckpt}: {problem}", DamagedCheckpointWarning, stacklevel=2)
    return None


def _newest_run(runs: Path) -> Path | None:
    """Of the run directories in `runs` (runs/<name>), the one whose last checkpoint was written last."""
    found = [run for run in Path(runs).glob("*") if run_checkpoints(run)]
    return max(found, key=lambda run: max(c.stat().st_mtime for c in run_checkpoints(run)), default=None)


def intact_checkpoint(path: str | Path, setting: str | None = None, runs: bool = True,
                      remedy: str = "move them away or name another run", label: str | None = None) -> Path | None:
    """The checkpoint that `path` names, verified as resume does (the manifest's size and sha256 of every file):

    a checkpoint directory (step_N)  -> it; damaged, DamagedCheckpointError naming the file
    a run directory                  -> its newest intact checkpoint
    a directory of runs (runs/<name>, with runs=True) -> the newest intact checkpoint of its newest run (the run whose
                                        last checkpoint was written last), as resume=auto
    Each damaged checkpoint skipped is named in a DamagedCheckpointWarning; none intact: DamagedCheckpointError
    (ending with `remedy`). None when `path` holds no checkpoint at all. The messages start with `setting`=path
    ("resume=...", "init_from=..."), or with the path alone (or with `label`)."""
    path = Path(path).expanduser()
    label = label or (f"{setting}={path}" if setting else str(path))
    if path.name.startswith(CHECKPOINT_PREFIX) and path.is_dir():
        if (problem := checkpoint_problem(path)) is not None:
            run = f"{setting}={path.parent.parent}" if setting else path.parent.parent
            raise DamagedCheckpointError(f"{label}: the checkpoint is damaged: {problem}. Name an older checkpoint, or "
                                         f"the run directory ({run}) to take its newest intact one.")
        return path
    run = path if run_checkpoints(path) else _newest_run(path) if runs and path.is_dir() else None
    candidates = run_checkpoints(run)[::-1] if run is not None else []
    found = first_intact(candidates)
    if found is None and candidates:
        raise DamagedCheckpointError(f"{label}: none of the {len(candidates)} checkpoints found is intact (each is "
                                     f"named in a warning above); {remedy}")
    return found


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


# init_from -> its checkpoint as the run's start found and verified it (`init_from_verified`): read as it is
_INIT_FROM: dict[str, Path] = {}


def resolve_init_from(init_from: str | None) -> Path | None:
    """The checkpoint a flashtrain init_from names (a checkpoint, a run directory: its newest intact checkpoint, a
    directory of runs: its newest run's), verified as resume does (`intact_checkpoint`: a damaged one named, or none
    intact, stops with a DamagedCheckpointError naming the file); None for hf:NAME_OR_PATH or a path without
    checkpoints. Inside `init_from_verified` the checkpoint verified at the start, without hashing it again."""
    if init_from is None or init_from.startswith("hf:"):
        return None
    if init_from in _INIT_FROM:
        return _INIT_FROM[init_from]
    return intact_checkpoint(init_from, "init_from", runs=True, remedy="move them away or name another init_from")


@contextmanager
def init_from_verified(init_from: str, checkpoint: Path | None):
    """Within: `resolve_init_from(init_from)` (so every model's loader, `checkpoint_weights`) gives `checkpoint`, as
    the run's start found and verified it on the main process (the trainer shares it with every process)."""
    if checkpoint is not None:
        _INIT_FROM[init_from] = Path(checkpoint)
    try:
        yield
    finally:
        _INIT_FROM.pop(init_from, None)


def resolve_resume(resume: str | None, runs_of_name: Path) -> Path | None:
    """Turn the `resume` setting into a verified checkpoint directory (`intact_checkpoint`).

    None -> fresh run. "auto" -> the newest intact checkpoint of the newest run in runs/<name>/ (the run whose last
    checkpoint was written last; never an older sibling's), None if no run there has a checkpoint.
    A run directory -> its newest intact checkpoint. A checkpoint directory -> that checkpoint, which must be intact.
    Damaged checkpoints are skipped with a warning; when some exist but none is intact, DamagedCheckpointError.
    """
    if resume is None:
        return None
    remedy = "move them away or start with resume=null"
    if resume == "auto":
        newest = _newest_run(runs_of_name)
        return None if newest is None else intact_checkpoint(newest, runs=False, remedy=remedy, label="resume=auto")
    found = intact_checkpoint(resume, "resume", runs=False, remedy=remedy)
    if found is None:
        raise FileNotFoundError(f"resume={resume!r}: not a checkpoint directory nor a run directory with checkpoints")
    return found


def _hydra_launch():
    """This launch's HydraConfig (a launch.py run), or None."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


# the overrides that name a launch's directory: left out of a command that starts a new run directory
RUN_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def continue_command(num_processes: int = 1, drop: tuple[str, ...] = (), **changes: str) -> str | None:
    """This launch's command with `changes` (key=value, e.g. resume="auto") in place of those keys and without the
    keys in `drop`: its launcher, its overrides (Hydra's: the task's and the hydra.* ones given; a sweep's job its own,
    with -m); None outside a launch.py run."""
    hydra = _hydra_launch()
    if hydra is None:
        return None
    given = [o for o in [*hydra.overrides.task, *hydra.overrides.hydra] if not o.startswith("hydra.mode=")]
    kept = [o for o in given if o.split("=", 1)[0].lstrip("+~") not in (*changes, *drop)]
    multirun = ["-m"] if str(hydra.mode) == "RunMode.MULTIRUN" else []
    launcher = "python" if num_processes == 1 else f"<the same launcher of {num_processes} processes>"
    words = [sys.argv[0], *multirun, *kept, *(f"{key}={value}" for key, value in changes.items())]
    return " ".join([launcher, *map(shlex.quote, words)])


def _command(num_processes: int, drop: tuple[str, ...] = (), **changes: str) -> str:
    """continue_command, or outside a launch.py run "the same command with key=value ..."."""
    return continue_command(num_processes, drop, **changes) or \
        "the same command with " + " ".join(f"{key}={value}" for key, value in changes.items())


def _in_a_sweep() -> bool:
    hydra = _hydra_launch()
    return hydra is not None and str(hydra.mode) == "RunMode.MULTIRUN"


def in_place(run_dir: Path) -> dict[str, str]:
    """The settings that continue the run of `run_dir` in place: outside a sweep hydra.run.dir=RUN resume=RUN (the
    launch's directory is the run's, and resume takes its newest intact checkpoint; never another run's); a sweep's job
    resume=auto (its directory is named for its overrides, so only its own runs are beside it)."""
    return {"resume": "auto"} if _in_a_sweep() else {"hydra.run.dir": str(run_dir), "resume": str(run_dir)}


def continue_advice(checkpoint: Path, num_processes: int = 1, nonfinite_lr: float | None = None) -> str:
    """The end of a stop message: how to go on from `checkpoint`. After a signal or trainer.max_minutes: the command
    that continues this run in place (`continue_command` with `in_place`). After non-finite steps (`nonfinite_lr`:
    optim.lr now): the same command would meet them again; a lower optim.lr, continuing in place (a sweep job from this
    checkpoint, in a new run directory: its directory is named for its optim.lr) or from the earlier checkpoint, in a
    new run directory (without the launch's hydra.run.dir / hydra.sweep.dir / hydra.sweep.subdir)."""
    checkpoint = Path(checkpoint)
    run_dir = checkpoint.parent.parent
    if nonfinite_lr is None:
        return ("Continue this run in place (its metrics.jsonl and checkpoints) with: "
                + _command(num_processes, **in_place(run_dir)))
    half = f"{nonfinite_lr / 2:g}"
    if _in_a_sweep():
        options = [f"start a new run directory from this checkpoint (a sweep job's directory is named for its "
                   f"optim.lr): {_command(num_processes, **{'optim.lr': half, 'resume': str(checkpoint)})}"]
    else:
        options = [f"continue this run in place: {_command(num_processes, **{'optim.lr': half}, **in_place(run_dir))}"]
    earlier = next((c for c in reversed(run_checkpoints(run_dir))
                    if c.name < checkpoint.name and _known_problem(c) is None), None)
    if earlier is not None:
        options.append(f"go back to the earlier checkpoint {earlier.name} as well, in a new run directory: "
                       f"{_command(num_processes, RUN_DIR_KEYS, **{'optim.lr': half, 'resume': str(earlier)})}")
    return (f"The same command would meet the same steps again: lower the learning rate (optim.lr={nonfinite_lr:g} "
            f"now, e.g. optim.lr={half}) and " + "; or ".join(options) + ". Check the data too")


def use_configured_lr(scheduler, lr: float) -> str:
    """After load_state: the learning-rate schedule continues at the peak it was saved with (its base_lrs); a run
    resumed with another optim.lr continues it at the new one, from the same step. Returns what to add to the
    "resumed from" line: "" when optim.lr is the checkpoint's. `scheduler` must be a LambdaLR (its lr_lambdas give
    the factor of each step)."""
    from torch.optim.lr_scheduler import LambdaLR

    if not isinstance(scheduler, LambdaLR):
        raise TypeError(f"use_configured_lr: the scheduler is a {type(scheduler).__name__}, not a "
                        f"torch.optim.lr_scheduler.LambdaLR; only a LambdaLR's schedule can continue at another peak "
                        f"learning rate (build_scheduler makes one)")
    saved = list(scheduler.base_lrs)
    if all(base == lr for base in saved):
        return ""
    scheduler.base_lrs = [lr] * len(saved)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return f"; optim.lr={lr:g}: the schedule continues at this peak learning rate (the checkpoint's: {saved[0]:g})"
