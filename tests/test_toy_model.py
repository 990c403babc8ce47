"""Adding a model is one file and one config file: a model defined under tests/ trains through launch.py, with no
edit to the trainer, the tasks or the weight loader."""

import os
import subprocess
import sys
from pathlib import Path

from flashtrain.train.trainer import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_toy_model_trains_through_launch(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "FLASHTRAIN_PLUGINS": "toy_model", "PYTHONPATH": str(ROOT / "tests"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    overrides = ["hydra.searchpath=[file://tests/conf]", "model=toy", "logger=none", "name=toy",
                 "data.max_bytes=300000", "data.val_fraction=0.1", "data.vocab_size=512", "data.num_proc=1",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.sample_tokens=0", "trainer.micro_batch_size=8",
                 "trainer.max_steps=30", "trainer.log_interval=5", "trainer.eval_interval=15",
                 "data.val_samples=32", "trainer.save_interval=30", "optim.lr=3e-3", "optim.warmup_steps=5",
                 f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "launch.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model: ToyConfig" in proc.stdout and "attention: flash -> reference" in proc.stdout
    records = read_metrics(run_dir / "metrics.jsonl")
    ppl = [r["val_ppl"] for r in records if "val_ppl" in r]
    assert [r["step"] for r in records if "val_ppl" in r] == [0, 15, 30]
    assert ppl[0] > 400 and ppl[-1] < 0.5 * ppl[0], ppl  # from about the vocabulary size (512) to well below
    assert (run_dir / "checkpoints" / "step_00000030" / "model.safetensors").is_file()
