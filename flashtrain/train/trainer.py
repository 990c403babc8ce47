"""The training loop: Accelerate for devices, mixed precision and processes; atomic checkpoints; eval and logging.

`train(cfg, run_dir)` reads top to bottom: `Trainer.setup` (processes and devices, the batch plan, the attention
check, data, model, optimizer, resume), then `train_step` until the last step with `evaluate` and checkpoints on their
intervals, then `finish` (the task's other splits, the sample, the plots). One optimizer step =
trainer.global_batch_size samples: micro-batches of trainer.micro_batch_size on every process, as many per process as
it takes (flashtrain/train/processes.py); its loss is the mean over every loss term (token, sample) of those samples.
Under several processes (DDP or FSDP through Accelerate) only the main process writes logs, plots and checkpoint
metadata; metrics are reduced over all processes. With parallel.context=N each sequence is split over N processes
(flashtrain/parallel/context.py): the samples are dealt to the W / N data-parallel groups, each process keeps its share
of every sequence, and its forward and backward passes run with the context active (attention as ring attention).
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, ProjectConfiguration, broadcast_object_list, set_seed
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from flashtrain.data.lm import shard_lm_batch
from flashtrain.data.task import Task, check_model_fits, check_model_fits_before_preparing
from flashtrain.models.padding import Unpadding
from flashtrain.parallel.context import ContextParallel, build_context_parallel
from flashtrain.train import activation_checkpoint
from flashtrain.train.checkpoint import (MODEL_FILES, TrainState, accelerate_warnings_only, check_writable,
                                        checkpoint_format, config_differences, config_fingerprint,
                                        continue_advice, init_from_verified, prune_after_resume,
                                        resolve_init_from, resolve_resume, save_checkpoint, use_configured_lr)
from flashtrain.train.config import FlashtrainConfig
from flashtrain.train.hf_files import save_model_files
from flashtrain.train.metrics import MetricsLog
from flashtrain.train.mfu import Utilisation, peak_bf16_tflops
from flashtrain.train.model_init import load_initial_weights
from flashtrain.train.optim import build_optimizer, build_scheduler, clip_grad_norm_
from flashtrain.train.processes import (accumulation_steps, build_accelerator, launcher_precision, main_process_first,
                                        on_main_process, process_header)

COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard/<logger.project>/: the tensorboard tracker's event files
TRACKER_PACKAGES = {"wandb": "pip install wandb", "tensorboard": "pip install tensorboard (or tensorboardX)"}
CONTEXT_HOST_KEYS = ("cu_seqlens",)  # batch keys that stay on the host under context parallelism (ring attention's)


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path | None  # the last checkpoint written
    final_step: int
    history: list[dict] = field(default_factory=list)  # every logged record, as in metrics.jsonl
    sample: str = ""  # text generated at the end
    exit_code: int = 0  # launch.py's: 1 after too many non-finite steps, 128 + N after signal N (SIGINT: 130)


def resolve_precision(precision: str, cpu: bool) -> str:
    """trainer.precision=auto: full precision on the CPU; on a GPU the launcher's mixed precision when it set bf16 or
    fp16 (accelerate launch --mixed_precision, a config file's mixed_precision), else bf16 where the GPU has it, fp16
    elsewhere. Any other value is taken as it is."""
    if precision != "auto":
        return precision
    if cpu or not torch.cuda.is_available():
        return "no"
    return launcher_precision() or ("bf16" if torch.cuda.is_bf16_supported() else "fp16")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP (DTensor) parameter or gradient norm; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def to_device(batch, device: torch.device, host_keys: tuple[str, ...] = ()):
    """Move a batch (tensor, Unpadding, tuple/list or dict of them) to `device`; a dict's `host_keys` stay where they
    are (context parallelism: ring attention reads cu_seqlens on the host)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Unpadding):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: v if k in host_keys else to_device(v, device) for k, v in batch.items()}
    return type(batch)(to_device(v, device) for v in batch)


def context_batch(batch, context: ContextParallel | None):
    """This process's share of a host batch under context parallelism (its positions of every sequence:
    flashtrain.data.lm.shard_lm_batch); the batch itself without."""
    return batch if context is None else shard_lm_batch(batch, context.positions)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, task: Task, accelerator: Accelerator | None = None,
             context: ContextParallel | None = None) -> dict[str, float]:
    """The task's metrics over `loader`, under the accelerator's autocast, summed over every process's batches.
    Without an accelerator: on the model's device, in full precision, in this process only. context (parallel.context
    > 1): each batch's share of this process, scored with the context active (every process's share is summed)."""
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    host_keys = CONTEXT_HOST_KEYS if context is not None else ()
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    extra = _missing_batches(loader, accelerator, device)
    with accelerator.autocast() if accelerator is not None else nullcontext(), \
            context.active() if context is not None else nullcontext():
        batch = None
        for batch in loader:
            batch = to_device(context_batch(batch, context), device, host_keys)
            for key, value in task.eval_sums(model, batch).items():
                sums[key] = sums.get(key, 0) + value.detach().to(device, torch.float64)
        for _ in range(extra):  # (FSDP: the others' forwards need this process's all-gathers; scores discarded)
            task.eval_sums(model, batch)
    model.train(was_training)
    keys = sorted(sums)
    totals = torch.stack([sums[k] for k in keys])
    if accelerator is not None:
        totals = accelerator.reduce(totals, reduction="sum")
    return task.eval_metrics(dict(zip(keys, totals.tolist())))


