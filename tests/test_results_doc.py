"""docs/results.md is generated from benchmarks/results/*.json by benchmarks/results_doc.py: the committed file must
be what the script writes now (run `python benchmarks/results_doc.py` after adding or changing a result JSON)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _results_doc():
    spec = importlib.util.spec_from_file_location("results_doc", ROOT / "benchmarks" / "results_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_doc_is_current():
    module = _results_doc()
    assert (ROOT / "docs" / "results.md").read_text() == module.render(), (
        "docs/results.md is stale: run python benchmarks/results_doc.py")


def test_results_doc_covers_every_json_and_stays_short():
    text = (ROOT / "docs" / "results.md").read_text()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f"## {path.stem}\n" in text
    assert text.count("\n") <= 600
