"""RUN_DIR/hf/: what a run keeps so that its model can be used without flashtrain's config, written by the trainer at
the start of a run and read by flashtrain.export and flashtrain.generate: the data's tokenizer as a transformers fast
tokenizer and the model's transformers config.json (`save_model_files`). Models without a transformers counterpart
(no Hugging Face adapter, flashtrain.models.hf_convert: the LRA classifier) keep nothing there.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashtrain.models.hf_convert import has_hf_adapter, hf_adapter

HF_FILES = "hf"  # the directory's name in a run directory


def hf_tokenizer_of(model: torch.nn.Module, task):
    """The task's tokenizer as a transformers fast tokenizer, its model_max_length the model's longest input."""
    tokenizer = task.hf_tokenizer()
    if tokenizer is None:
        raise ValueError(f"{type(model).__name__} has a transformers counterpart but its data ({type(task).__name__}) "
                         "has no tokenizer to go with it")
    tokenizer.model_max_length = hf_adapter(type(model)).max_length(model.config)
    return tokenizer


def save_model_files(model: torch.nn.Module, task, run_dir: Path) -> Path | None:
    """RUN_DIR/hf/: the run's tokenizer (a transformers fast tokenizer) and its transformers config.json, so that the
    model can be used without flashtrain's config; returns that directory. Models without a transformers counterpart
    (no Hugging Face adapter: the LRA classifier): nothing, None. The trainer calls it once at the start of a run, on
    the main process."""
    if not has_hf_adapter(type(model)):
        return None
    out_dir = Path(run_dir) / HF_FILES
    tokenizer = hf_tokenizer_of(model, task)
    tokenizer.save_pretrained(out_dir)
    hf_adapter(type(model)).config_to_hf(model.config, tokenizer).save_pretrained(out_dir)
    return out_dir
