"""On-disk caches of prepared data: a directory is built under a temporary name and published by one rename."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished directory (complete once it holds meta.json) into place; if another process got there
    first, keep theirs."""
    if final_dir.exists() and not (final_dir / "meta.json").is_file():
        shutil.rmtree(final_dir)  # incomplete and not ours: only an interrupted copy by hand could leave this
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not (final_dir / "meta.json").is_file():
            raise
        shutil.rmtree(tmp_dir)
