"""The shape the package's structural clean-up left it in, kept: no block of six or more identical lines repeated
across flashtrain/'s Python sources, no function in flashtrain/train/ longer than 60 lines, no dispatch on
`isinstance(..., SomeConfig)`."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashtrain"
BLOCK = 6  # lines
MAX_TRAIN_FUNCTION = 60  # lines, decorators and docstring included


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text without surrounding white space) of the lines that are code: blank lines, comment lines
    and imports (the same names imported in two modules are not repeated logic) left out."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if text and not text.startswith("#") and not re.match(r"(from \S+ )?import ", text):
            lines.append((number, text))
    return lines


def repeated_blocks(root: Path, size: int) -> list[tuple[str, str]]:
    """Pairs of places ("file:line", relative to `root`) in `root`'s Python files that start the same `size`
    consecutive code lines; a run of repeated lines is reported once, at its first window."""
    first_seen, matched, pairs = {}, set(), []
    for path in sorted(root.rglob("*.py")):
        lines = code_lines(path)
        for start in range(len(lines) - size + 1):
            window = tuple(text for _, text in lines[start:start + size])
            if all(len(text) <= 3 for text in window):  # closing brackets and the like
                continue
            if window not in first_seen:
                first_seen[window] = (path, start, lines[start][0])
                continue
            earlier_path, earlier_start, earlier_line = first_seen[window]
            if (earlier_path, earlier_start - 1, path, start - 1) not in matched:  # not a run already reported
                pairs.append((f"{earlier_path.relative_to(root)}:{earlier_line}",
                              f"{path.relative_to(root)}:{lines[start][0]}"))
            matched.add((earlier_path, earlier_start, path, start))
    return pairs


def test_no_six_identical_lines_repeated_in_the_package():
    pairs = repeated_blocks(PACKAGE, BLOCK)
    assert pairs == [], "\n".join(f"{a} == {b}" for a, b in pairs)


def test_the_check_finds_a_repeated_block(tmp_path):
    body = "".join(f"    total = total + {i} * value  # step {i}\n" for i in range(BLOCK))
    (tmp_path / "a.py").write_text(f"def f(value):\n    total = 0\n{body}    return total\n")
    (tmp_path / "b.py").write_text(f"import os\n\n\ndef g(value):\n    total = 1\n{body}    return -total\n")
    assert repeated_blocks(tmp_path, BLOCK) == [("a.py:3", "b.py:6")]
    assert repeated_blocks(tmp_path, BLOCK + 1) == []  # the lines around the bodies differ


def test_train_functions_are_short():
    long = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_TRAIN_FUNCTION:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - start + 1} lines")
    assert long == []


def test_no_dispatch_on_config_classes():
    """`grep -rn "isinstance(.*Config" flashtrain/` finds nothing: models, data and their Hugging Face adapters are
    chosen by what a config builds and by registries, not by type tests in the trainer, loaders or export."""
    hits = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), start=1)
            if re.search(r"isinstance\(.*Config", line)]
    assert hits == []
