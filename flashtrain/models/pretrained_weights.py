"""Starting weights from a flashtrain checkpoint or a Hugging Face model, for a model's `load_pretrained(init_from,
position_extension)` (flashtrain.train.model_init calls it): the readers every model uses (`checkpoint_weights`,
`load_hf_weights`, `fit_positions`) and the loaders of GPT2, the BERT/RoBERTa heads and LRAClassifier.

It imports no model: the models import it and pass in the classes a loader builds, and the Hugging Face adapters
come from the registry (flashtrain.models.hf_adapters; flashtrain.models' __init__ imports hf_convert, which
registers GPT-2's and BERT/RoBERTa's)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from flashtrain.models.hf_adapters import from_pretrained_hf, hf_adapter, load_hf_state_dict
from flashtrain.models.position import extend_position_embeddings, upsample_positions_2d
from flashtrain.pretrained import resolve_pretrained_path

_POSITIONS_KEY = "transformer.wpe.weight"


def checkpoint_weights(init_from: str) -> tuple[Path, dict]:
    """(checkpoint directory, model state dict) of a checkpoint, a run directory (its newest intact checkpoint) or a
    directory of runs such as runs/path64 (the newest intact checkpoint of its newest run), verified as resume does
    (`intact_checkpoint`: each damaged checkpoint skipped is named in a warning; a damaged one named explicitly, or
    none intact, stops with a DamagedCheckpointError naming the file). For every model's loader, a model's own
    load_pretrained included."""
    # here, not at the top: flashtrain.train's __init__ imports the trainer, whose model_init imports this module
    from flashtrain.train.checkpoint import model_state, resolve_init_from

    ckpt = resolve_init_from(init_from)  # a run's start verified it already: that checkpoint, not hashed again
    if ckpt is None:
        raise FileNotFoundError(f"init_from={init_from!r}: no checkpoint found")
    return ckpt, model_state(ckpt)


def fit_positions(source: torch.nn.Module, init_from: str, n_source: int, n_model: int, field: str,
                  position_extension: str) -> str:
    """Extend `source`'s position table to the model's n_model inputs (an error if it has more); returns the note."""
    if n_source > n_model:
        raise ValueError(f"init_from={init_from!r} takes {n_source} positions, more than {field}={n_model}")
    note = f"initialised from {init_from}"
    if n_source < n_model:
        extend_position_embeddings(source, n_model, method=position_extension)
        note += f", positions extended {n_source} -> {n_model} ({position_extension})"
    return note


def load_hf_weights(model: torch.nn.Module, init_from: str, position_extension: str) -> str:
    """init_from=hf:NAME_OR_PATH into a model with a registered Hugging Face adapter: read with the adapter's Auto
    class (`hf:pkg:MODULE/SUBDIR`: an installed package's directory), converted by its from_hf, a shorter position
    table (the adapter's max_length) extended by the model's `extend_positions(new_max, method)`, then loaded strictly
    (every other tensor has the run's shape). Returns the note. A model's own load_pretrained may call it."""
    import transformers

    model_class = type(model)
    adapter = hf_adapter(model_class)
    hf_class = getattr(transformers, adapter.auto_class)
    hf_model = hf_class.from_pretrained(resolve_pretrained_path(init_from[len("hf:"):]), dtype=torch.float32)
    source = from_pretrained_hf(model_class, hf_model, attn_impl=getattr(model.config, "attn_impl", "flash"))
    note = fit_positions(source, init_from, adapter.max_length(source.config), adapter.max_length(model.config),
                         f"{model_class.__name__}'s max length", position_extension)
    model.load_state_dict(source.state_dict())
    return note


def _source_model(init_from: str, model_cfg, model_class: type) -> torch.nn.Module:
    """The source weights as a `model_class` (GPT2) of the configured shape except for its own number of positions."""
    if init_from.startswith("hf:"):
        from transformers import GPT2LMHeadModel

        hf_model = GPT2LMHeadModel.from_pretrained(init_from[len("hf:"):])
        source = model_class(replace(model_cfg, n_positions=hf_model.config.n_positions))
        return load_hf_state_dict(source, hf_model.state_dict())
    ckpt, state = checkpoint_weights(init_from)
    source = model_class(replace(model_cfg, n_positions=state[_POSITIONS_KEY].shape[0]))
    missing, unexpected = source.load_state_dict(state, strict=False)  # the tied lm_head comes with wte
    if missing or unexpected:
        raise ValueError(f"init_from={init_from!r} does not fit model config {model_cfg}: missing {missing}, "
                         f"unexpected {unexpected}")
    return source


def load_gpt2_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str,
                      model_class: type) -> str:
    """GPT2.load_pretrained: hf:NAME_OR_PATH (a transformers GPT2LMHeadModel) or a flashtrain checkpoint / run
    directory, its position table extended to model_cfg.n_positions; the source is built as model_class (GPT2)."""
    source = _source_model(init_from, model_cfg, model_class)
    note = fit_positions(source, init_from, source.config.n_positions, model_cfg.n_positions, "model.n_positions",
                         position_extension)
    model.load_state_dict(source.state_dict())
    return note


def load_lra_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str) -> str:
    """LRAClassifier.load_pretrained: a flashtrain LRA checkpoint into `model`: a checkpoint, a run directory (its
    newest intact checkpoint) or a directory of runs such as runs/path64 (the newest intact checkpoint of its newest
    run); verified (`checkpoint_weights`), an error when none is intact. Learned positions
    of a square image grid smaller than the model's (Path-64 -> Path-X / Path-256) are upsampled in 2D, each pretrained
    position a k x k block."""
    ckpt, state = checkpoint_weights(init_from)
    note = f"initialised from {ckpt}"
    source_positions = state.get("pos_emb.weight")
    if model.pos_emb is not None and source_positions is not None and \
            source_positions.shape[0] != model.pos_emb.weight.shape[0]:
        n_prefix = int(model.config.pooling == "cls")  # the CLS token's row comes first
        source_side = math.isqrt(source_positions.shape[0] - n_prefix)
        side = math.isqrt(model.config.max_len - n_prefix)
        if source_side ** 2 + n_prefix != source_positions.shape[0] or side ** 2 + n_prefix != model.config.max_len \
                or side % source_side:
            raise ValueError(f"init_from={init_from!r}: its {source_positions.shape[0]} positions and "
                             f"model.max_len={model.config.max_len} are not square image grids (plus {n_prefix} CLS "
                             f"row) with the new side a multiple of the old")
        factor = side // source_side
        state["pos_emb.weight"] = upsample_positions_2d(source_positions, source_side, source_side, factor, n_prefix)
        note += f", positions upsampled in 2D {source_side}x{source_side} -> {side}x{side} ({factor}x{factor} blocks)"
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"init_from={init_from!r} does not fit model config {model.config}: missing {missing}, "
                         f"unexpected {unexpected}")
    return note


# Fields of the source checkpoint's config that must equal the run's model config (dropouts, heads may differ).
_BERT_SHAPE_FIELDS = ("flavor", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "type_vocab_size", "pad_token_id", "layer_norm_eps")


def load_bert_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str, encoder_class: type,
                      masked_lm_class: type) -> str:
    """BertForMaskedLM / BertForSequenceClassification.load_pretrained: a Hugging Face BERT/RoBERTa checkpoint into
    `model`: the encoder always, the masked-LM head for BertForMaskedLM; positions extended when model_cfg takes
    longer inputs than the checkpoint. The source is built as encoder_class (BertModel) or, for the masked-LM head,
    masked_lm_class (BertForMaskedLM), through their Hugging Face adapters."""
    if not init_from.startswith("hf:"):
        raise ValueError(f"init_from={init_from!r}: BERT/RoBERTa models start from hf:NAME_OR_PATH (a Hugging Face "
                         "checkpoint); to continue a flashtrain run use resume=")
    import transformers

    path = resolve_pretrained_path(init_from[len("hf:"):])
    is_mlm = model_cfg.head == "masked_lm"
    hf_class = transformers.AutoModelForMaskedLM if is_mlm else transformers.AutoModel
    hf_model = hf_class.from_pretrained(path, dtype=torch.float32)
    source_cfg = hf_adapter(encoder_class).config_from_hf(hf_model.config, model_cfg.attn_impl)
    for name in _BERT_SHAPE_FIELDS:
        if getattr(source_cfg, name) != getattr(model_cfg, name):
            raise ValueError(f"init_from={init_from!r} has {name}={getattr(source_cfg, name)!r}, the run's "
                             f"model.{name}={getattr(model_cfg, name)!r}")
    source = from_pretrained_hf(masked_lm_class if is_mlm else encoder_class, hf_model, attn_impl=model_cfg.attn_impl)
    note = fit_positions(source, init_from, source_cfg.max_seqlen, model_cfg.max_seqlen, "model.max_length",
                          position_extension)
    if is_mlm:
        model.load_state_dict(source.state_dict())
        return note
    # classification: the encoder, and BERT's pooler when the checkpoint has one (RoBERTa's head uses none); the
    # classifier stays freshly initialised
    has_pooler = model.encoder.pooler is not None
    state = {k: v for k, v in source.state_dict().items() if has_pooler or not k.startswith("pooler.")}
    missing, unexpected = model.encoder.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"pooler.weight", "pooler.bias"}:
        raise ValueError(f"init_from={init_from!r} does not fit the model: missing {missing}, unexpected {unexpected}")
    return note + ", fresh classification head" + (" and pooler" if missing else "")
