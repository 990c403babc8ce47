"""README's promise about the default run is the measured one: its minutes and final validation perplexity are those
of the committed record benchmarks/results/default_run-cpu.json (written by benchmarks/default_run.py --cold)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "default_run-cpu.json"


def test_readme_quotes_the_measured_default_run():
    record = json.loads(RECORD.read_text())
    assert record["cold_data_cache"] and record["steps"] == 1000 and record["machine"]["cores"] == 2
    readme = ROOT.joinpath("README.md").read_text()
    minutes = re.search(r"On a 2-core CPU the whole run takes about ([\d.]+) minutes", readme)
    ppl = re.search(r"validation\s+perplexity falling \(to about ([\d.]+)\)", readme)
    assert minutes and ppl, "README's paragraph on the default run lost its numbers"
    # the README rounds the record's wall time to the nearest half minute and its perplexity to the nearest unit
    assert float(minutes.group(1)) == round(record["wall_minutes"] * 2) / 2
    assert float(ppl.group(1)) == round(record["final_val_ppl"])


def test_the_recipe_comment_says_what_the_record_says():
    record = json.loads(RECORD.read_text())
    recipe = ROOT.joinpath("recipes", "gpt2-tiny-stdlib.yaml").read_text()
    minutes = re.search(r"about ([\d.]+) minutes on a 2-core CPU", recipe)
    assert minutes and float(minutes.group(1)) == round(record["wall_minutes"] * 2) / 2
