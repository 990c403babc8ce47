"""Issue 17's GPU check: GPT-2 small at 4K context trained plainly on one GPU, with FSDP on one process, and with
activation checkpointing (full, selective): the same seed, data and global batch, 50 steps each, through the same
commands a user types. The loss curves must agree up to bf16 noise (a second plain run measures that noise: the
kernel's backward adds dQ with atomics, so two plain runs differ too); peak memory and tokens/s show what FSDP and
checkpointing cost or save.

    plain, plain-again  python launch.py recipe=gpt2-small-4k ...
    fsdp-1              accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 1 launch.py ...
    ac-full             python launch.py ... trainer.activation_checkpointing=full
    ac-selective        python launch.py ... trainer.activation_checkpointing=selective

    python benchmarks/multiprocess_gpu.py [--steps 50] [--runs plain fsdp-1 ...] [--out benchmarks/results/]

Corpus: this Python's standard library (no download), a BPE of 8192 tokens trained on the first run and cached under
--cache-dir; 10% of its files held out for validation (data.val_fraction=0.1: the default 2% of a small standard
library can be fewer 4K-token sequences than one micro-batch), of which the first 32 sequences are scored. Needs
flashtrain's dependencies (pip install -e ".[cuda12]" or ".[cuda13]"; offline: wheels of hydra-core, omegaconf,
antlr4-python3-runtime, datasets, tokenizers, accelerate and their dependencies). Writes
<out>/multiprocess_gpu-<gpu>.json (per run: train losses by step, the largest and mean |loss - plain's|, peak memory,
tokens/s, wall time) and <out>/multiprocess_gpu-<gpu>.png (the curves), and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashtrain.train.metrics import plot_curves  # noqa: E402
from flashtrain.train.trainer import read_metrics  # noqa: E402

ACCELERATE = [str(Path(sys.executable).parent / "accelerate") if (Path(sys.executable).parent / "accelerate").is_file()
              else shutil.which("accelerate"), "launch"]
# label -> (the launcher before launch.py, extra overrides)
RUNS = {
    "plain": ([sys.executable], ()),
    "plain-again": ([sys.executable], ()),
    "fsdp-1": ([*ACCELERATE, "--config_file", str(REPO / "conf/accelerate/fsdp.yaml"), "--num_processes", "1"], ()),
    "ac-full": ([sys.executable], ("trainer.activation_checkpointing=full",)),
    "ac-selective": ([sys.executable], ("trainer.activation_checkpointing=selective",)),
}


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run(label: str, args, run_dir: Path) -> tuple[list[dict], float]:
    launcher, extra = RUNS[label]
    if launcher[0] != sys.executable:
        launcher = [*launcher, "--main_process_port", free_port()]
    overrides = [
        "recipe=gpt2-small-4k", "data=stdlib", "data.max_bytes=0", f"data.cache_dir={args.cache_dir}",
        "data.sample_tokens=32", "logger=none", f"name=multiprocess-{label}", f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={args.steps}", f"optim.warmup_steps={max(args.steps // 10, 1)}",
        f"trainer.micro_batch_size={args.micro_batch}", f"trainer.global_batch_size={args.global_batch}",
        "trainer.log_interval=1", f"trainer.eval_interval={args.steps // 2}", "data.val_fraction=0.1",
        "data.val_samples=32",
        f"trainer.save_interval={args.steps}", *extra, *args.extra,
    ]
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.run([*launcher, str(REPO / "launch.py"), *overrides], cwd=REPO)
    seconds = time.perf_counter() - start
    print(f"{label}: exit {proc.returncode}, {seconds:.0f} s", flush=True)
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    return records, seconds if proc.returncode == 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                        help="directory for the JSON and PNG")
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/multiprocess_gpu"), help="where the runs write")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/multiprocess_gpu/cache"), help="data cache")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=8, help="the recipe's micro-batch at 4K")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step: 2 micro-batches, 64K tokens")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    histories, seconds = {}, {}
    for label in args.runs:
        histories[label], seconds[label] = run(label, args, args.runs_dir / label)

    def train_losses(records):
        return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}

    plain = train_losses(histories.get("plain", []))
    summary_runs = {}
    for label, records in histories.items():
        losses = train_losses(records)
        diffs = [abs(losses[step] - plain[step]) for step in losses if step in plain]
        speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first includes compilation
        summary_runs[label] = {
            "train_loss": losses, "steps": len(losses), "wall_s": seconds[label],
            "max_abs_loss_diff_vs_plain": max(diffs) if diffs else None,
            "mean_abs_loss_diff_vs_plain": sum(diffs) / len(diffs) if diffs else None,
            "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
            "peak_memory_gib": max((r["peak_memory_gib"] for r in records if "peak_memory_gib" in r), default=None),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
        }
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tag = gpu.split()[-1].lower() if torch.cuda.is_available() else "cpu"
    summary = {"device": gpu, "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "model": "GPT-2 small (recipe gpt2-small-4k), 4096 tokens, bf16", "corpus": "stdlib, BPE 8192",
               "global_batch": args.global_batch, "micro_batch": args.micro_batch, "steps": args.steps,
               "runs": summary_runs}
    (args.out / f"multiprocess_gpu-{tag}.json").write_text(json.dumps(summary, indent=1))
    plot_curves({label: records for label, records in histories.items() if records},
                args.out / f"multiprocess_gpu-{tag}.png")
    print(f"| run | steps | max / mean abs loss diff vs plain | peak memory (GiB) | tokens/s | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, info in summary_runs.items():
        diff = (f"{info['max_abs_loss_diff_vs_plain']:.4f} / {info['mean_abs_loss_diff_vs_plain']:.4f}"
                if info["max_abs_loss_diff_vs_plain"] is not None else "-")
        memory = f"{info['peak_memory_gib']:.1f}" if info["peak_memory_gib"] is not None else "-"
        speed = f"{info['tokens_per_s']:,.0f}" if info["tokens_per_s"] is not None else "-"
        print(f"| {label} | {info['steps']} | {diff} | {memory} | {speed} | {info['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
