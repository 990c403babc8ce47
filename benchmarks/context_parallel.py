"""Context parallelism on N GPUs against one GPU and against PyTorch's own: how long a context trains, and how fast.

For each model (GPT-2 small; the Llama of conf/model/llama-125m.yaml when flashtrain/models/llama.py is there), one
sequence per optimizer step, the sequence length doubling from --min-len until a step runs out of memory (or takes
longer than --max-step-seconds, or would pass --max-len), with the same activation checkpointing everywhere
(--activation-checkpointing, default full: each block keeps only its input), bf16 autocast over fp32 weights, AdamW:

    one-gpu        rank 0 alone, the whole sequence; attention: flashtrain's kernel (model.attn_impl=flash)
    flashtrain-cp  all N GPUs, each holding seq_len / N tokens of the sequence (zigzag), its attention flashtrain's
                   ring attention as the trainer runs parallel.context=N (flashtrain.parallel.context: the same
                   start-up check, sharding and attention route); gradients summed over the N GPUs by DDP
    torch-cp       all N GPUs, PyTorch's context parallelism (torch.distributed.tensor.experimental.context_parallel:
                   ring attention over SDPA with its head-tail load balancing; the sequence sharded by it), the model's
                   attention through SDPA (model.attn_impl=sdpa); DDP

Each model's weights are the same in every mode (one seed) and so are the tokens (random, of GPT-2's vocabulary, the
same sequence every step), so every step's loss is the same in every mode up to bf16 rounding (recorded: losses; the
later steps' check the gradients, activation checkpointing's recomputation included). A row per (model,
mode, length): status (ok | out of memory | error: ...), the median step time and tokens/s (the sequence's tokens per
second, all GPUs of the mode together, and per GPU), every GPU's peak memory; a mode stops doubling after its first
failure, or after a length whose step took longer than --max-step-seconds (noted). Before its first length each model
and mode trains once, unrecorded, so that no measured step includes the kernels' compilation. A multi-GPU mode skips
a length whose doubled peak memory would not fit the GPU (recorded as "not run: predicted out of memory ..."): an
out-of-memory error on one GPU would leave the others waiting on the ring until the process group's timeout
(--timeout-minutes) ends the run. Writes benchmarks/results/context_parallel-<gpu>-x<N>.json (GPU name, torch version,
date, the settings, the longest length each mode trained, `table`: one row per model and length with each mode's
tokens/s and flashtrain CP's ratios to one GPU and to PyTorch's CP, and every measurement) after every measurement,
with the one under way named in `in_progress`, so a run cut short keeps what it measured and says where it stopped;
the PNG beside it (tokens/s and peak memory per GPU by length) at the end. --deadline-minutes stops starting new
measurements.

The GPU run of benchmarks/results/context_parallel-h200-x2.json, one model per call (kind nvidia-h200-x2; the device
machine needs the carried wheels of ../shared/device/wheels.sh, carry: [".whl"]; without activation checkpointing
one GPU runs out of memory at 256K tokens and every length is measured within the call; the default, full
checkpointing, keeps far less per token, which moves the lengths where memory runs out to ones whose steps are
slower than --max-step-seconds):

    eval "$(bash .whl/install.sh)" || exit 1; NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    NVSHMEM_DISABLE_NVLS=1 torchrun --nproc_per_node 2 benchmarks/context_parallel.py --models gpt2-small \\
    --activation-checkpointing none --deadline-minutes 8 --out $OUT/context_parallel-h200-x2.json

Smoke test on the CPU, 2 gloo processes, seconds (tiny models, lengths 128 and 256; flashtrain's ring attention on the
reference; PyTorch's context parallelism has no CPU SDPA, and its rows say so):

    torchrun --nproc_per_node 2 benchmarks/context_parallel.py --smoke --out /tmp/context_parallel-smoke.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashtrain.models.gpt2 import GPT2Config  # noqa: E402
from flashtrain.parallel.context import ContextParallel  # noqa: E402
from flashtrain.train import activation_checkpoint  # noqa: E402
from flashtrain.train.metrics import save_figure  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
MODES = ("one-gpu", "flashtrain-cp", "torch-cp")
VOCAB = 50257  # GPT-2's BPE, for both models
# name -> the model config's keyword arguments (n_positions is the sequence length of each measurement)
MODELS = {
    "gpt2-small": ("gpt2", dict(vocab_size=VOCAB, n_embd=768, n_layer=12, n_head=12)),
    "llama-125m": ("llama", dict(vocab_size=VOCAB, n_embd=768, n_layer=12, n_head=12, n_kv_head=4,
                                 intermediate_size=2048)),
}
SMOKE_MODELS = {  # CPU: 2 layers, 64 wide
    "gpt2-tiny": ("gpt2", dict(vocab_size=512, n_embd=64, n_layer=2, n_head=2)),
    "llama-tiny": ("llama", dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_kv_head=2, intermediate_size=128)),
}


def has_llama() -> bool:
    return importlib.util.find_spec("flashtrain.models.llama") is not None


def model_config(family: str, shape: dict, seq_len: int, attn_impl: str):
    """The model's config at `seq_len` positions (GPT-2's learned table and Llama's RoPE tables as long as the
    sequence), dropout off."""
    if family == "gpt2":
        return GPT2Config(n_positions=seq_len, attn_impl=attn_impl, **shape)
    from flashtrain.models.llama import LlamaConfig

    return LlamaConfig(n_positions=seq_len, attn_impl=attn_impl, **shape)


class Setup:
    """This process: its rank among `world`, device, the compute dtype, and the 1 x N ("dp", "cp") mesh."""

    def __init__(self, cpu: bool, timeout_s: float):
        cuda = torch.cuda.is_available() and not cpu
        # An out-of-memory error on one GPU of a mode leaves the others waiting on the ring for it (all of a mode's
        # GPUs hold the same shapes, but they need not fail at the same allocation). main() skips the lengths that
        # would run out of memory by the previous length's peak; for what remains, the timeout ends such a run. The
        # JSON names the measurement under way (in_progress) and holds every one before it. The timeout must outlast
        # the longest wait of a healthy run: the other ranks wait in trial()'s all-gather while rank 0 measures the
        # one-GPU mode alone.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.attn_impl = "flash"  # flashtrain's kernel on CUDA, its reference on the CPU
        self.mesh = init_device_mesh(self.device.type, (1, self.world), mesh_dim_names=("dp", "cp"))

    def autocast(self):
        return torch.autocast(self.device.type, self.dtype, enabled=self.dtype != torch.float32)

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build(setup: Setup, family: str, shape: dict, seq_len: int, attn_impl: str, checkpointing: str, seed: int):
    """The model (the same weights for one seed, in every mode) and its AdamW, on this process's device."""
    config = model_config(family, shape, seq_len, attn_impl)
    torch.manual_seed(seed)
    with setup.device:
        model = config.build()
    activation_checkpoint.apply(model, checkpointing)
    fused = setup.device.type == "cuda"
    return config, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)


