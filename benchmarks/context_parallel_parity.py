"""Context parallelism's loss parity with one GPU, through the commands a user types: GPT-2 small at 16K tokens,
`parallel.context=N` on N GPUs against one GPU, the same seed, data and steps. Trainings of launch.py, each in its own
run directory under --workdir, with the same overrides (--overrides) otherwise:

    A, B, C   python launch.py <overrides>                                         one GPU, --one-gpu-runs times (3)
    CP        torchrun --nproc_per_node N launch.py <overrides> parallel.context=N  each sequence split over N GPUs

The data is prepared first as its own step (python -m flashtrain.data.prepare <overrides>), so that no run's time
includes it. On a GPU two identical one-GPU runs differ already (bf16 autocast; the attention kernel's backward adds
dQ with atomics), and the CP run differs from A in the order of its sums too (ring attention merges the blocks of
keys by their log-sum-exp, each block's output rounded to bf16 first; DDP averages the gradients). The verdict is
benchmarks/multiprocess_gpu.py's for DDP and FSDP: CP is within the spread of one-GPU runs when

    mean |loss_CP - loss_A|  <=  max(1.5 x spread, --floor),   spread = max over pairs of one-GPU runs of
                                                                         mean |loss_X - loss_Y|

over the steps all runs logged. One pair is one sample of the spread; three runs give three pairs, and the 1.5 leaves
the margin the DDP and FSDP checks leave. The floor (default 1e-5, the DDP tests' float32 tolerance) is for the CPU,
where one-process runs agree to float32 round-off (B repeats A bit for bit in most runs: a spread of 0 or near it) and
the CP run differs by float32 round-off only (~1e-6 on losses of ~6). Read cp_over_spread (mean |CP - A| / threshold)
with the verdict: near or below 1 is noise, many times 1 a real difference.

Default overrides (the GPU run): recipe=gpt2-small-4k with model.n_positions=16384 (data.seq_len follows), one
sequence per optimizer step (16K tokens), 50 steps, a loss every step (trainer.log_interval=1) into the run's
metrics.jsonl, validation and a checkpoint only at the start / end (the trainer always does those), data=python-site
(every .py file of the GPU machine's Python, capped at 100 MB), no tracker, and three changes to the recipe: its 2000
warmup steps would leave the learning rate at 2.5% of its peak by step 50 (the weights would barely move, and any two
runs would agree), so optim.warmup_steps=5; its 512 validation sequences are 8M tokens at 16K, so data.val_samples=8;
no sample generated at the end (data.sample_tokens=0).

The GPU run, one device call (kind nvidia-h200-x2, carry: [".whl"], the wheels of ../shared/device/wheels.sh; with
three one-GPU runs it took 3.3 minutes on two H200s: data 35 s, one-GPU runs 28-53 s each (the first builds the
kernels), the CP run 38 s):

    eval "$(bash .whl/install.sh)" || exit 1; export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1; python3 benchmarks/context_parallel_parity.py \\
    --workdir /tmp/cp_parity --out $OUT/context_parallel_parity-h200-x2.json 2>&1 | tee $OUT/context_parallel_parity.log

Smoke test on the CPU (--smoke, under a minute; tests/test_context_parallel_parity.py): the default recipe's tiny
GPT-2 (4 layers, 192 wide) at 256 tokens, 2 sequences per step, 10 steps, trainer.cpu=true, the CP run on 2 gloo
processes; the one-process runs equal A exactly and CP differs from A by float32 round-off.

The JSON (--out; the PNG beside it: the loss curves, and |loss - A's| per step):
    env         device name, GPU count, torch and CUDA versions, date (UTC)
    overrides   the overrides every run got; context: N
    prepare     the data preparation's command, exit code and seconds
    runs        A, B, C, ..., CP: command (as run), exit code, wall seconds, header (the run's "processes:", "model:"
                and "batch:" lines), train_loss {step: loss}, steps (how many logged a loss), val_loss {step: loss},
                tokens_per_s (the median of the steps after the first two, which include start-up work; all GPUs of
                the run together: a step is the same 16K tokens in every run), peak_memory_gib_per_gpu (each GPU's
                largest over the steps; null on the CPU)
    comparison  cp_vs_a and one_gpu_vs_a {B: ..., C: ...}: {mean, max, steps, abs_diff {step: |difference|}};
                cp_vs_one_gpu_means (mean |CP - X| for each one-GPU run X); spread (multiprocess_gpu.pair_noise: mean
                and max, the largest pair's; pairs; pair_means, pair_maxes); floor, margin, threshold, cp_over_spread, cp_within_spread (the verdict), the
                rule in words, speedup_cp_vs_a (CP's tokens/s over A's)
The script exits 1 when a run fails (the JSON then holds what there is, the verdict null, and no PNG is drawn) or
when the verdict is false, after writing its files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from flashtrain.train.metrics import save_figure  # noqa: E402
from flashtrain.train.trainer import read_metrics  # noqa: E402
from multiprocess_gpu import pair_noise  # noqa: E402  (the DDP / FSDP checks' run-to-run spread)

GPU_OVERRIDES = [
    "recipe=gpt2-small-4k", "model.n_positions=16384", "data=python-site", "logger=none",
    "trainer.max_steps=50", "trainer.micro_batch_size=1", "trainer.global_batch_size=1",
    "trainer.log_interval=1", "trainer.eval_interval=1000", "trainer.save_interval=1000",
    "optim.warmup_steps=5", "data.val_samples=8", "data.sample_tokens=0",
]
# the default recipe's model (gpt2-tiny: 4 layers, 192 wide, 256 positions) on 300 KB of the standard library
SMOKE_OVERRIDES = [
    "logger=none", "trainer.cpu=true", "data.max_bytes=300000", "data.val_fraction=0.1", "data.num_proc=1",
    "trainer.max_steps=10", "trainer.micro_batch_size=2", "trainer.global_batch_size=2", "optim.warmup_steps=2",
    "trainer.log_interval=1", "trainer.eval_interval=1000", "trainer.save_interval=1000",
    "data.val_samples=4", "data.sample_tokens=0",
]
# the script sets these for each run
PER_RUN_KEYS = ("hydra.run.dir", "parallel.context")
FLOOR = 1e-5  # the DDP tests' float32 tolerance on losses (tests/test_processes.py)
MARGIN = 1.5  # multiprocess_gpu.py's: DDP / FSDP within noise when no further than 1.5 x the one-GPU spread
# NVLink multicast stays off on shared GPU hosts (NCCL, PyTorch's symmetric memory, NVSHMEM)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# the repository first on the path, ahead of what is there already (on the GPU machine: the carried wheels)
ENV = {**os.environ, **NO_MULTICAST, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
SKIPPED_STEPS = 2  # tokens/s: the first steps include start-up work (kernel builds, allocator growth)


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def check_overrides(overrides: list[str]) -> None:
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in PER_RUN_KEYS:
            raise SystemExit(f"--overrides: {override!r} sets {key}, which the script sets for each run "
                             f"(hydra.run.dir: <workdir>/<run>; parallel.context: --context for the CP run only)")


def one_gpu_labels(count: int) -> list[str]:
    """The one-GPU runs' labels: A, B, C, ..."""
    return [chr(ord("A") + i) for i in range(count)]


