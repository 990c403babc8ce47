"""Starting weights for a run: a flashtrain checkpoint or a Hugging Face model, extended to longer context if needed.

`init_from` forms:
    PATH            a checkpoint directory (checkpoints/step_XXXXXXXX) or a run directory (its newest checkpoint)
    hf:NAME_OR_PATH a Hugging Face GPT2LMHeadModel (a local directory, or a Hub name when online)
When the source has fewer positions than the configured model, its position table is extended with
`flashtrain.models.position.extend_position_embeddings` (method "repeat" or "interpolate") before loading, so a
4K-context run can start from a 1K checkpoint or from GPT-2 itself. Optimizer state and step are NOT taken over:
this is a new run initialised from those weights (use `resume=` to continue a run).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models.position import extend_position_embeddings
from flashtrain.train.checkpoint import CHECKPOINT_PREFIX, latest_checkpoint

_POSITIONS_KEY = "transformer.wpe.weight"
_TIED_KEY = "lm_head.weight"  # saved once, as the token embedding


def _source_model(init_from: str, model_cfg: GPT2Config) -> GPT2:
    """The source weights as a GPT2 of the configured shape except for its own number of positions."""
    if init_from.startswith("hf:"):
        from transformers import GPT2LMHeadModel

        hf_model = GPT2LMHeadModel.from_pretrained(init_from[len("hf:"):])
        source = GPT2(replace(model_cfg, n_positions=hf_model.config.n_positions))
        source.load_hf_state_dict(hf_model.state_dict())
        return source
    path = Path(init_from).expanduser()
    ckpt = path if path.name.startswith(CHECKPOINT_PREFIX) else latest_checkpoint(path)
    if ckpt is None or not (ckpt / "model.safetensors").is_file():
        raise FileNotFoundError(f"init_from={init_from!r}: no checkpoint with model.safetensors found")
    state = load_file(str(ckpt / "model.safetensors"))
    source = GPT2(replace(model_cfg, n_positions=state[_POSITIONS_KEY].shape[0]))
    missing, unexpected = source.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {_TIED_KEY}:
        raise ValueError(f"init_from={init_from!r} does not fit model config {model_cfg}: missing {missing}, "
                         f"unexpected {unexpected}")
    return source


def load_initial_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str) -> str:
    """Copy the weights named by `init_from` into `model`; returns a one-line description of what was done."""
    if not isinstance(model, GPT2):
        raise TypeError(f"init_from: supported for GPT2 models, not {type(model).__name__}")
    source = _source_model(init_from, model_cfg)
    n_source = source.config.n_positions
    if n_source > model_cfg.n_positions:
        raise ValueError(f"init_from={init_from!r} has {n_source} positions, more than "
                         f"model.n_positions={model_cfg.n_positions}")
    note = f"initialised from {init_from}"
    if n_source < model_cfg.n_positions:
        extend_position_embeddings(source, model_cfg.n_positions, method=position_extension)
        note += f", positions extended {n_source} -> {model_cfg.n_positions} ({position_extension})"
    model.load_state_dict(source.state_dict())
    return note
