"""The training loop: Accelerate for devices, mixed precision and processes; atomic checkpoints; eval and logging.

One optimizer step = `grad_accum_steps` micro-batches of `micro_batch_size` sequences on every process.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from flashtrain.models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification
from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models.lra import LRAClassifier, LRAConfig
from flashtrain.train.checkpoint import TrainState, resolve_resume, save_checkpoint
from flashtrain.train.config import FlashtrainConfig
from flashtrain.train.metrics import MetricsLog
from flashtrain.train.model_init import load_initial_weights
from flashtrain.train.optim import build_optimizer, build_scheduler
from flashtrain.train.task import Task, build_task


@dataclass
class TrainResult:
    run_dir: Path
    checkpoint: Path | None  # the last checkpoint written
    final_step: int
    history: list[dict] = field(default_factory=list)  # every logged record, as in metrics.jsonl
    sample: str = ""  # text generated at the end


def build_model(model_cfg) -> torch.nn.Module:
    """The config's type decides the model."""
    if isinstance(model_cfg, GPT2Config):
        return GPT2(model_cfg)
    if isinstance(model_cfg, LRAConfig):
        return LRAClassifier(model_cfg)
    if isinstance(model_cfg, BertConfig):  # model.head picks the head
        return BertForMaskedLM(model_cfg) if model_cfg.head == "masked_lm" else BertForSequenceClassification(model_cfg)
    raise TypeError(f"model: no model is registered for config type {type(model_cfg).__name__}")


def resolve_precision(precision: str, cpu: bool) -> str:
    if precision != "auto":
        return precision
    if cpu or not torch.cuda.is_available():
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def to_device(batch, device: torch.device):
    """Move a batch (tensor, tuple/list or dict of tensors) to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return type(batch)(to_device(v, device) for v in batch)


@torch.no_grad()
def evaluate(model, loader, task: Task, accelerator: Accelerator) -> dict[str, float]:
    """The task's metrics over every process's validation batches."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        for key, value in task.eval_sums(model, to_device(batch, accelerator.device)).items():
            sums[key] = sums.get(key, 0) + value.detach().to(accelerator.device, torch.float64)
    model.train()
    keys = sorted(sums)
    totals = accelerator.reduce(torch.stack([sums[k] for k in keys]), reduction="sum").tolist()
    return task.eval_metrics(dict(zip(keys, totals)))


