"""Write docs/results.md from the benchmark records in benchmarks/results/*.json.

    python benchmarks/results_doc.py           # (re)write docs/results.md
    python benchmarks/results_doc.py --check   # exit 1 if docs/results.md is not what this script writes now

Each JSON gets a section: its metadata (the `env` dict, or the top-level scalar fields: device, torch, date, ...) and
one compact table of its main numbers, flattened generically from its `rows` list (or `runs` dict, or the first list
or dict of records). A record with a `superseded_by` field (the file name of a newer record of the same measurement)
gets one line pointing there. Columns are the scalar fields (nested ones dotted, lists left out), at most MAX_COLUMNS
of them; a file whose shape gives no table gets its metadata and links only. Numbers in docs come from here, not by
hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"
MAX_COLUMNS = 12
MAX_ROWS = 4  # (the page holds every record within 600 lines; the JSON holds every row)
MAX_TEXT = 100
TABLE_KEYS = ("table", "rows", "runs", "summary", "speed", "host", "calls")  # in order of preference


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value).replace("|", "/").replace("\n", " ")
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def _series(value) -> bool:
    return (isinstance(value, dict) and len(value) > 8 and all(_scalar(v) for v in value.values())
            and all(str(k).replace(".", "", 1).isdigit() for k in value))


def _flatten(record, prefix: str = "", depth: int = 0) -> dict:
    """Scalar leaves of a record, nested dict keys joined by dots (three levels), a per-step series by its last value,
    lists and deeper levels left out."""
    out = {}
    if not isinstance(record, dict):
        return {prefix or "value": record} if _scalar(record) else {}
    for key, value in record.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if _scalar(value):
            out[name] = value
        elif _series(value):  # a per-step series ({"1": loss, "2": ...}): its last value
            out[f"{name}.last"] = value[max(value, key=float)]
        elif isinstance(value, dict) and depth < 2:
            out.update(_flatten(value, name, depth + 1))
    return out


def _records(data) -> tuple[str, list[dict]] | None:
    """(what the table is, its rows as flat dicts) of a JSON's main numbers, or None."""
    candidates = []
    if isinstance(data, list):
        candidates.append(("rows", data))
    elif isinstance(data, dict):
        candidates += [(key, data[key]) for key in TABLE_KEYS if key in data]
        candidates += [(key, value) for key, value in data.items() if key not in TABLE_KEYS and key != "env"
                       and isinstance(value, (list, dict)) and value]
    for key, value in candidates:
        if isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
            rows = [_flatten(row) for row in value]
        elif isinstance(value, dict) and value and all(isinstance(row, dict) for row in value.values()):
            rows = [{"name": name, **_flatten(row)} for name, row in value.items()]
        else:
            continue
        if any(rows):
            return key, rows
    return None


def _columns(rows: list[dict]) -> tuple[list[str], int]:
    """Columns in first-seen order, a time in ms dropped where the same measure exists as a rate; the identifying
    (non-float) columns first; at most MAX_COLUMNS. Returns them and how many were left out."""
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    names = [k for k in seen if not (k.endswith("_ms") and k[:-3] in seen)]
    names = [k for k in names if any(row.get(k) not in (None, "", [], {}) for row in rows)]
    ident = [k for k in names if not any(isinstance(row.get(k), float) for row in rows)]
    numbers = [k for k in names if k not in ident]
    ordered = ident[:MAX_COLUMNS // 2] + numbers + ident[MAX_COLUMNS // 2:]
    return ordered[:MAX_COLUMNS], max(0, len(ordered) - MAX_COLUMNS)


def _metadata(data) -> list[tuple[str, str]]:
    if isinstance(data, list):
        keys = ("device", "torch", "date")
        first = data[0] if data and isinstance(data[0], dict) else {}
        return [(k, _cell(first[k])) for k in keys if k in first]
    source = data.get("env") if isinstance(data.get("env"), dict) else data
    meta = [(k, _cell(v)) for k, v in source.items() if _scalar(v) and v is not None]
    if source is not data:
        meta += [(k, _cell(v)) for k, v in data.items() if _scalar(v) and v is not None]
    return meta


def _section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lines = [f"## {path.stem}"]  # (the source line follows the heading directly: one line less per record)
    links = [f"[{path.name}](../benchmarks/results/{path.name})"]
    links += [f"[{png.name}](../benchmarks/results/{png.name})" for png in sorted(RESULTS.glob(f"{path.stem}*.png"))
              if png.stem == path.stem or png.stem[len(path.stem):].startswith("-")
              and not (RESULTS / f"{png.stem}.json").exists()]
    head = "Source: " + ", ".join(links) + "."
    successor = data.get("superseded_by") if isinstance(data, dict) else None
    if successor:  # an older record of the same measurement: its successor's section has the table (one line, and
        # no blank line after it: the next heading ends the paragraph)
        env = data.get("env")
        date = (env if isinstance(env, dict) else data).get("date")
        return lines + [f"{head} Superseded by [{successor}](#{Path(successor).stem.lower()})"
                        + (f" (this record: {date})" if date else "") + "; its numbers stay in the JSON."]
    meta = _metadata(data)
    if meta:
        head += " " + "; ".join(f"{k}: {v}" for k, v in meta) + "."
    table = _records(data)
    if table is None:  # (no blank line after it, nor after a table: the next heading ends either)
        return lines + [head + " (No table: see the JSON.)"]
    key, rows = table
    latest = key == "runs"  # (a log of runs, oldest first: the page shows the latest)
    shown = rows[-MAX_ROWS:] if latest else rows[:MAX_ROWS]
    columns, left_out = _columns(rows)
    head += (f" Table: `{key}`" + (f", {'last' if latest else 'first'} {MAX_ROWS} of {len(rows)} rows"
                                   if len(rows) > MAX_ROWS else "")
             + (f", {left_out} more columns in the JSON" if left_out else "") + ".")
    lines += [head, ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in shown:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return lines


def render() -> str:
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/results_doc.py` from `benchmarks/results/*.json`; do not edit by hand "
             "(`python benchmarks/results_doc.py --check` and tests/test_results_doc.py fail when this file is stale).",
             "Each section: a record's metadata and a compact table of its main numbers (the JSON has every field); "
             "the benchmark script of the same name in `benchmarks/` produces the record.", ""]
    for path in sorted(RESULTS.glob("*.json")):
        lines += _section(path)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is not current: run python benchmarks/results_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
