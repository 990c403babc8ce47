"""A short ListOps run with each attention variant of the LRA encoder, through `python launch.py recipe=listops
model/attention=NAME` as a user starts it: does every variant train on this machine, how fast, how much memory.

Each run is a real launch.py process (Hydra, the trainer, the generated ListOps data, evaluation, checkpoint, test
split) on a smaller split of the data (--n-train sequences, shared by the runs through one cache directory) for
--steps steps; the run's metrics.jsonl gives the numbers. Short runs show that a variant works and its speed, not its
accuracy (the recipe needs 5,000 steps for that; see recipes/listops.yaml).

    python benchmarks/listops_variants.py --out $OUT                 # every preset of conf/model/attention/
    python benchmarks/listops_variants.py --variants dense linformer --steps 50 --out /tmp/lv
Writes OUT/listops_variants-<gpu>.json and a PNG beside it (tokens/s and peak memory per variant).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_zoo import device_tag  # noqa: E402  ("h200" of "NVIDIA H200")

PRESETS = sorted(p.stem for p in (ROOT / "conf" / "model" / "attention").glob("*.yaml"))


def run_variant(name: str, args, run_dir: Path, cache_dir: Path) -> dict:
    overrides = [
        "recipe=listops", f"model/attention={name}", "logger=none", f"name=listops-{name}",
        f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}", f"data.n_train={args.n_train}",
        f"data.n_val={args.n_eval}", f"data.n_test={args.n_eval}", f"trainer.max_steps={args.steps}",
        f"trainer.log_interval={max(1, args.steps // 10)}", f"trainer.eval_interval={args.steps}",
        f"trainer.save_interval={args.steps}", *args.override]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    row = {"variant": name, "returncode": proc.returncode, "wall_s": round(time.perf_counter() - start, 1)}
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if proc.returncode != 0 or not records:
        row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return row
    train = [r for r in records if "train_loss" in r]
    rates = [r["tokens_per_s"] for r in train[1:] or train if "tokens_per_s" in r]  # the first interval compiles
    last = lambda key: next((r[key] for r in reversed(records) if key in r), None)  # noqa: E731
    row |= {"steps": last("step"), "first_train_loss": train[0]["train_loss"] if train else None,
            "train_loss": last("train_loss"), "val_accuracy": last("val_accuracy"),
            "test_accuracy": last("test_accuracy"), "tokens_per_s": statistics.median(rates) if rates else None,
            "peak_memory_gib": last("peak_memory_gib")}
    return row


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("tokens_per_s")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["tokens_per_s"] / 1e3 for r in rows])
    axes[0].set_ylabel("training tokens/s (thousands)")
    axes[1].bar(names, [r["peak_memory_gib"] or 0 for r in rows])
    axes[1].set_ylabel("peak memory (GiB)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    env = result["env"]
    fig.suptitle(f"ListOps, {result['config']['steps']} steps per variant: {env['gpu']}, torch {env['torch']}, "
                 f"{env['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n-train", type=int, default=8000)
    parser.add_argument("--n-eval", type=int, default=500)
    parser.add_argument("--override", nargs="*", default=[], help="more launch.py overrides for every run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache_dir = args.out / "listops-data"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    env = {"gpu": gpu, "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = []
    for name in args.variants:
        rows.append(run_variant(name, args, args.out / "runs" / name, cache_dir))
        print(json.dumps(rows[-1]), flush=True)
    result = {"env": env, "config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "rows": rows}
    path = args.out / f"listops_variants-{device_tag(env)}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}; failed: {[r['variant'] for r in rows if r['returncode'] != 0] or 'none'}")
    return path


if __name__ == "__main__":
    main()