def train(cfg: FlashtrainConfig, run_dir: Path, runs_of_name: Path | None = None) -> TrainResult:
    """Train `cfg` writing into `run_dir`; `runs_of_name` (default: run_dir's parent) is where resume=auto looks."""
    tcfg = cfg.trainer
    accelerator = Accelerator(
        cpu=tcfg.cpu,
        mixed_precision=resolve_precision(tcfg.precision, tcfg.cpu),
        log_with="wandb" if cfg.logger.kind == "wandb" else None,
    )
    # every process writes into the main process's run directory
    run_dir = Path(broadcast_object_list([str(run_dir)])[0])
    runs_of_name = Path(runs_of_name) if runs_of_name is not None else run_dir.parent
    set_seed(cfg.seed)
    main = accelerator.is_main_process

    with accelerator.main_process_first():  # the main process prepares (and caches) the data first
        task = build_task(cfg.data)
    task.check_model(cfg.model)

    checkpoint = resolve_resume(cfg.resume, runs_of_name)
    model = build_model(cfg.model)
    if cfg.init_from is not None and checkpoint is None:
        note = load_initial_weights(model, cfg.model, cfg.init_from, cfg.init_position_extension)
        if main:
            print(note)
    model = model.to(accelerator.device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, tcfg.max_steps)
    if tcfg.compile:
        model = torch.compile(model, mode=tcfg.compile_mode)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    # the scheduler is stepped here once per optimizer step (not through accelerate's per-process stepping)
    accelerator.register_for_checkpointing(scheduler, state)

    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        if main:
            print(f"resumed from {checkpoint} at step {state.step}")
    elif cfg.resume is not None and main:
        print(f"resume={cfg.resume}: no checkpoint found under {runs_of_name}, starting fresh")

    train_loader = task.train_loader(tcfg.micro_batch_size, accelerator.process_index, accelerator.num_processes,
                                     start_batch=state.batches_consumed)
    val_loader = task.eval_loader(tcfg.micro_batch_size, accelerator.process_index, accelerator.num_processes,
                                  max_batches=tcfg.eval_batches)

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=main)
    if cfg.logger.kind == "wandb":
        accelerator.init_trackers(cfg.logger.project, config=_flat_config(cfg), init_kwargs={
            "wandb": {"mode": cfg.logger.mode, "dir": str(run_dir), "name": f"{cfg.name}/{run_dir.name}"}})

    end_step = tcfg.stop_step if tcfg.stop_step is not None else tcfg.max_steps
    if main:
        n_params = accelerator.unwrap_model(model).num_parameters()
        print(f"model: {type(cfg.model).__name__} {n_params / 1e6:.2f}M parameters, attn_impl={cfg.model.attn_impl}; "
              f"device: {accelerator.device}, precision: {accelerator.mixed_precision}, "
              f"processes: {accelerator.num_processes}; run dir: {run_dir}")

    def record(**values) -> None:
        values = {"step": state.step, "tokens": state.tokens_seen, **values}
        log.write(values)
        accelerator.log({k: v for k, v in values.items() if k != "step"}, step=state.step)

    def run_eval() -> bool:
        """Evaluate and log; True when trainer.stop_metric reached trainer.stop_value."""
        metrics = evaluate(model, val_loader, task, accelerator)
        state.best_val_loss = min(state.best_val_loss, metrics["val_loss"])
        record(**metrics)
        if main:
            tqdm.write(f"step {state.step:>6}  " + "  ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in metrics.items()))
        if tcfg.stop_metric is None:
            return False
        if tcfg.stop_metric not in metrics:
            raise ValueError(f"trainer.stop_metric={tcfg.stop_metric!r} is not a validation metric of this task: "
                             f"{sorted(metrics)}")
        return metrics[tcfg.stop_metric] >= tcfg.stop_value

    if state.step == 0 and checkpoint is None:
        run_eval()  # the starting point of the validation curve

    train_iter = iter(train_loader)
    last_ckpt = checkpoint
    model.train()
    start_time = time.perf_counter()
    interval_seconds, tokens_at_log = 0.0, state.tokens_seen  # training time only: evals and saves excluded
    pbar = tqdm(total=end_step, initial=state.step, disable=not main, desc=cfg.name, unit="step", dynamic_ncols=True)
    stopped_early = False
    while state.step < end_step:
        step_start = time.perf_counter()
        loss_sum = torch.zeros((), device=accelerator.device)
        step_tokens = 0
        for micro in range(tcfg.grad_accum_steps):
            host_batch = next(train_iter)
            step_tokens += task.tokens(host_batch)  # counted on the loader's CPU tensors: no device sync
            batch = to_device(host_batch, accelerator.device)
            # gradients are all-reduced only on the last micro-batch of the step
            sync = accelerator.no_sync(model) if micro < tcfg.grad_accum_steps - 1 else nullcontext()
            with sync:
                loss = task.loss(model, batch)
                accelerator.backward(loss / tcfg.grad_accum_steps)
            loss_sum += loss.detach().float()
            state.batches_consumed += 1
        if cfg.optim.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += step_tokens * accelerator.num_processes
        interval_seconds += time.perf_counter() - step_start
        pbar.update(1)

        out_of_time = tcfg.max_minutes is not None and (time.perf_counter() - start_time) / 60 >= tcfg.max_minutes
        last = state.step == end_step or out_of_time
        if state.step % tcfg.log_interval == 0 or last:
            train_loss = accelerator.reduce(loss_sum / tcfg.grad_accum_steps, reduction="mean").item()
            tok_s = (state.tokens_seen - tokens_at_log) / max(interval_seconds, 1e-9)
            interval_seconds, tokens_at_log = 0.0, state.tokens_seen
            lr = scheduler.get_last_lr()[0]
            record(train_loss=train_loss, lr=lr, tokens_per_s=tok_s)
            pbar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
        target_reached = False
        if state.step % tcfg.eval_interval == 0 or last:
            target_reached = run_eval()
        if state.step % tcfg.save_interval == 0 or last or target_reached:
            last_ckpt = save_checkpoint(accelerator, run_dir, state.step, tcfg.keep_checkpoints)
        if target_reached and state.step < end_step:
            if main:
                tqdm.write(f"trainer.stop_metric {tcfg.stop_metric} reached {tcfg.stop_value} at step {state.step}")
            break
        if out_of_time and state.step < end_step:
            stopped_early = True
            break
    pbar.close()

    if main and not stopped_early:  # the task's end-of-run metrics (classification: the test split), logged once
        final = task.final_metrics(accelerator.unwrap_model(model), accelerator.device, tcfg.micro_batch_size)
        if final:
            record(**final)
            tqdm.write(f"step {state.step:>6}  " + "  ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in final.items()))
    sample = ""
    if main and tcfg.sample_tokens > 0:
        sample = task.sample(accelerator.unwrap_model(model), accelerator.device, cfg.seed, tcfg.sample_tokens,
                             tcfg.sample_prompt)
    if main:
        log.plot(run_dir / "curves.png", title=f"{cfg.name} ({run_dir.name})")
        if stopped_early:
            print(f"stopped after trainer.max_minutes={tcfg.max_minutes} at step {state.step}; "
                  f"continue with resume=auto")
        if sample:
            print("---- sample ----\n" + sample + "\n----------------")
        print(f"checkpoint: {last_ckpt}")
        print(f"logs: {run_dir / 'metrics.jsonl'}, curves: {run_dir / 'curves.png'}"
              + (f", wandb: {run_dir / 'wandb'} (offline; `wandb sync` uploads)" if cfg.logger.kind == "wandb" else ""))
    accelerator.end_training()
    return TrainResult(run_dir=run_dir, checkpoint=last_ckpt, final_step=state.step, history=log.records,
                       sample=sample)


def _flat_config(cfg: FlashtrainConfig) -> dict:
    flat = {}
    for group, value in asdict(cfg).items():
        if isinstance(value, dict):
            flat.update({f"{group}.{k}": v for k, v in value.items()})
        else:
            flat[group] = value
    return flat


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