def sequence(seq_len: int, vocab: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets) (1, seq_len) of random tokens, the same on every process."""
    tokens = torch.randint(vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def step_loop(setup: Setup, one_step, steps: int, max_step_seconds: float) -> tuple[list[float], list[float], str]:
    """Run `one_step` (forward, backward, update; returns the loss) 1 + `steps` times: (the timed steps' seconds,
    every step's loss, a note). The first step warms up; when it alone takes longer than max_step_seconds, it is the
    only one, and its time is reported."""
    times, losses = [], []
    for index in range(1 + steps):
        setup.synchronize()
        start = time.perf_counter()
        losses.append(one_step())
        setup.synchronize()
        seconds = time.perf_counter() - start
        if index == 0 and seconds > max_step_seconds:
            return [seconds], losses, f"the first step alone took {seconds:.1f} s"
        if index > 0:
            times.append(seconds)
    return times, losses, ""


def measure(setup: Setup, model_name: str, mode: str, seq_len: int, args) -> dict:
    """One measurement on this process (one-gpu: rank 0 only). Raises what the step raises."""
    family, shape = (SMOKE_MODELS if args.smoke else MODELS)[model_name]
    attn_impl = "sdpa" if mode == "torch-cp" else setup.attn_impl
    config, model, optimizer = build(setup, family, shape, seq_len, attn_impl, args.activation_checkpointing,
                                     args.seed)
    input_ids, targets = sequence(seq_len, shape["vocab_size"], args.seed, setup.device)
    positions = torch.arange(seq_len, device=setup.device)[None]  # (1, T)
    if mode != "one-gpu":
        model = DistributedDataParallel(model, device_ids=[setup.device.index] if setup.device.type == "cuda"
                                        else None)
    if mode == "flashtrain-cp":
        context = ContextParallel.from_mesh(setup.mesh, seq_len, setup.device, setup.dtype)
        context.check_model(config)  # the trainer's start-up check
        local = context.positions.to(setup.device)  # this rank's global positions, zigzag order
        batch = {"input_ids": input_ids[:, local], "targets": targets[:, local], "position_ids": local[None]}

    def one_step():
        if mode == "one-gpu":
            with setup.autocast():
                loss = model(input_ids, targets)[1]
            loss.backward()
        elif mode == "flashtrain-cp":
            with context.active():  # the forward pass and the backward's recomputation
                with setup.autocast():
                    loss = model(**batch)[1]  # the mean over this rank's tokens: DDP's average is the global mean
                loss.backward()
        else:
            from torch.distributed.tensor.experimental import context_parallel

            # sharded in place by PyTorch (its load balancing), fresh copies each step
            ids, tgt, pos = input_ids.clone(), targets.clone(), positions.clone()
            with context_parallel(setup.mesh["cp"], buffers=[ids, tgt, pos], buffer_seq_dims=[1, 1, 1],
                                  no_restore_buffers={ids, tgt, pos}):
                with setup.autocast():
                    loss = model(ids, tgt, position_ids=pos)[1]
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        if mode != "one-gpu":  # every rank's tokens are as many: the mean of the ranks' means
            dist.all_reduce(loss)
            loss /= setup.world
        return loss.item()

    times, losses, note = step_loop(setup, one_step, args.steps, args.max_step_seconds)
    step_seconds = statistics.median(times)
    gpus = 1 if mode == "one-gpu" else setup.world
    flops = model.module.flops_per_token(seq_len) if mode != "one-gpu" else model.flops_per_token(seq_len)
    return {"step_seconds": step_seconds, "tokens_per_s": seq_len / step_seconds,
            "tokens_per_s_per_gpu": seq_len / step_seconds / gpus,
            "tflops_per_gpu": flops * seq_len / step_seconds / gpus / 1e12,
            "losses": losses, "note": note}


def peak_memory_gib(setup: Setup) -> float | None:
    return torch.cuda.max_memory_allocated(setup.device) / 2**30 if setup.device.type == "cuda" else None


def trial(setup: Setup, model_name: str, mode: str, seq_len: int, args) -> dict:
    """One measurement, agreed on by every process: the row (rank 0's numbers, every GPU's peak memory)."""
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    result, failure = {}, None
    takes_part = mode != "one-gpu" or setup.rank == 0
    if takes_part:
        try:
            result = measure(setup, model_name, mode, seq_len, args)
        except torch.cuda.OutOfMemoryError:
            failure = "out of memory"
        except Exception as error:  # recorded as the row's status: PyTorch's CP has no CPU SDPA, for one
            failure = f"error: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    everyone = [None] * setup.world
    dist.all_gather_object(everyone, (failure, result, peak_memory_gib(setup) if takes_part else None))
    failures = [f for f, _, _ in everyone if f is not None]
    row = {"model": model_name, "mode": mode, "seq_len": seq_len,
           "gpus": 1 if mode == "one-gpu" else setup.world,
           "status": "ok" if not failures else ("out of memory" if "out of memory" in failures else failures[0]),
           **(everyone[0][1] if not failures else {}),
           "peak_memory_gib": [m for _, _, m in everyone if m is not None]}
    return row


def predicted_out_of_memory(rows: list[dict], model_name: str, mode: str, seq_len: int,
                            capacity_gib: float | None) -> str:
    """Why `mode` would run out of memory at `seq_len` ("" if it should fit): its peak at the previous length,
    doubled (activations and the logits grow linearly with the tokens; weights and optimizer state are a small
    constant part), above the GPU's memory (capacity_gib; None: the CPU, no prediction). Multi-GPU modes only: there
    an out-of-memory error can leave the other GPUs waiting (Setup); a one-GPU run just records it."""
    if capacity_gib is None or mode == "one-gpu":
        return ""
    previous = [r for r in rows if r["model"] == model_name and r["mode"] == mode and r["status"] == "ok"
                and r["seq_len"] * 2 == seq_len and r.get("peak_memory_gib")]
    if not previous:
        return ""
    peak = max(previous[-1]["peak_memory_gib"])
    if 2 * peak <= capacity_gib:
        return ""
    return (f"not run: predicted out of memory (peak {peak:.1f} GiB per GPU at {seq_len // 2} tokens, doubled "
            f"{2 * peak:.1f} > {capacity_gib:.1f} GiB)")


def comparison(rows: list[dict]) -> list[dict]:
    """One row per (model, length) at which some mode trained: each mode's tokens/s (all its GPUs) or its status,
    and the ratios of flashtrain's context parallelism to one GPU and to PyTorch's context parallelism where both
    trained. (The measurements keep the status of a length where none did.)"""
    table = []
    for model, seq_len in dict.fromkeys((r["model"], r["seq_len"]) for r in rows if r["status"] == "ok"):
        row: dict = {"model": model, "seq_len": seq_len}
        speed = {}
        for r in rows:
            if r["model"] == model and r["seq_len"] == seq_len:
                if r["status"] == "ok":
                    speed[r["mode"]] = r["tokens_per_s"]
                    row[r["mode"]] = r["tokens_per_s"]
                else:
                    row[r["mode"]] = r["status"][:60]
        if "flashtrain-cp" in speed and "one-gpu" in speed:
            row["cp_over_one_gpu"] = speed["flashtrain-cp"] / speed["one-gpu"]
        if "flashtrain-cp" in speed and "torch-cp" in speed:
            row["cp_over_torch_cp"] = speed["flashtrain-cp"] / speed["torch-cp"]
        table.append(row)
    return table


def longest(rows: list[dict]) -> dict:
    """{model: {mode: the longest length with status ok}}."""
    best: dict = {}
    for row in rows:
        if row["status"] == "ok":
            best.setdefault(row["model"], {})
            best[row["model"]][row["mode"]] = max(best[row["model"]].get(row["mode"], 0), row["seq_len"])
    return best


def plot(rows: list[dict], env: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({row["model"] for row in rows})
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4 * len(models)), squeeze=False)
    for (speed, memory), model in zip(axes, models):
        never = []  # modes without a length that trained, and why
        for mode in MODES:
            ok = [r for r in rows if r["model"] == model and r["mode"] == mode and r["status"] == "ok"]
            if not ok:
                never += [f"{mode}: {r['status'][:90]}" for r in rows if r["model"] == model and r["mode"] == mode][:1]
                continue
            label = f"{mode} ({ok[0]['gpus']} GPU{'s' if ok[0]['gpus'] > 1 else ''})"
            lengths = [r["seq_len"] for r in ok]
            line, = speed.plot(lengths, [r["tokens_per_s"] for r in ok], "o-", label=label)
            if all(r["peak_memory_gib"] for r in ok):
                memory.plot(lengths, [max(r["peak_memory_gib"]) for r in ok], "o-", color=line.get_color(),
                            label=label)
            failed = [r for r in rows if r["model"] == model and r["mode"] == mode and r["status"] != "ok"]
            for r in failed:  # where it stopped
                speed.axvline(r["seq_len"], color=line.get_color(), ls=":", alpha=0.6)
        if never:
            speed.text(0.02, 0.02, "\n".join(never), fontsize=7, transform=speed.transAxes, va="bottom")
        speed.set(yscale="log", xlabel="sequence length (tokens)", ylabel="tokens/s (all its GPUs)",
                  title=f"{model}: training tokens/s (dotted: the length that failed)")
        memory.set(xlabel="sequence length (tokens)", ylabel="peak memory per GPU (GiB, the largest)",
                   title=f"{model}: peak memory")
        for ax in (speed, memory):
            ax.set_xscale("log", base=2)
    fig.suptitle(f"context parallelism on {env['gpus']} x {env['device_name']} (torch {env['torch']}, "
                 f"activation checkpointing {env['activation_checkpointing']})", fontsize=10)
    for ax in axes.flatten():
        if not ax.lines:  # the CPU: no GPU memory
            ax.text(0.5, 0.5, "no measurement (peak memory: GPUs only)", ha="center", transform=ax.transAxes)
    save_figure(fig, [ax for ax in axes.flatten() if ax.lines], png)


def write(out: Path, env: dict, rows: list[dict], in_progress: str | None = None) -> None:
    """The record: env, the longest length each mode trained, the comparison table (the docs' table), every
    measurement, and the measurement under way while one is (a run that ends inside it leaves that mark)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"env": env, "longest": longest(rows), "table": comparison(rows), "measurements": rows}
    if in_progress:
        record["in_progress"] = in_progress
    out.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo: tiny models at 128 and 256 tokens")
    parser.add_argument("--models", nargs="+", help="default: gpt2-small and (when present) llama-125m")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--min-len", type=int, help="first sequence length (default 8192; smoke: 128)")
    parser.add_argument("--max-len", type=int, help="longest sequence length tried (default 2**20; smoke: 256)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the first")
    parser.add_argument("--max-step-seconds", type=float, default=30.0,
                        help="a mode stops doubling after a length whose step took longer")
    parser.add_argument("--activation-checkpointing", default="full", choices=("none", "full", "selective"))
    parser.add_argument("--deadline-minutes", type=float, default=None, help="start no measurement after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the JSON (PNG beside it); default benchmarks/results/")
    parser.add_argument("--timeout-minutes", type=float, default=None,
                        help="the process group's timeout (default: the longest a healthy measurement can take, "
                             "(3 + steps) x --max-step-seconds, at least 5 minutes)")
    args = parser.parse_args(argv)
    timeout_s = 60 * args.timeout_minutes if args.timeout_minutes else max(300.0, (3 + args.steps)
                                                                           * args.max_step_seconds)
    setup = Setup(cpu=args.smoke, timeout_s=timeout_s)
    start_time = time.monotonic()
    names = args.models or (list(SMOKE_MODELS) if args.smoke else
                            ["gpt2-small"] + (["llama-125m"] if has_llama() else []))
    start, max_len = args.min_len or (128 if args.smoke else 8192), args.max_len or (256 if args.smoke else 2**20)
    device_name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu"
    env = {"device_name": device_name, "gpus": setup.world, "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "precision": "bf16 autocast, fp32 weights" if setup.dtype == torch.bfloat16 else "fp32",
           "activation_checkpointing": args.activation_checkpointing, "batch": "1 sequence per step",
           "steps": f"1 warm-up + {args.steps} timed (median)", "max_step_seconds": args.max_step_seconds,
           "models": {name: (SMOKE_MODELS if args.smoke else MODELS)[name][1] for name in names},
           "warm_up": f"each model and mode trains {start} tokens once before its first measurement, not recorded "
                      "(the kernels compile at first use)"}
    slug = "cpu-smoke" if args.smoke else device_name.replace(" ", "_")
    out = args.out or RESULTS / f"context_parallel-{slug}-x{setup.world}.json"
    capacity_gib = (torch.cuda.get_device_properties(setup.device).total_memory / 2**30
                    if setup.device.type == "cuda" else None)
    rows: list[dict] = []
    for name in names:
        running = list(args.modes)
        for mode in running:  # compile what the mode runs, so that no measured step (or its cut-off) includes it
            trial(setup, name, mode, start, args)
        seq_len = start
        while running and seq_len <= max_len:
            for mode in list(running):
                late = [args.deadline_minutes is not None and
                        time.monotonic() - start_time > 60 * args.deadline_minutes]
                dist.broadcast_object_list(late, src=0)  # rank 0's clock: every process stops at the same one
                if late[0]:
                    running = []
                    env["cut_short"] = f"--deadline-minutes {args.deadline_minutes} reached before {name} {mode} " \
                                       f"at {seq_len}"
                    break
                skip = predicted_out_of_memory(rows, name, mode, seq_len, capacity_gib)
                if skip:
                    row = {"model": name, "mode": mode, "seq_len": seq_len,
                           "gpus": 1 if mode == "one-gpu" else setup.world, "status": skip}
                else:
                    if setup.rank == 0:
                        write(out, env, rows, in_progress=f"{name} {mode} {seq_len}")
                    row = trial(setup, name, mode, seq_len, args)
                rows.append(row)
                if setup.rank == 0:
                    print(json.dumps(row), flush=True)
                    write(out, env, rows)
                if row["status"] != "ok" or row["step_seconds"] > args.max_step_seconds:
                    running.remove(mode)
            seq_len *= 2
    if setup.rank == 0:
        write(out, env, rows)
        plot(rows, env, out.with_suffix(".png"))
        print(f"longest that trained: {json.dumps(longest(rows))}\nwrote {out} and {out.with_suffix('.png')}")
    # every rank tears the group down together: a gloo rank destroying its group while rank 0 still writes the JSON
    # and the plot aborted now and then at exit ("terminate called without an active exception", ~1 run in 40)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
