"""docs/results.md is generated from benchmarks/results/*.json by benchmarks/results_doc.py: the committed file must
be what the script writes now (run `python benchmarks/results_doc.py` after adding or changing a result JSON)."""

import importlib.util
import json
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


def test_superseded_record_points_to_its_successor(tmp_path, monkeypatch):
    """A record with `superseded_by` renders as one line that links the newer record (its table only in the JSON)."""
    module = _results_doc()
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    old = {"env": {"gpu": "X", "date": "2026-01-01"}, "rows": [{"a": 1.5}], "superseded_by": "speed-new.json"}
    new = {"env": {"gpu": "X", "date": "2026-02-01"}, "rows": [{"a": 2.5}]}
    (tmp_path / "speed-old.json").write_text(json.dumps(old))
    (tmp_path / "speed-new.json").write_text(json.dumps(new))
    text = module.render()
    old_section = text.split("## speed-old\n")[1]
    assert old_section.strip().splitlines() == [
        "Source: [speed-old.json](../benchmarks/results/speed-old.json). Superseded by "
        "[speed-new.json](#speed-new) (this record: 2026-01-01); its numbers stay in the JSON."]
    assert "| 2.5 |" in text.split("## speed-new\n")[1].split("## ")[0] and "| 1.5 |" not in text