def _missing_batches(loader, accelerator: Accelerator | None, device: torch.device) -> int:
    """Under FSDP every process must run as many forward passes as every other (each one's parameters are all-gathered
    from all processes), but a validation set need not split evenly: how many batches this process has fewer than
    the process with the most (it replays its last one that often, discarding the scores); 0 otherwise."""
    if accelerator is None or accelerator.distributed_type != DistributedType.FSDP or accelerator.num_processes < 2:
        return 0
    count = len(loader)
    most_fewest = torch.tensor([count, -count], device=device)
    torch.distributed.all_reduce(most_fewest, op=torch.distributed.ReduceOp.MAX)
    most, fewest = most_fewest[0].item(), -most_fewest[1].item()
    if fewest == 0 and most > 0:  # (every process stops here: each knows both counts)
        raise ValueError(f"validation under FSDP: a process has no validation batch while another has {most}; "
                         f"raise data.val_samples to at least one micro-batch per process (trainer.micro_batch_size "
                         f"x {accelerator.num_processes})")
    return most - count


def train(cfg: FlashtrainConfig, run_dir: Path, runs_of_name: Path | None = None) -> TrainResult:
    """Train `cfg` writing into `run_dir`; `runs_of_name` (default: run_dir's parent) is where resume=auto looks."""
    # trainer.deterministic switches a process-wide setting: put it back when the run ends
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    gc_enabled = gc.isenabled()  # so does trainer.gc_interval
    trainer = Trainer(cfg)
    try:
        trainer.setup(run_dir, runs_of_name)
        if cfg.trainer.gc_interval:
            gc.collect()
            gc.disable()
        while trainer.state.step < trainer.end_step:
            trainer.profile_before_step()
            trainer.train_step()
            trainer.profile_after_step()
            if trainer.after_step():
                break
        return trainer.finish()
    finally:
        trainer.restore_signal_handlers()
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        if gc_enabled:
            gc.enable()


def make_accelerator(cfg: FlashtrainConfig, run_dir: Path) -> Accelerator:
    """The Accelerator of a run: devices, mixed precision, and the trackers of logger.kind, each of which must be
    installed (Accelerate leaves out a tracker whose package is missing, with a debug message only)."""
    trackers, precision = list(cfg.logger.kind), resolve_precision(cfg.trainer.precision, cfg.trainer.cpu)
    accelerator = build_accelerator(cfg.trainer.cpu, precision, log_with=trackers or None,
                                    project_config=ProjectConfiguration(logging_dir=str(Path(run_dir) / TENSORBOARD_DIR)))
    missing = [tracker for tracker in trackers if tracker not in {str(t) for t in accelerator.log_with}]
    if missing:
        raise RuntimeError(f"logger.kind={trackers}: {', '.join(missing)} cannot log here, its package is not "
                           f"installed ({'; '.join(TRACKER_PACKAGES[tracker] for tracker in missing)})")
    return accelerator


def use_deterministic_algorithms() -> None:
    """trainer.deterministic: PyTorch's deterministic kernels (a warning names any op without one), cuBLAS with a fixed
    workspace (read when its first handle is made, after this), cuDNN without autotuning; the attention kernel reads
    torch.are_deterministic_algorithms_enabled() (models/attention.py) and runs its deterministic backward."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def _staged(*values: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Copies of GPU tensors (one device) in pinned host memory, queued behind the work so far, and one event after
    them: reading the copies once the event is done waits for this point of the stream, not for the work queued
    later. CPU tensors as they are (no event)."""
    if values[0].device.type != "cuda":
        return list(values), None
    copies = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True) for v in values]
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(values[0].device))
    return copies, event


class PendingStep(NamedTuple):
    """trainer.lagged_finite_check: a queued step whose finiteness is not read yet, and what taking it back restores."""
    flag: torch.Tensor  # 1.0 when the step was not finite (a host copy, or a CPU tensor)
    event: torch.cuda.Event | None  # the copy is done once this is
    step: int  # the step's number
    tokens: int  # its tokens
    scheduler_state: dict  # the LR schedule, the learning rates and the throughput interval before it
    lrs: list[float]
    interval_seconds: float
    tokens_at_log: int
    loss_sum: torch.Tensor  # for the message of a skipped step
    grad_norm: torch.Tensor


