"""The default run as a newcomer starts it: `python launch.py`, timed end to end, on whatever machine runs this.

    python benchmarks/default_run.py [--cold] [--out benchmarks/results/default_run-cpu.json]

Runs `python launch.py logger=none` (wandb's offline writer left out: it times the training, not the tracker) in a
fresh run directory and records the wall time of the whole command, the time to the first training step, the steps
done, the final validation perplexity and the tokens/s of the last log line, with the machine (CPU model, cores, torch
threads), torch version and date. --cold starts from an empty data cache (FLASHTRAIN_CACHE_DIR in a temporary
directory): the corpus is read, the BPE trained and the token file written first, as on a first run.

README's "The two commands" quotes this record (minutes, val ppl); tests/test_readme_numbers.py checks that the
README says what the committed record says.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "default_run-cpu.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(cold: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if cold:
            env["FLASHTRAIN_CACHE_DIR"] = str(Path(tmp) / "cache")
        run_dir = Path(tmp) / "run"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "launch.py", "logger=none", f"hydra.run.dir={run_dir}"], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        wall_s = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"python launch.py failed (exit status {proc.returncode}):\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_ppl" in r]
    return {
        "wall_s": round(wall_s, 1),
        "wall_minutes": round(wall_s / 60, 2),
        "steps": train[-1]["step"],
        "final_val_ppl": round(val[-1]["val_ppl"], 2),
        "final_train_loss": round(train[-1]["train_loss"], 4),
        "tokens_per_s_last_log": round(train[-1]["tokens_per_s"], 1),
        "cold_data_cache": cold,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="start from an empty data cache (a first run)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    result = run(args.cold)
    record = {
        "what": "python launch.py (the default recipe, gpt2-tiny-stdlib), end to end, logger=none",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "torch": torch.__version__,
        "python": platform.python_version(),
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
