"""Suite-wide settings: offline Hugging Face, no wandb network, CUDA tests skipped (not faked) without a GPU."""

import importlib
import os
import pathlib

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


PROBES = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "probes"


@pytest.fixture
def import_probe(monkeypatch):
    """import_probe(name): the module `name` of benchmarks/probes, with that folder and benchmarks/ on sys.path for
    this test (the probes import each other and the benchmarks by plain name)."""
    def load(name: str):
        monkeypatch.syspath_prepend(str(PROBES.parent))
        monkeypatch.syspath_prepend(str(PROBES))
        return importlib.import_module(name)
    return load