def _host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers as a tensor on `device` without a wait: torch.tensor(..., device=cuda) copies from pageable
    memory and synchronizes the stream; from pinned memory the copy is queued like a kernel."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Trainer:
    def __init__(self, cfg: FlashtrainConfig):
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.stopped_early = False  # by trainer.max_minutes: the run is not over
        self.out_of_time = False  # trainer.max_minutes of training time are spent
        self.nonfinite_in_a_row = 0  # optimizer steps skipped in a row for a non-finite loss or gradient norm
        self.received_signal: int | None = None  # SIGINT/SIGTERM: stop after this step, with a checkpoint
        self.previous_handlers: dict[int, object] = {}
        self.stop_message: str | None = None  # why the run stopped before its end, and how to continue
        self.exit_code = 0
        self.profile_window = cfg.trainer.profile_window()  # trainer.profile_steps as (first, last), or None
        self.profiler: torch.profiler.profile | None = None  # running over those steps
        self.pending_log: tuple | None = None  # a training record whose device values are not read yet
        self.latest_skipped = False  # the latest step's update was skipped (non-finite); nothing new to save
        self.lagged = False  # trainer.lagged_finite_check in effect (set with the optimizer)
        self.pending_step: PendingStep | None = None  # lagged: the queued step whose finiteness is not read yet
        self.signal_pending: tuple | None = None  # several processes: the summed signal flags of the last step

    # ---- setup ---------------------------------------------------------------------------------------------------

    def setup(self, run_dir: Path, runs_of_name: Path | None) -> None:
        cfg, tcfg = self.cfg, self.tcfg
        self.accelerator = accelerator = make_accelerator(cfg, run_dir)
        self.main = accelerator.is_main_process
        # first line: how many processes run, and how; fewer than the launch asked for stops here
        header, problem = process_header(accelerator, cfg.parallel.context)
        self._print(header if problem is None else f"{header}: {problem}")
        if problem is not None:
            raise RuntimeError(f"{header}: {problem}")
        self._plan_batches()
        # every process writes into the main process's run directory
        self.run_dir = Path(broadcast_object_list([str(run_dir)])[0])
        runs_of_name = Path(runs_of_name) if runs_of_name is not None else self.run_dir.parent
        set_seed(cfg.seed)
        if tcfg.deterministic:
            use_deterministic_algorithms()
        # Everything that can stop the start does so before any data is prepared: attn_impl=flash that cannot run,
        # the checkpoint to resume (verified) and its configuration, a run directory that cannot be written, a
        # model that cannot take what the data will provide (the vocabulary before a tokenizer is trained)
        self.attention = cfg.model.attention_backend(accelerator.device, COMPUTE_DTYPES[accelerator.mixed_precision])
        if self.context is not None:  # every attention call of the model is one ring attention runs
            self.context.check_model(cfg.model)
            self.attention += f", as ring attention over {self.context.size} processes"
        # the main process alone verifies checkpoints (hashing every file) and says which it skips
        self.checkpoint = on_main_process(lambda: resolve_resume(cfg.resume, runs_of_name), accelerator)
        if self.checkpoint is not None and (cfg.resume == "auto" or self._resumes_its_own_run()):
            self.run_dir = self.checkpoint.parent.parent  # the same run continues: its logs, checkpoints, wandb run
        # init_from's checkpoint, verified the same way; the loaders read that one without hashing it again
        self.init_checkpoint = on_main_process(lambda: resolve_init_from(cfg.init_from), accelerator) \
            if cfg.init_from is not None and self.checkpoint is None else None
        self.config_fingerprint = config_fingerprint(cfg)
        if self.checkpoint is not None:
            self._check_resumed_config()
        check_writable(self.run_dir, self.run_dir / "checkpoints")
        check_model_fits_before_preparing(cfg.model, cfg.data)
        # data missing from the cache is prepared by the main process while the others wait (then find it there)
        self.task = main_process_first(cfg.data.build, accelerator, tcfg.prepare_timeout_minutes)
        check_model_fits(cfg.model, cfg.data, self.task.spec)
        self._build_model()
        self.state = TrainState()
        # the scheduler is stepped here once per optimizer step (not through accelerate's per-process stepping)
        accelerator.register_for_checkpointing(self.scheduler, self.state)
        if self.checkpoint is not None:
            self._load_resumed_state()
        elif cfg.resume is not None:
            self._print(f"resume={cfg.resume}: no checkpoint found under {runs_of_name}, starting fresh")
        self.state.processes, self.state.global_batch_size = accelerator.num_processes, self.global_batch_size
        self._open_loaders_and_logs()
        self.last_checkpoint = self.checkpoint
        self.end_step = tcfg.stop_step if tcfg.stop_step is not None else tcfg.max_steps
        if self.state.step == 0 and self.checkpoint is None:
            self.evaluate()  # the starting point of the validation curve
        self.model.train()
        self.start_time = time.perf_counter()
        self.interval_seconds, self.tokens_at_log = 0.0, self.state.tokens_seen  # training time only
        self.pbar = tqdm(total=self.end_step, initial=self.state.step, disable=not self.main, desc=cfg.name,
                         unit="step", dynamic_ncols=True)
        self._install_signal_handlers()

    def _plan_batches(self) -> None:
        """The data-parallel ranks and the batch plan. With parallel.context > 1 the (data parallel x context) mesh,
        its shape checked against the processes and the sequence length first: the samples are dealt to the
        data-parallel groups (dp_rank of dp_size), whose processes share each sequence."""
        cfg, tcfg, accelerator = self.cfg, self.tcfg, self.accelerator
        self.context = build_context_parallel(cfg.parallel.context, accelerator.num_processes, accelerator.device,
                                              COMPUTE_DTYPES[accelerator.mixed_precision], cfg.data)
        self.dp_rank, self.dp_size = ((self.context.dp_rank, self.context.dp_size) if self.context is not None else
                                      (accelerator.process_index, accelerator.num_processes))
        self.host_keys = CONTEXT_HOST_KEYS if self.context is not None else ()
        self.grad_accum_steps = accumulation_steps(tcfg.global_batch_size, tcfg.micro_batch_size, self.dp_size,
                                                   "data-parallel group(s)" if self.context is not None else
                                                   "process(es)")
        self.global_batch_size = tcfg.micro_batch_size * self.dp_size * self.grad_accum_steps

    # ---- signals -------------------------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM (Ctrl-C, a cluster's preemption notice): finish the step, save, stop; a second one: exit."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received_signal is not None:
            print(f"\n{name} again: exiting now, without a checkpoint (the last one: {self.last_checkpoint})",
                  file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received_signal = signum
        when = (f"step {self.state.step + 1}" if self.accelerator.num_processes == 1 else
                "this step and the next (the processes agree on a signal one step later)")
        print(f"\n{name} received: finishing {when}, then saving a checkpoint "
              f"(another {name} exits at once, without one)", file=sys.stderr, flush=True)

    def restore_signal_handlers(self) -> None:
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)
        self.previous_handlers = {}

    def _signalled(self) -> bool:
        """True on every process once any process got SIGINT/SIGTERM (called once per step). Under several processes
        the flags are summed on the device and the sum read one step later, from a copy made behind its step: no
        host wait per step, and every rank stops after the same step (the one after the signal's)."""
        got = self.received_signal is not None
        if self.accelerator.num_processes == 1:
            return got
        previous = self.signal_pending
        summed = self.accelerator.reduce(_host_to_device(float(got), torch.float32, self.accelerator.device),
                                         reduction="sum")
        self.signal_pending = _staged(summed)
        if previous is None:
            return False
        (value,), event = previous
        if event is not None:
            event.synchronize()
        return value.item() > 0

    def _resumes_its_own_run(self) -> bool:
        """resume=RUN (or one of its checkpoints) with hydra.run.dir=RUN: the run continues in place."""
        return self.checkpoint.parent.parent.resolve() == self.run_dir.resolve()

    def _load_resumed_state(self) -> None:
        """Model, optimizer, scheduler, RNG and TrainState from self.checkpoint; the schedule at optim.lr's peak."""
        self._check_checkpoint_engine()
        with accelerate_warnings_only():
            self.accelerator.load_state(str(self.checkpoint))
        lr_note = use_configured_lr(self.scheduler, self.cfg.optim.lr)
        self._print(f"resumed from {self.checkpoint} at step {self.state.step}{lr_note}")
        self._prune_left_behind()
        self._continue_data_position()

    def _check_resumed_config(self) -> None:
        """A checkpoint of another model/data configuration stops the start, unless resume_allow_config_change."""
        differences = config_differences(self.checkpoint, self.config_fingerprint)
        if not differences:
            return
        listed = "\n  ".join(differences)
        if not self.cfg.resume_allow_config_change:
            raise ValueError(f"resume: {self.checkpoint} was trained with another model/data configuration:\n  "
                             f"{listed}\nresume with the same configuration, or add resume_allow_config_change=true "
                             f"to continue it with the new one")
        self._print(f"resume_allow_config_change=true: continuing {self.checkpoint} with\n  {listed}")

    def _check_checkpoint_engine(self) -> None:
        """A checkpoint resumes under the engine that wrote it (any number of processes): a ValueError saying how."""
        accelerator = self.accelerator
        saved = checkpoint_format(self.checkpoint)
        if accelerator.distributed_type == DistributedType.FSDP:
            sharded = accelerator.state.fsdp_plugin.state_dict_type.name == "SHARDED_STATE_DICT"
            now = MODEL_FILES["pytorch_model_fsdp_0" if sharded else "pytorch_model_fsdp.bin"]
        else:
            now = MODEL_FILES["model.safetensors"]
        if saved == now:
            return
        how = ("accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes M launch.py ..., with any M"
               + ("" if "sharded" in saved else " and --fsdp_state_dict_type FULL_STATE_DICT")
               if saved.startswith("FSDP") else "one process, or DDP (python launch.py, accelerate launch without FSDP)")
        raise ValueError(f"resume: {self.checkpoint} was saved by {saved}, this run is {now}; resume it the same way: "
                         f"{how}. (Its weights alone load anywhere: init_from={self.checkpoint})")

    def _continue_data_position(self) -> None:
        """After load_state: say how the data continues when the checkpoint was saved by another number of processes,
        with another global batch, or before checkpoints counted samples."""
        state, world = self.state, self.accelerator.num_processes
        if state.legacy_batches_consumed is not None:  # each of `world` processes had taken that many micro-batches
            state.samples_consumed = state.legacy_batches_consumed * self.tcfg.micro_batch_size * world
            self._print(f"checkpoint from before samples were counted: the data continues after "
                        f"{state.samples_consumed} samples, as if saved by {world} process(es) with micro-batches of "
                        f"{self.tcfg.micro_batch_size}")
            return
        if state.processes != world:
            self._print(f"checkpoint of {state.processes} process(es) continues on {world}: the data after sample "
                        f"{state.samples_consumed}, as the uninterrupted run reads it" + (
                            f"; processes {state.processes}-{world - 1} have no random state (dropout) in it and "
                            f"start theirs from the seed" if world > state.processes else ""))
        if state.global_batch_size != self.global_batch_size:
            self._print(f"the global batch changed from {state.global_batch_size} to {self.global_batch_size} "
                        f"sequences: the data continues after sample {state.samples_consumed}, in steps of the new "
                        f"size (an exact continuation of the data order needs the same global batch)")

    def _build_model(self) -> None:
        cfg, tcfg = self.cfg, self.tcfg
        model = cfg.model.build()
        if cfg.init_from is not None and self.checkpoint is None:
            with init_from_verified(cfg.init_from, self.init_checkpoint):  # verified at the start: read as it is
                self._print(load_initial_weights(model, cfg.model, cfg.init_from, cfg.init_position_extension))
        self.checkpointed_blocks = activation_checkpoint.apply(model, tcfg.activation_checkpointing)
        self.base_model = model = model.to(self.accelerator.device)  # neither compiled nor wrapped
        self.n_params = sum(p.numel() for p in model.parameters())  # each tensor once: tied weights count once
        flops = getattr(model, "flops_per_token", None)  # at the data's longest sequence
        self.utilisation = Utilisation(flops(self.task.spec.max_length) if flops is not None else None,
                                       peak_bf16_tflops(self.accelerator.device), self.accelerator.num_processes)
        optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = build_scheduler(optimizer, cfg.optim, self.tcfg.max_steps)
        if self.tcfg.compile:
            model = torch.compile(model, mode=self.tcfg.compile_mode)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # the lagged finiteness check needs an update the device itself can skip: fused AdamW's found_inf (fp16's
        # loss scaler decides its own skips)
        # (one process for now: under several the step's token count is a sum on the device that the books read at
        # once; deferring it to the step's answer is the next change. Not with FSDP's DTensor parameters, even in
        # one process: found_inf through ShardLocalAdamW's shard-local step has not been run (two gloo processes hung
        # in a flagged step there, docs/training.md).)
        self.lagged = bool(tcfg.lagged_finite_check and self.accelerator.scaler is None and
                           self.accelerator.num_processes == 1 and
                           self.accelerator.distributed_type != DistributedType.FSDP and
                           isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("fused"))
        self.raw_optimizer = optimizer

    def _open_loaders_and_logs(self) -> None:
        cfg, tcfg, accelerator = self.cfg, self.tcfg, self.accelerator
        # data-parallel rank and size: the processes themselves, or with parallel.context the groups that share each
        # sequence (each of whose processes reads the same samples and keeps its share: train_step, evaluate)
        rank, world = self.dp_rank, self.dp_size
        # this process's micro-batches already taken: the samples consumed, in micro-steps of all processes
        start_batch = self.state.samples_consumed // (tcfg.micro_batch_size * world)
        self.train_iter = iter(self.task.train_loader(tcfg.micro_batch_size, rank, world, start_batch=start_batch,
                                                      accum_steps=self.grad_accum_steps))
        # the same validation samples for any micro-batch size and number of processes (the data's val_samples)
        self.val_loader = self.task.eval_loader("val", tcfg.micro_batch_size, rank, world, self.task.val_samples)
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_model_files(self.base_model, self.task, self.run_dir)  # RUN_DIR/hf/: the tokenizer, the HF config
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.main,
                              resumed_step=self.state.step if self.checkpoint is not None else None)
        if cfg.logger.kind:
            # the run directory is final now (resume=auto continues the resumed run's)
            accelerator.project_configuration.logging_dir = str(self.run_dir / TENSORBOARD_DIR)
            init_kwargs = {"wandb": {"mode": cfg.logger.mode, "dir": str(self.run_dir), "id": self._wandb_run_id(),
                                     "name": f"{cfg.name}/{self.run_dir.name}", "resume": "allow"}} \
                if "wandb" in cfg.logger.kind else {}
            accelerator.init_trackers(cfg.logger.project, config=_flat_config(cfg), init_kwargs=init_kwargs)
        self._print(f"model: {type(cfg.model).__name__} {self.n_params / 1e6:.2f}M parameters, attention: "
                    f"{self.attention}; device: {accelerator.device}, precision: {accelerator.mixed_precision}, "
                    f"processes: {accelerator.num_processes}; run dir: {self.run_dir}")
        readers, split = f"{world} process(es)", ""
        if self.context is not None:
            readers = f"{world} data-parallel group(s)"
            split = (f"; each sequence split over the {self.context.size} processes of its group "
                     f"({self.context.local_len} of its {self.context.seq_len} tokens each)")
        self._print(f"batch: {self.global_batch_size} sequences per optimizer step = micro-batch "
                    f"{tcfg.micro_batch_size} x {readers} x {self.grad_accum_steps} accumulation step(s){split}"
                    + (f"; activation checkpointing: {tcfg.activation_checkpointing}, {self.checkpointed_blocks} "
                       f"blocks" if self.checkpointed_blocks else ""))
        self._print(self.utilisation.describe())
        if tcfg.lagged_finite_check:
            self._print("finiteness check: read one step later (trainer.lagged_finite_check)" if self.lagged else
                        "finiteness check: step by step (trainer.lagged_finite_check needs one process without FSDP, "
                        "a fused AdamW and no fp16 loss scaler)")

    def _wandb_run_id(self) -> str | None:
        """The wandb run of this run directory: made once and stored there, so a resumed run logs into the same one.
        The main process alone logs to wandb: None on the others."""
        if not self.main:
            return None
        id_file = self.run_dir / "wandb_run_id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4) + "\n")
        return id_file.read_text().strip()

    # ---- the loop ------------------------------------------------------------------------------------------------

    def train_step(self) -> None:
        """One optimizer step over this process's grad_accum_steps micro-batches; logs the training loss on
        log_interval.

        The step's loss is the mean over every loss term (predicted token, sample) of the global batch: each
        micro-batch's mean loss weighted by its share of the terms, counted on the host batches and summed over the
        processes before the backward passes (one small all-reduce). DDP and FSDP average gradients over processes, so
        each process back-propagates its shares times the number of processes."""
        tcfg, accelerator, state = self.tcfg, self.accelerator, self.state
        if (self.pending_step is not None and self.nonfinite_in_a_row + 1 >= tcfg.max_nonfinite_steps and
                not self._resolve_pending_step()):
            return  # lagged: the limit of skips in a row is reached before this step reads a batch (as step by step)
        step_start = time.perf_counter()
        # CPU tensors: no device sync. parallel.context: this process's share of each sequence, counted as such
        host_batches = [context_batch(next(self.train_iter), self.context) for _ in range(self.grad_accum_steps)]
        counts = [self.task.loss_count(batch) for batch in host_batches]
        total_count, total_tokens = self._sum_over_processes(sum(counts),
                                                             sum(self.task.tokens(batch) for batch in host_batches))
        loss_sum = torch.zeros((), device=accelerator.device)
        for micro, host_batch in enumerate(host_batches):
            batch = to_device(host_batch, accelerator.device, self.host_keys)
            # gradients are reduced over processes only on the last micro-batch of the step
            sync = accelerator.no_sync(self.model) if micro < self.grad_accum_steps - 1 else nullcontext()
            # parallel.context: attention is ring attention in the forward pass and in the backward's recomputation
            with sync, self.context.active() if self.context is not None else nullcontext():
                # autocast here, not only in the forward Accelerate wraps: its FSDP2 preparation wraps none
                with accelerator.autocast():
                    share = self.task.loss(self.model, batch).float() * (counts[micro] / total_count)
                accelerator.backward(share * accelerator.num_processes)
            loss_sum += share.detach()
        state.samples_consumed += self.global_batch_size
        # grad_clip 0: measured (an infinite bound multiplies the gradients by exactly 1), not clipped
        grad_norm = clip_grad_norm_(accelerator, self.model.parameters(), self.cfg.optim.grad_clip or float("inf"))
        if self.lagged:
            self._lagged_update(loss_sum, grad_norm, total_tokens, step_start)
            return
        finite = self._finite_step(loss_sum, grad_norm)  # waits for the backward pass: the last log's values are in
        self.flush_log()
        if not finite:
            if accelerator.scaler is not None:  # fp16: the skipped step's unscale is recorded; lower the scale, reset
                accelerator.scaler.update()     # its stage (else the next step's unscale raises)
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.nonfinite_in_a_row = 0
        self._update(loss_sum, total_tokens, step_start)

    def _update(self, loss_sum: torch.Tensor, total_tokens, step_start: float) -> None:
        """The optimizer and LR-schedule step, the step's count, progress and (on log_interval) its record."""
        tcfg, state = self.tcfg, self.state
        self.latest_skipped = False
        self.step_lr = self.scheduler.get_last_lr()[0]  # the learning rate of this step (logged with its loss)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += int(total_tokens)
        self.interval_seconds += time.perf_counter() - step_start
        self.pbar.update(1)
        self.out_of_time = tcfg.max_minutes is not None and \
            (time.perf_counter() - self.start_time) / 60 >= tcfg.max_minutes
        if state.step % tcfg.log_interval == 0 or self._last_step():
            self._log_training(loss_sum)

    def _lagged_update(self, loss_sum: torch.Tensor, grad_norm, total_tokens, step_start: float) -> None:
        """trainer.lagged_finite_check: read the previous step's finiteness (copied to the host when it was queued:
        no wait for this step's backward pass), correct the books if it was skipped, then queue this step's update
        with its own finiteness as the optimizer's found_inf (a non-finite step changes no weight, moment or step
        count on the device) and copy that flag to the host for the next step."""
        # 1.0 / 0.0: the fused kernels skip on found_inf == 1 and take it off the step count
        nonfinite = (self._nonfinite_count(loss_sum, grad_norm) > 0).float()
        if self.pending_step is not None:
            self._resolve_pending_step()  # (a skip that reaches the limit is read before the step: train_step)
        self.flush_log()
        # what taking this step back restores: the schedule, the learning rates, the throughput interval
        before = (self.scheduler.state_dict(), [group["lr"] for group in self.raw_optimizer.param_groups],
                  self.interval_seconds, self.tokens_at_log)
        self.raw_optimizer.found_inf = nonfinite
        try:
            self._update(loss_sum, total_tokens, step_start)
        finally:
            del self.raw_optimizer.found_inf
        (flag,), event = _staged(nonfinite)
        self.pending_step = PendingStep(flag, event, self.state.step, int(total_tokens), *before, loss_sum, grad_norm)

    def _resolve_pending_step(self) -> bool:
        """Read the queued step's finiteness (lagged); True when finite. When not: its update was skipped on the
        device, so its count, tokens, LR-schedule step and record are taken back, and it is counted as skipped,
        exactly as the step-by-step check does."""
        pending, self.pending_step = self.pending_step, None
        if pending.event is not None:
            pending.event.synchronize()
        if pending.flag.item() == 0:
            self.nonfinite_in_a_row = 0
            return True
        state = self.state
        state.step, state.tokens_seen = pending.step - 1, state.tokens_seen - pending.tokens
        self.scheduler.load_state_dict(pending.scheduler_state)
        for group, lr in zip(self.raw_optimizer.param_groups, pending.lrs):
            group["lr"] = lr
        # the skip's time and tokens leave the throughput interval
        self.interval_seconds, self.tokens_at_log = pending.interval_seconds, pending.tokens_at_log
        if self.pending_log is not None and self.pending_log[0] == pending.step:
            self.pending_log = None  # the skipped step's record
        self.pbar.update(-1)
        self.latest_skipped = True
        self._count_skipped(pending.loss_sum, pending.grad_norm)
        return False

    def _count_skipped(self, loss_sum: torch.Tensor, grad_norm) -> None:
        self.nonfinite_in_a_row += 1
        self.state.skipped_nonfinite += 1
        self._print(f"step {self.state.step + 1}: non-finite loss ({loss_sum.item():.4g}) "
                    f"or gradient norm ({float(local_tensor(grad_norm)):.4g}): step skipped, {self.nonfinite_in_a_row} in a row "
                    f"(trainer.max_nonfinite_steps={self.tcfg.max_nonfinite_steps}), "
                    f"{self.state.skipped_nonfinite} in this run", progress=True)

    def profile_before_step(self) -> None:
        """Start torch.profiler before the first step of trainer.profile_steps (CPU ops, and CUDA kernels on a GPU)."""
        if self.profile_window is None or self.profiler is not None or self.state.step + 1 != self.profile_window[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.accelerator.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def profile_after_step(self) -> None:
        """After the last step of trainer.profile_steps (or the run's last): stop the profiler, write this process's
        trace to <run dir>/profile/steps_A-B_rank<R>.json, and print the ops that took the most time (main process)."""
        if self.profiler is None or (self.state.step < self.profile_window[1] and not self._last_step()):
            return
        cuda = self.accelerator.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.accelerator.device)
        self.profiler.stop()
        first = self.profile_window[0]
        path = self.run_dir / "profile" / f"steps_{first}-{self.state.step}_rank{self.accelerator.process_index}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(path))
        if self.main:
            table = self.profiler.key_averages().table(
                sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15)
            self._print(f"profile of steps {first}-{self.state.step} (trace per process: {path.parent}):\n{table}",
                        progress=True)
        self.profiler = None

    def _sum_over_processes(self, *values: int) -> tuple:
        """Each value summed over every process: the host ints themselves in a single process, else float32 device
        tensors (summed in float64), which weight the losses without waiting for the device."""
        if self.accelerator.num_processes == 1:
            return values
        local = _host_to_device(values, torch.float64, self.accelerator.device)
        return tuple(self.accelerator.reduce(local, reduction="sum").float())

    def _nonfinite_count(self, loss_sum: torch.Tensor, grad_norm) -> torch.Tensor:
        """On the device, the number of processes whose loss or gradient norm is not finite (with fp16's loss scaler
        the loss only: the scaler skips steps whose gradients overflow, and lowers its scale)."""
        checks = [loss_sum.float().reshape(1)]
        if self.accelerator.scaler is None:  # every process holds the total norm (FSDP: a plain tensor or a
                                             # replicated DTensor)
            checks.append(torch.as_tensor(local_tensor(grad_norm), device=loss_sum.device).float().reshape(1))
        nonfinite = (~torch.isfinite(torch.cat(checks))).sum().float()
        return self.accelerator.reduce(nonfinite, reduction="sum").reshape(())

    def _finite_step(self, loss_sum: torch.Tensor, grad_norm) -> bool:
        """False, counting the step as skipped, when the loss or the gradient norm is not finite on any process.
        Reading the answer waits for the backward pass: one synchronisation per step."""
        if self._nonfinite_count(loss_sum, grad_norm).item() == 0:
            return True
        self.latest_skipped = True
        self._count_skipped(loss_sum, grad_norm)
        return False

    def _log_training(self, loss_sum: torch.Tensor) -> None:
        """Log the step's loss (the processes' shares summed: the mean over the global batch), the learning rate,
        tokens/s of all processes and per process, MFU (flashtrain.train.mfu; on a GPU, for a model that counts its
        FLOPs) and, on a GPU, this process's peak memory (with several processes also every process's, in rank
        order). The device values are reduced here but read by `flush_log` at the next point that waits for the
        device anyway (the next step's finiteness check, a validation pass, a checkpoint, the end): logging adds no
        host sync, and the record is written one step later."""
        tok_s = (self.state.tokens_seen - self.tokens_at_log) / max(self.interval_seconds, 1e-9)
        self.interval_seconds, self.tokens_at_log = 0.0, self.state.tokens_seen
        host, device = {"lr": self.step_lr, "tokens_per_s": tok_s,
                        "tokens_per_s_per_process": tok_s / self.accelerator.num_processes}, {}
        device["train_loss"] = self.accelerator.reduce(loss_sum, reduction="sum")
        if self.accelerator.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.accelerator.device) / 2**30
            host["peak_memory_gib"] = peak
            if self.accelerator.num_processes > 1:  # every GPU's, in rank order (one small all-gather per log)
                device["peak_memory_gib_per_process"] = self.accelerator.gather(
                    _host_to_device([peak], torch.float32, self.accelerator.device))
        if (mfu := self.utilisation.mfu(tok_s)) is not None:
            host["mfu"] = mfu
        event = None
        if self.lagged:  # copied to the host behind this step's work: flush_log waits for this step, not the next
            copies, event = _staged(*device.values())
            device = dict(zip(device, copies))
        self.pending_log = (self.state.step, self.state.tokens_seen, host, device, event)

    def flush_log(self) -> None:
        """Write the pending training record (`_log_training`), reading its device values."""
        if self.pending_log is None:
            return
        step, tokens, host, device, event = self.pending_log
        self.pending_log = None
        if event is not None:
            event.synchronize()
        train_loss = device["train_loss"].item()
        if "peak_memory_gib_per_process" in device:
            host["peak_memory_gib_per_process"] = [round(v, 4) for v in device["peak_memory_gib_per_process"].tolist()]
        self._record(step=step, tokens=tokens, train_loss=train_loss, **host)
        self.pbar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{host['lr']:.2e}", tok_s=f"{host['tokens_per_s']:,.0f}",
                              **({"mfu": f"{100 * host['mfu']:.1f}%"} if "mfu" in host else {}))

    def _last_step(self) -> bool:
        return self.state.step == self.end_step or self.out_of_time

    def after_step(self) -> bool:
        """Evaluate and save on their intervals; True when the run stops before end_step (stop_metric reached, out
        of time, a signal, trainer.max_nonfinite_steps skipped in a row), always with a checkpoint."""
        tcfg, step = self.tcfg, self.state.step
        signalled = self._signalled()
        if self.pending_step is not None and (  # lagged: whatever waits for the device reads the step's answer first
                signalled or step % tcfg.eval_interval == 0 or step % tcfg.save_interval == 0 or self._last_step()):
            self._resolve_pending_step()
            step = self.state.step
        if signalled:
            name = signal.Signals(self.received_signal or signal.SIGTERM).name
            return self._stop(f"stopped by {name} after step {step}", 128 + (self.received_signal or signal.SIGTERM))
        if self.latest_skipped:  # no step was taken: nothing new to evaluate or save
            return self.nonfinite_in_a_row >= tcfg.max_nonfinite_steps and self._stop(
                f"stopped: {self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(trainer.max_nonfinite_steps={tcfg.max_nonfinite_steps}); the weights are those after step {step}, "
                f"the last finite one", exit_code=1, nonfinite=True)
        out_of_time, last = self.out_of_time, self._last_step()
        target_reached = False
        if tcfg.gc_interval:  # automatic collection is off (train): young objects every gc_interval steps, all at
            if step % tcfg.eval_interval == 0 or step % tcfg.save_interval == 0 or last:  # a pause that waits anyway
                gc.collect()
            elif step % tcfg.gc_interval == 0:
                gc.collect(1)
        if step % tcfg.eval_interval == 0 or last:
            metrics = self.evaluate()
            target_reached = tcfg.stop_metric is not None and metrics[tcfg.stop_metric] >= tcfg.stop_value
        if step % tcfg.save_interval == 0 or last or target_reached:
            self._save()
        if step == self.end_step:
            return False
        if target_reached:
            self._print(f"trainer.stop_metric {tcfg.stop_metric} reached {tcfg.stop_value} at step {step}")
        self.stopped_early = out_of_time and not target_reached
        if self.stopped_early:
            self._stop_message(f"stopped after trainer.max_minutes={tcfg.max_minutes} at step {step}")
        return target_reached or out_of_time

    def _stop(self, reason: str, exit_code: int, nonfinite: bool = False) -> bool:
        """Stop before end_step: save, and say how to continue (`nonfinite`: after non-finite steps); True."""
        self._save()
        self.stopped_early, self.exit_code = True, exit_code
        self._stop_message(reason, nonfinite)
        return True

    def _stop_message(self, reason: str, nonfinite: bool = False) -> None:
        """The stop message after the checkpoint just saved: `reason`, the checkpoint, how to continue."""
        advice = continue_advice(self.last_checkpoint, self.accelerator.num_processes,  # printed by the main process
                                 nonfinite_lr=self.cfg.optim.lr if nonfinite else None) if self.main else ""
        self.stop_message = f"{reason}; checkpoint: {self.last_checkpoint}. {advice}"

    def _prune_left_behind(self) -> None:
        """The run continues in its own directory: the checkpoints a killed launch left beyond keep_checkpoints go."""
        if self.main and self._resumes_its_own_run():
            keep = self.tcfg.keep_checkpoints
            for path in prune_after_resume(self.checkpoint, keep):
                self._print(f"removed {path} (trainer.keep_checkpoints={keep}; left by a stopped launch)")

    def _save(self) -> None:
        """Checkpoint the current step; never from non-finite weights (each process checks its own, FSDP's shards)."""
        self.flush_log()  # the records up to this step are on disk before its checkpoint
        finite = torch.stack([torch.isfinite(local_tensor(p.detach())).all() for p in self.model.parameters()]).all()
        if self.accelerator.reduce(finite.float(), reduction="sum").item() < self.accelerator.num_processes:
            raise FloatingPointError(f"step {self.state.step}: the weights are not finite; no checkpoint written "
                                     f"(the last one: {self.last_checkpoint})")
        self.last_checkpoint = save_checkpoint(self.accelerator, self.run_dir, self.state.step,
                                               self.tcfg.keep_checkpoints, self.config_fingerprint)

    def evaluate(self, split: str = "val") -> dict[str, float]:
        """Score `split` ("val": the data's first val_samples samples; other splits whole) and log it, its metrics
        named "<split>_*"; tracks the best validation loss."""
        self.flush_log()  # the step's training record first
        tcfg, accelerator = self.tcfg, self.accelerator
        loader = self.val_loader if split == "val" else self.task.eval_loader(
            split, tcfg.micro_batch_size, self.dp_rank, self.dp_size)
        metrics = {split + "_" + key.removeprefix("val_"): value
                   for key, value in evaluate(self.model, loader, self.task, accelerator, self.context).items()}
        if split == "val":
            self.state.best_val_loss = min(self.state.best_val_loss, metrics["val_loss"])
            if tcfg.stop_metric is not None and tcfg.stop_metric not in metrics:
                raise ValueError(f"trainer.stop_metric={tcfg.stop_metric!r} is not a validation metric of this "
                                 f"task: {sorted(metrics)}")
        self._record(**metrics)
        self._print(f"step {self.state.step:>6}  " + "  ".join(f"{k.replace('_', ' ')} {v:.4g}"
                                                              for k, v in metrics.items()), progress=True)
        return metrics

    # ---- the end -------------------------------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """Score the task's other splits (once, at the end of a finished run), sample, plot, say where things are."""
        cfg, accelerator = self.cfg, self.accelerator
        if self.pending_step is not None:
            self._resolve_pending_step()
        self.flush_log()
        self.pbar.close()
        if not self.stopped_early:
            for split in self.task.eval_splits[1:]:
                self.evaluate(split)
        # FSDP: every process takes part in the sampling model's forward passes (its weights are sharded)
        samples_here = self.main or accelerator.distributed_type == DistributedType.FSDP
        sample, sample_note = "", ""
        if samples_here and not self.exit_code:
            sampler = accelerator.unwrap_model(self.model)
            try:
                with accelerator.autocast():
                    sample = self.task.sample(sampler, accelerator.device, cfg.seed)
            except AttributeError as err:  # the task samples with generate(), a method a model need not define
                if err.name != "generate" or hasattr(sampler, "generate"):
                    raise
                sample_note = f"sample skipped: {type(self.base_model).__name__} defines no generate()"
            sample = sample if self.main else ""
        if self.main:
            self.log.plot(self.run_dir / "curves.png", title=f"{cfg.name} ({self.run_dir.name})")
        if self.stop_message:
            self._print(self.stop_message)
        if sample:
            self._print("---- sample ----\n" + sample + "\n----------------")
        if sample_note:
            self._print(sample_note)
        self._print(f"checkpoint: {self.last_checkpoint}")
        trackers = {"wandb": f"wandb: {self.run_dir / 'wandb'}" + (" (offline; `wandb sync` uploads)"
                                                                   if cfg.logger.mode == "offline" else ""),
                    "tensorboard": f"tensorboard: {self.run_dir / TENSORBOARD_DIR}"}
        self._print(", ".join([f"logs: {self.run_dir / 'metrics.jsonl'}", f"curves: {self.run_dir / 'curves.png'}",
                               *(trackers[tracker] for tracker in cfg.logger.kind)]))
        accelerator.end_training()
        return TrainResult(run_dir=self.run_dir, checkpoint=self.last_checkpoint, final_step=self.state.step,
                           history=self.log.records, sample=sample, exit_code=self.exit_code)

    def _record(self, step: int | None = None, tokens: int | None = None, **values) -> None:
        """One metrics record (metrics.jsonl and the trackers) at `step` / `tokens` (default: now)."""
        step = self.state.step if step is None else step
        values = {"step": step, "tokens": self.state.tokens_seen if tokens is None else tokens, **values}
        self.log.write(values)
        self.accelerator.log({k: v for k, v in values.items() if k != "step"}, step=step)

    def _print(self, text: str, progress: bool = False) -> None:
        """Print on the main process; progress=True: above the progress bar."""
        if self.main:
            tqdm.write(text) if progress else print(text)


def _flat_config(cfg: FlashtrainConfig) -> dict:
    """{"model.n_layer": 4, "logger.kind": "['wandb', 'tensorboard']", ...}: nested configs flattened, values that are
    not None, bool, int, float or str as text (what every tracker takes as a hyperparameter)."""
    def flatten(prefix: str, value) -> dict:
        if isinstance(value, dict):
            return {key: item for k, v in value.items() for key, item in flatten(f"{prefix}{k}.", v).items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {prefix[:-1]: value}
        return {prefix[:-1]: str(value)}

    return flatten("", asdict(cfg))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
