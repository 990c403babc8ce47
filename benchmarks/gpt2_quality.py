"""Training-quality evidence for GPT-2 small at long context: same tokens at 1K and 4K context, and the
same runs with attention through PyTorch SDPA instead of the flashtrain kernel.

Each run is a real `launch.py` run of the gpt2-small-1k / gpt2-small-4k recipes on a local corpus (this Python's
standard library, BPE 8192, no download), shortened to a fixed token budget: every optimizer step sees the same
number of tokens at both contexts (1K: 16 x 1024 x 2 micro-batches; 4K: 4 x 4096 x 2), and every validation pass
scores the same number of tokens (8 micro-batches: 131K tokens of the same held-out documents, cut into blocks of
the run's context).

    python benchmarks/gpt2_quality.py --out results/ [--steps 400]

Writes <out>/gpt2_quality.json (per run: validation perplexity by tokens seen, final numbers; flash vs sdpa: the
largest train-loss difference at equal steps) and <out>/gpt2_quality.png (train loss and validation perplexity of
every run against tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashtrain.train.metrics import plot_curves  # noqa: E402
from flashtrain.train.trainer import read_metrics  # noqa: E402

# (label, recipe, micro-batch, extra overrides): 32K tokens per optimizer step in every run
RUNS = (
    ("1K flash", "gpt2-small-1k", 16, ()),
    ("4K flash", "gpt2-small-4k", 4, ()),
    ("1K sdpa", "gpt2-small-1k", 16, ("model.attn_impl=sdpa",)),
    ("4K sdpa", "gpt2-small-4k", 4, ("model.attn_impl=sdpa",)),
)


def run(label: str, recipe: str, micro_batch: int, extra: tuple[str, ...], args, run_dir: Path) -> list[dict]:
    overrides = [
        f"recipe={recipe}", "data=stdlib", f"data.max_bytes={args.max_bytes}", "logger=none", f"name={recipe}-quality",
        f"hydra.run.dir={run_dir}", f"trainer.max_steps={args.steps}", f"trainer.micro_batch_size={micro_batch}",
        f"trainer.global_batch_size={2 * micro_batch}", f"optim.warmup_steps={max(args.steps // 10, 1)}",
        f"trainer.eval_interval={args.eval_interval}", f"data.val_samples={8 * micro_batch}",  # 128K tokens each
        f"trainer.save_interval={args.steps}", "trainer.log_interval=10", "data.sample_tokens=0", *extra, *args.extra,
    ]
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "launch.py"), *overrides], check=True, cwd=REPO)
    print(f"{label}: {time.perf_counter() - start:.0f} s", flush=True)
    return read_metrics(run_dir / "metrics.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gpt2_quality.json / .png")
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/gpt2_quality"), help="where the runs write")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run (32K tokens each)")
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--max-bytes", type=int, default=0, help="corpus cap (0: the whole standard library)")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run (smoke tests)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    histories = {}
    for label, recipe, micro_batch, extra in RUNS:
        histories[label] = run(label, recipe, micro_batch, extra, args, args.runs_dir / label.replace(" ", "_"))

    def curve(records, key):
        return [(r["step"], r["tokens"], r[key]) for r in records if key in r]

    def flash_vs_sdpa(context: str) -> dict:
        """Train losses of the flash and sdpa runs at the same steps (same seed, same data order)."""
        flash, sdpa = curve(histories[f"{context} flash"], "train_loss"), curve(histories[f"{context} sdpa"], "train_loss")
        diffs = [abs(a[2] - b[2]) for a, b in zip(flash, sdpa) if a[0] == b[0]]
        final = [curve(histories[f"{context} {impl}"], "val_ppl")[-1][2] for impl in ("flash", "sdpa")]
        return {"max_abs_train_loss_diff": max(diffs), "mean_abs_train_loss_diff": sum(diffs) / len(diffs),
                "steps_compared": len(diffs), "final_val_ppl_flash": final[0], "final_val_ppl_sdpa": final[1]}

    summary = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "corpus": "stdlib (all of it), BPE 8192", "tokens_per_step": 32768, "steps": args.steps,
        "runs": {label: {"val_ppl": curve(records, "val_ppl"), "final_val_ppl": curve(records, "val_ppl")[-1][2],
                         "tokens_per_s": [r["tokens_per_s"] for r in records if "tokens_per_s" in r][-1]}
                 for label, records in histories.items()},
        "flash_vs_sdpa": {context: flash_vs_sdpa(context) for context in ("1K", "4K")},
    }
    (args.out / "gpt2_quality.json").write_text(json.dumps(summary, indent=1))
    plot_curves(histories, args.out / "gpt2_quality.png")
    for label, info in summary["runs"].items():
        print(f"{label:>9}: final val ppl {info['final_val_ppl']:.2f}, {info['tokens_per_s']:,.0f} tok/s")
    print("flash vs sdpa:", summary["flash_vs_sdpa"])


if __name__ == "__main__":
    main()
