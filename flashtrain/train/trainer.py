"""The training loop: Accelerate for devices, mixed precision and processes; atomic checkpoints; eval and logging.

One optimizer step = `grad_accum_steps` micro-batches of `micro_batch_size` sequences on every process.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, set_seed
from tqdm.auto import tqdm

from flashtrain.data.lm import LMData, make_train_loader, make_val_loader, prepare_lm_data
from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.train.checkpoint import TrainState, resolve_resume, save_checkpoint
from flashtrain.train.config import FlashtrainConfig
from flashtrain.train.metrics import MetricsLog
from flashtrain.train.optim import build_optimizer, build_scheduler


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
    raise TypeError(f"model: no model is registered for config type {type(model_cfg).__name__}")


def resolve_precision(precision: str, cpu: bool) -> str:
    if precision != "auto":
        return precision
    if cpu or not torch.cuda.is_available():
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


@torch.no_grad()
def evaluate(model, loader, accelerator: Accelerator) -> float:
    """Mean validation loss over this process's validation batches, averaged over processes."""
    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = 0
    for x, y in loader:
        _, loss = model(x.to(accelerator.device), y.to(accelerator.device))
        total += loss.float()
        count += 1
    model.train()
    return accelerator.reduce(total / count, reduction="mean").item()


def generate_sample(model, data: LMData, prompt: str, n_tokens: int, device, seed: int) -> str:
    model.eval()  # no dropout while sampling
    ids = data.tokenizer.encode(prompt).ids or [data.eos_id]
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens=n_tokens, temperature=0.8, top_k=50, generator=generator)
    return data.tokenizer.decode(out[0].tolist())


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

    with accelerator.main_process_first():
        data = prepare_lm_data(cfg.data)
    if cfg.model.vocab_size < data.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({data.vocab_size})")
    if cfg.data.seq_len > cfg.model.n_positions:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds model.n_positions={cfg.model.n_positions}")

    model = build_model(cfg.model).to(accelerator.device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, tcfg.max_steps)
    if tcfg.compile:
        model = torch.compile(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    # the scheduler is stepped here once per optimizer step (not through accelerate's per-process stepping)
    accelerator.register_for_checkpointing(scheduler, state)

    checkpoint = resolve_resume(cfg.resume, runs_of_name)
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        if main:
            print(f"resumed from {checkpoint} at step {state.step}")
    elif cfg.resume is not None and main:
        print(f"resume={cfg.resume}: no checkpoint found under {runs_of_name}, starting fresh")

    train_loader = make_train_loader(data, tcfg.micro_batch_size, rank=accelerator.process_index,
                                     world_size=accelerator.num_processes, start_batch=state.batches_consumed,
                                     num_workers=cfg.data.num_workers)
    val_loader = make_val_loader(data, tcfg.micro_batch_size, max_batches=tcfg.eval_batches,
                                 rank=accelerator.process_index, world_size=accelerator.num_processes)

    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=main)
    if cfg.logger.kind == "wandb":
        accelerator.init_trackers(cfg.logger.project, config=_flat_config(cfg), init_kwargs={
            "wandb": {"mode": cfg.logger.mode, "dir": str(run_dir), "name": f"{cfg.name}/{run_dir.name}"}})

    tokens_per_step = tcfg.micro_batch_size * tcfg.grad_accum_steps * cfg.data.seq_len * accelerator.num_processes
    end_step = tcfg.stop_step if tcfg.stop_step is not None else tcfg.max_steps
    if main:
        n_params = accelerator.unwrap_model(model).num_parameters()
        print(f"model: {type(cfg.model).__name__} {n_params / 1e6:.2f}M parameters, attn_impl={cfg.model.attn_impl}; "
              f"device: {accelerator.device}, precision: {accelerator.mixed_precision}, "
              f"processes: {accelerator.num_processes}; {tokens_per_step} tokens/step; run dir: {run_dir}")

    def record(**values) -> None:
        values = {"step": state.step, "tokens": state.tokens_seen, **values}
        log.write(values)
        accelerator.log({k: v for k, v in values.items() if k != "step"}, step=state.step)

    def run_eval() -> float:
        val_loss = evaluate(model, val_loader, accelerator)
        state.best_val_loss = min(state.best_val_loss, val_loss)
        record(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)))
        if main:
            tqdm.write(f"step {state.step:>6}  val loss {val_loss:.4f}  val ppl {math.exp(min(val_loss, 50.0)):.2f}")
        return val_loss

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
        for micro in range(tcfg.grad_accum_steps):
            x, y = next(train_iter)
            x = x.to(accelerator.device, non_blocking=True)
            y = y.to(accelerator.device, non_blocking=True)
            # gradients are all-reduced only on the last micro-batch of the step
            sync = accelerator.no_sync(model) if micro < tcfg.grad_accum_steps - 1 else nullcontext()
            with sync:
                _, loss = model(x, y)
                accelerator.backward(loss / tcfg.grad_accum_steps)
            loss_sum += loss.detach().float()
            state.batches_consumed += 1
        if cfg.optim.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens_seen += tokens_per_step
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
        if state.step % tcfg.eval_interval == 0 or last:
            run_eval()
        if state.step % tcfg.save_interval == 0 or last:
            last_ckpt = save_checkpoint(accelerator, run_dir, state.step, tcfg.keep_checkpoints)
        if out_of_time and state.step < end_step:
            stopped_early = True
            break
    pbar.close()

    sample = ""
    if main and tcfg.sample_tokens > 0:
        sample = generate_sample(accelerator.unwrap_model(model), data, tcfg.sample_prompt, tcfg.sample_tokens,
                                 accelerator.device, cfg.seed)
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


def save_resolved_config(cfg_yaml: str, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg_yaml)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