def commands(args, overrides: list[str]) -> dict[str, list[str]]:
    """label -> the run's command: the one-GPU runs (A, B, ...), then CP. torchrun as `python -m
    torch.distributed.run` (the module behind the torchrun script), so that this Python runs them all."""
    one_gpu = [sys.executable, str(REPO / "launch.py"), *overrides]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.context),
                "--master_port", free_port()]
    runs = {label: [*one_gpu, f"hydra.run.dir={args.workdir / label}"] for label in one_gpu_labels(args.one_gpu_runs)}
    runs["CP"] = [*torchrun, str(REPO / "launch.py"), *overrides, f"parallel.context={args.context}",
                  f"hydra.run.dir={args.workdir / 'CP'}"]
    return runs


def execute(command: list[str], log: Path) -> tuple[int, float]:
    """Run `command` from the repository's root, its output into `log`: (exit code, seconds)."""
    start = time.perf_counter()
    with log.open("w") as output:
        code = subprocess.run(command, cwd=REPO, env=ENV, stdout=output, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    print(f"{log.stem}: exit {code}, {seconds:.0f} s (log: {log})", flush=True)
    if code:
        print(log.read_text()[-3000:], flush=True)
    return code, seconds


def summarize(command: list[str], code: int, seconds: float, run_dir: Path, log: Path) -> dict:
    """One run's entry of the JSON, from its metrics.jsonl and its log."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    train = [r for r in records if "train_loss" in r]
    speeds = [r["tokens_per_s"] for r in train][SKIPPED_STEPS:]
    peaks = [r.get("peak_memory_gib_per_process", [r["peak_memory_gib"]]) for r in train if "peak_memory_gib" in r]
    header = [line for line in log.read_text().splitlines() if line.startswith(("processes:", "model:", "batch:"))]
    return {
        "command": shlex.join(command), "exit_code": code, "wall_s": round(seconds, 1), "header": header,
        "train_loss": {r["step"]: r["train_loss"] for r in train}, "steps": len(train),
        "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "peak_memory_gib_per_gpu": [round(max(peak[i] for peak in peaks), 3) for i in range(len(peaks[0]))]
        if peaks else None,
    }


def differences(losses: dict[int, float], reference: dict[int, float]) -> dict | None:
    """|losses - reference| over the steps both logged: mean, max, the step count and each step's."""
    steps = [step for step in losses if step in reference]
    if not steps:
        return None
    diffs = {step: abs(losses[step] - reference[step]) for step in steps}
    return {"mean": sum(diffs.values()) / len(diffs), "max": max(diffs.values()), "steps": len(diffs),
            "abs_diff": diffs}


def compare(runs: dict[str, dict], floor: float) -> dict:
    """The verdict, multiprocess_gpu.py's rule for DDP and FSDP: mean |CP - A| <= threshold = max(MARGIN x the
    spread, floor), the spread being the largest mean |difference| of any two one-GPU runs; null when a run logged
    no loss."""
    one = [label for label in runs if label != "CP"]
    cp = runs["CP"]["train_loss"]
    cp_vs_a = differences(cp, runs["A"]["train_loss"])
    others = {label: differences(runs[label]["train_loss"], runs["A"]["train_loss"]) for label in one[1:]}
    spread = pair_noise([runs[label]["train_loss"] for label in one])
    cp_vs_one = {label: differences(cp, runs[label]["train_loss"]) for label in one}
    comparison = {"cp_vs_a": cp_vs_a,
                  "one_gpu_vs_a": others,  # each other one-GPU run against A, per step (the plot's noise curves)
                  "cp_vs_one_gpu_means": {label: d and d["mean"] for label, d in cp_vs_one.items()},
                  "floor": floor, "margin": MARGIN,
                  "rule": f"cp_within_spread: mean |loss_CP - loss_A| <= threshold = max({MARGIN} x spread, floor), "
                          "spread = the largest mean |loss difference| of two one-GPU runs, over the steps all runs "
                          "logged (multiprocess_gpu.py's rule for DDP and FSDP)"}
    if cp_vs_a and spread:
        threshold = max(MARGIN * spread["mean"], floor)
        comparison.update(spread=spread, threshold=threshold, cp_over_spread=cp_vs_a["mean"] / threshold,
                          cp_within_spread=cp_vs_a["mean"] <= threshold)
    else:
        comparison["cp_within_spread"] = None
    if runs["A"]["tokens_per_s"] and runs["CP"]["tokens_per_s"]:
        comparison["speedup_cp_vs_a"] = runs["CP"]["tokens_per_s"] / runs["A"]["tokens_per_s"]
    return comparison


def plot(runs: dict[str, dict], comparison: dict, png: Path, title: str) -> None:
    """Training loss by step (left) and |loss - A's| by step (right), each with its mean dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {label: dict(color=f"C{i + 1}", linestyle="--") for i, label in enumerate(runs) if label != "CP"}
    styles.update(A=dict(color="C0"), CP=dict(color="k", linestyle=":"))
    for label, run in runs.items():
        ax_loss.plot(list(run["train_loss"]), list(run["train_loss"].values()), label=label, linewidth=1.2,
                     **styles[label])
    curves = {**comparison.get("one_gpu_vs_a", {}), "CP": comparison.get("cp_vs_a")}
    for label, difference in curves.items():
        if difference:
            diffs = difference["abs_diff"]
            line, = ax_diff.plot(list(diffs), list(diffs.values()), marker=".", linewidth=1.0,
                                 label=f"|{label} - A| (mean {difference['mean']:.2e})", **styles[label])
            ax_diff.axhline(difference["mean"], color=line.get_color(), linewidth=0.6, linestyle=":")
    if "threshold" in comparison:
        ax_diff.axhline(comparison["threshold"], color="gray", linewidth=0.8, linestyle="--",
                        label=f"threshold {comparison['threshold']:.2e}")
    ax_loss.set(xlabel="optimizer step", ylabel="train loss")
    ax_loss.set_title(title, fontsize=10)
    ax_diff.set(xlabel="optimizer step", ylabel="|train loss - A's|")
    ax_diff.set_title(f"|loss - A's| (one-GPU runs: the noise); CP within spread: "
                      f"{comparison.get('cp_within_spread')}",
                      fontsize=10)
    save_figure(fig, (ax_loss, ax_diff), png)


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
            "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny default model, 2 gloo processes")
    parser.add_argument("--overrides", nargs="+", help="every run's overrides (default: GPT-2 small at 16K, 50 steps; "
                                                       "--smoke: the tiny model)")
    parser.add_argument("--context", type=int, default=2, help="N: parallel.context and the CP run's processes")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/context_parallel_parity"),
                        help="the runs' directories (A, B, CP; emptied first), their logs, the data cache")
    parser.add_argument("--out", type=Path, required=True, help="the JSON (the PNG beside it)")
    parser.add_argument("--floor", type=float, default=FLOOR, help="the smallest threshold the verdict allows")
    parser.add_argument("--one-gpu-runs", type=int, default=3,
                        help="one-GPU runs (A, B, C, ...): their pairs measure the run-to-run spread")
    args = parser.parse_args(argv)
    if args.context < 2:
        raise SystemExit(f"--context must be >= 2 (the CP run's processes), got {args.context}")
    if not 2 <= args.one_gpu_runs <= 26:
        raise SystemExit(f"--one-gpu-runs must be in [2, 26] (a pair at least), got {args.one_gpu_runs}")
    overrides = list(args.overrides or (SMOKE_OVERRIDES if args.smoke else GPU_OVERRIDES))
    check_overrides(overrides)
    args.workdir = args.workdir.resolve()
    if not any(o.split("=", 1)[0] == "data.cache_dir" for o in overrides):  # the prepared data, for all three
        overrides.append(f"data.cache_dir={args.workdir / 'cache'}")
    args.workdir.mkdir(parents=True, exist_ok=True)

    prepare_command = [sys.executable, "-m", "flashtrain.data.prepare", *overrides]
    code, seconds = execute(prepare_command, args.workdir / "prepare.log")
    result = {"env": {}, "overrides": overrides, "context": args.context,
              "prepare": {"command": shlex.join(prepare_command), "exit_code": code, "wall_s": round(seconds, 1)},
              "runs": {}}
    if code == 0:
        for label, command in commands(args, overrides).items():
            shutil.rmtree(args.workdir / label, ignore_errors=True)
            log = args.workdir / f"{label}.log"
            code, seconds = execute(command, log)
            result["runs"][label] = summarize(command, code, seconds, args.workdir / label, log)
    failed = code != 0 or any(run["exit_code"] for run in result["runs"].values())
    result["env"] = environment()
    result["comparison"] = compare(result["runs"], args.floor) if not failed else {"cp_within_spread": None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not failed:
        plot(result["runs"], result["comparison"], args.out.with_suffix(".png"),
             f"{'CPU smoke' if args.smoke else 'GPT-2 small, 16K tokens'}: context parallel {args.context} vs one "
             f"{'process' if args.smoke else 'GPU'} ({result['env']['device_name']})")
    comparison = result["comparison"]
    if comparison.get("spread"):
        print(f"mean / max |CP - A| {comparison['cp_vs_a']['mean']:.3e} / {comparison['cp_vs_a']['max']:.3e}; "
              f"one-GPU pairs' mean |difference| {', '.join(f'{m:.3e}' for m in comparison['spread']['pair_means'])}"
              f"; threshold {comparison['threshold']:.3e}; CP within spread: {comparison['cp_within_spread']}")
    for label, run in result["runs"].items():
        print(f"{label}: {run['steps']} steps, {run['tokens_per_s'] or 0:,.0f} tokens/s, "
              f"peak GiB per GPU {run['peak_memory_gib_per_gpu']}")
    print(f"wrote {args.out}" + ("" if failed else f" and {args.out.with_suffix('.png')}"))
    return 0 if comparison.get("cp_within_spread") else 1


if __name__ == "__main__":
    sys.exit(main())
