"""Hugging Face conversion for GPT-2, BERT, RoBERTa and Llama: configs, and state-dict adapters in both directions.

One adapter per model class (`HFAdapter`, registered with `register_hf_adapter`): its config from and to an HF config,
its state dict from HF names and back, the transformers Auto class of its counterpart. Three functions use them for
every model: `load_hf_state_dict(model, state_dict)`, `to_hf_state_dict(model)` and
`from_pretrained_hf(model_class, hf_model)` (a copy of a transformers model: config, weights, dtype, device);
flashtrain.export uses them to write a run as a transformers model directory. The registry and those functions are
flashtrain.models.hf_adapters (which imports no model); this module registers the adapters of GPT-2, BERT/RoBERTa and
Llama.

GPT-2: HF stores its projections as Conv1D with weight (in, out); ours are nn.Linear with weight (out, in), so a
conversion is four transposes per block. BERT/RoBERTa: HF's separate query, key and value projections are our fused
qkv; the heads keep HF's layout (BERT's pooler + classifier, RoBERTa's classification head on <s>, the MLM decoder
tied to the word embeddings).
Llama: our parameter names are LlamaForCausalLM's; the conversion is the tied head and the config, RoPE's scaling
included (transformers' rope_parameters). A model with sliding windows becomes a MinistralForCausalLM (Llama's layers
with a window on the layers its layer_types say); Mistral and Ministral checkpoints load too.
"""

import re

import torch
from torch import Tensor

from flashtrain.models.bert import (FLAVORS, BertConfig, BertForMaskedLM, BertForSequenceClassification,
                                    BertModel)
from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models.llama import Llama, LlamaConfig
from flashtrain.models.rope import RopeScaling, ntk_theta
# the registry and the functions over it, here too for the callers that import them from this module
from flashtrain.models.hf_adapters import (HFAdapter, from_pretrained_hf, has_hf_adapter, hf_adapter,  # noqa: F401
                                           load_hf_state_dict, register_hf_adapter, to_hf_state_dict)

# ---- GPT-2 -------------------------------------------------------------------------------------------------------

# HF Conv1D weights, (in, out) in HF and (out, in) here.
_CONV1D_WEIGHT_SUFFIXES = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Causal-mask buffers that transformers < 4.31 kept in the state dict; the mask is implicit here.
_HF_MASK_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def gpt2_config_from_hf(hf_config, attn_impl: str = "flash") -> GPT2Config:
    """A GPT2Config from a transformers.GPT2Config; raises ValueError for HF options this model does not have."""
    if hf_config.n_inner is not None and hf_config.n_inner != 4 * hf_config.n_embd:
        raise ValueError(f"hf_config.n_inner must be None or 4 * n_embd, got {hf_config.n_inner}")
    if hf_config.activation_function != "gelu_new":
        raise ValueError(f"hf_config.activation_function must be 'gelu_new', got {hf_config.activation_function!r}")
    if not hf_config.scale_attn_weights or hf_config.scale_attn_by_inverse_layer_idx:
        raise ValueError("hf_config must scale attention by 1/sqrt(head_dim) only (scale_attn_weights=True, "
                         "scale_attn_by_inverse_layer_idx=False)")
    if hf_config.add_cross_attention or not hf_config.tie_word_embeddings:
        raise ValueError("hf_config.add_cross_attention must be False and tie_word_embeddings True")
    if hf_config.embd_pdrop != hf_config.resid_pdrop:
        raise ValueError(f"hf_config.embd_pdrop ({hf_config.embd_pdrop}) and resid_pdrop ({hf_config.resid_pdrop}) "
                         "must be equal: this model has one dropout field")
    return GPT2Config(vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions, n_embd=hf_config.n_embd,
                      n_layer=hf_config.n_layer, n_head=hf_config.n_head, dropout=hf_config.resid_pdrop,
                      attn_dropout=hf_config.attn_pdrop, layer_norm_eps=hf_config.layer_norm_epsilon, bias=True,
                      attn_impl=attn_impl)


def gpt2_config_to_hf(config: GPT2Config, eos_token_id: int | None = None):
    """The transformers.GPT2Config of the same model (tanh GELU, tied embeddings, one dropout for embeddings and
    residuals); eos_token_id also serves as bos_token_id, as in GPT-2."""
    import transformers

    if not config.bias:
        raise ValueError("config.bias must be True to export to HF GPT-2, which always has biases")
    for name, value, none in (("attn_window", config.attn_window, -1), ("attn_softcap", config.attn_softcap, 0.0)):
        if value != none:
            raise ValueError(f"config.{name}={value}: HF GPT-2 has no such attention option; export needs {none}")
    return transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, n_inner=None, activation_function="gelu_new", resid_pdrop=config.dropout,
        embd_pdrop=config.dropout, attn_pdrop=config.attn_dropout, layer_norm_epsilon=config.layer_norm_eps,
        scale_attn_weights=True, tie_word_embeddings=True, bos_token_id=eos_token_id, eos_token_id=eos_token_id)


def _gpt2_from_hf(state_dict: dict[str, Tensor], config: GPT2Config) -> dict[str, Tensor]:
    """A GPT2LMHeadModel (or GPT2Model, or original hub checkpoint) state dict: keys with or without the
    "transformer." prefix, the old causal-mask buffers dropped, lm_head.weight filled from wte when absent."""
    converted = {}
    for key, value in state_dict.items():
        if key.endswith(_HF_MASK_BUFFER_SUFFIXES):
            continue
        if key != "lm_head.weight" and not key.startswith("transformer."):
            key = "transformer." + key
        converted[key] = value.t() if key.endswith(_CONV1D_WEIGHT_SUFFIXES) else value
    wte = converted["transformer.wte.weight"]
    lm_head = converted.setdefault("lm_head.weight", wte)
    if not torch.equal(lm_head, wte):
        raise ValueError("state_dict has lm_head.weight different from transformer.wte.weight; this model ties them")
    return converted


def _gpt2_to_hf(state_dict: dict[str, Tensor], config: GPT2Config) -> dict[str, Tensor]:
    """For transformers >= 4.31, whose causal-mask buffers are not persistent; lm_head.weight is wte (our state dict
    keeps the tied tensor once). Tensors that need no transpose share storage with the model."""
    if not config.bias:
        raise ValueError("config.bias must be True to export to HF GPT-2, which always has biases")
    converted = {key: value.t().contiguous() if key.endswith(_CONV1D_WEIGHT_SUFFIXES) else value
                 for key, value in state_dict.items()}
    converted["lm_head.weight"] = state_dict["transformer.wte.weight"]
    return converted


# ---- BERT / RoBERTa ----------------------------------------------------------------------------------------------

_HF_PROBLEM_TYPES = {None: "single_label", "single_label_classification": "single_label",
                     "multi_label_classification": "multi_label"}
# Non-persistent buffers that old HF checkpoints still carry (e.g. MiniLM, saved by transformers 4.8).
_HF_LEGACY_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def bert_config_from_hf(hf_config, attn_impl: str = "flash") -> BertConfig:
    """A BertConfig from a transformers BertConfig or RobertaConfig; raises ValueError for options this model lacks."""
    if hf_config.model_type not in FLAVORS:
        raise ValueError(f"hf_config.model_type must be one of {FLAVORS}, got {hf_config.model_type!r}")
    if hf_config.hidden_act != "gelu":
        raise ValueError(f"hf_config.hidden_act must be 'gelu', got {hf_config.hidden_act!r}")
    if hf_config.is_decoder or hf_config.add_cross_attention:
        raise ValueError("hf_config.is_decoder and add_cross_attention must be False: this is an encoder")
    if not hf_config.tie_word_embeddings:
        raise ValueError("hf_config.tie_word_embeddings must be True: the masked-LM decoder is the word embeddings")
    if hf_config.problem_type not in _HF_PROBLEM_TYPES or (hf_config.problem_type is None
                                                           and hf_config.num_labels == 1):
        raise ValueError(f"hf_config.problem_type {hf_config.problem_type!r} (num_labels={hf_config.num_labels}) "
                         "is not supported: single- or multi-label classification only, no regression")
    return BertConfig(flavor=hf_config.model_type, vocab_size=hf_config.vocab_size,
                      hidden_size=hf_config.hidden_size, num_hidden_layers=hf_config.num_hidden_layers,
                      num_attention_heads=hf_config.num_attention_heads,
                      intermediate_size=hf_config.intermediate_size,
                      max_position_embeddings=hf_config.max_position_embeddings,
                      type_vocab_size=hf_config.type_vocab_size, pad_token_id=hf_config.pad_token_id,
                      layer_norm_eps=hf_config.layer_norm_eps, hidden_dropout_prob=hf_config.hidden_dropout_prob,
                      attention_probs_dropout_prob=hf_config.attention_probs_dropout_prob,
                      classifier_dropout=hf_config.classifier_dropout, num_labels=hf_config.num_labels,
                      problem_type=_HF_PROBLEM_TYPES[hf_config.problem_type], attn_impl=attn_impl)


def bert_config_to_hf(config: BertConfig):
    """The transformers BertConfig or RobertaConfig (by config.flavor) of the same encoder and heads."""
    import transformers

    hf_class = transformers.BertConfig if config.flavor == "bert" else transformers.RobertaConfig
    return hf_class(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size,
        hidden_act="gelu", max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size, pad_token_id=config.pad_token_id, layer_norm_eps=config.layer_norm_eps,
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        classifier_dropout=config.classifier_dropout, num_labels=config.num_labels, tie_word_embeddings=True,
        problem_type=f"{config.problem_type}_classification")


# (HF name, our name) prefixes inside the encoder; {i} is a layer index. HF's separate query, key and value
# projections are concatenated into our layers.{i}.attn.qkv.

_ENCODER_RENAMES = [
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("encoder.layer.{i}.attention.output.dense.", "layers.{i}.attn.out."),
    ("encoder.layer.{i}.attention.output.LayerNorm.", "layers.{i}.attn_norm."),
    ("encoder.layer.{i}.intermediate.dense.", "layers.{i}.mlp_in."),
    ("encoder.layer.{i}.output.dense.", "layers.{i}.mlp_out."),
    ("encoder.layer.{i}.output.LayerNorm.", "layers.{i}.mlp_norm."),
    ("pooler.dense.", "pooler."),
]
_HF_QKV = re.compile(r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)")
_OUR_QKV = re.compile(r"layers\.(\d+)\.attn\.qkv\.(weight|bias)")


def _rename(key: str, source_index: int) -> str:
    """Rename by _ENCODER_RENAMES, from HF (source_index 0) or from ours (1); keys not listed keep their name."""
    for names in _ENCODER_RENAMES:
        pattern = re.escape(names[source_index]).replace(re.escape("{i}"), r"(?P<i>\d+)")
        match = re.match(pattern, key)
        if match:
            target = names[1 - source_index].replace("{i}", match.groupdict().get("i") or "")
            return target + key[match.end():]
    return key


def _encoder_from_hf(state_dict: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """HF encoder keys under `prefix` ("bert." / "roberta.") -> ours under "encoder."; with prefix "" every key is an
    encoder key and ours have no prefix. Keys outside the prefix (heads) pass through unchanged."""
    our_prefix = "encoder." if prefix else ""
    converted, qkv_parts = {}, {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            converted[key] = value
            continue
        key = key.removeprefix(prefix)
        if key in _HF_LEGACY_BUFFERS:
            continue
        match = _HF_QKV.fullmatch(key)
        if match:
            layer, projection, kind = match.groups()
            qkv_parts.setdefault((layer, kind), {})[projection] = value
        else:
            converted[our_prefix + _rename(key, source_index=0)] = value
    for (layer, kind), parts in qkv_parts.items():
        if parts.keys() != {"query", "key", "value"}:
            raise ValueError(f"state_dict has {sorted(parts)} but not all of query, key, value "
                             f"for layer {layer} {kind}")
        converted[f"{our_prefix}layers.{layer}.attn.qkv.{kind}"] = torch.cat(
            [parts["query"], parts["key"], parts["value"]])
    return converted


def _encoder_to_hf(state_dict: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Inverse of _encoder_from_hf: our keys under "encoder." (all keys when prefix is "") -> HF's under prefix."""
    our_prefix = "encoder." if prefix else ""
    converted = {}
    for key, value in state_dict.items():
        if not key.startswith(our_prefix):
            converted[key] = value
            continue
        key = key.removeprefix(our_prefix)
        match = _OUR_QKV.fullmatch(key)
        if match:
            layer, kind = match.groups()
            for projection, part in zip(("query", "key", "value"), value.chunk(3)):
                converted[f"{prefix}encoder.layer.{layer}.attention.self.{projection}.{kind}"] = part
        else:
            converted[prefix + _rename(key, source_index=1)] = value
    return converted


# Masked-LM head: (BERT name, RoBERTa name, ours). HF ties decoder.weight to the word embeddings and
# decoder.bias to the head's bias; both appear in its state dict.
_MLM_HEAD_RENAMES = [
    ("cls.predictions.transform.dense.", "lm_head.dense.", "lm_head.dense."),
    ("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm.", "lm_head.norm."),
    ("cls.predictions.bias", "lm_head.bias", "lm_head.decoder.bias"),
]
_MLM_TIED = {"bert": ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"),
             "roberta": ("lm_head.decoder.weight", "lm_head.decoder.bias")}


def _masked_lm_from_hf(state_dict: dict[str, Tensor], flavor: str) -> dict[str, Tensor]:
    column = FLAVORS.index(flavor)
    decoder_weight_key, decoder_bias_key = _MLM_TIED[flavor]
    state_dict = dict(state_dict)
    decoder_weight, decoder_bias = state_dict.pop(decoder_weight_key, None), state_dict.pop(decoder_bias_key, None)
    converted = {}
    for key, value in _encoder_from_hf(state_dict, prefix=flavor + ".").items():
        for names in _MLM_HEAD_RENAMES:
            if key.startswith(names[column]):
                key = names[2] + key[len(names[column]):]
                break
        converted[key] = value
    word_embeddings = converted["lm_head.decoder.weight"] = converted["encoder.embeddings.word_embeddings.weight"]
    if decoder_weight is not None and not torch.equal(decoder_weight, word_embeddings):
        raise ValueError(f"state_dict has {decoder_weight_key} different from the word embeddings; "
                         "this model ties them")
    if decoder_bias is not None and not torch.equal(decoder_bias, converted.setdefault("lm_head.decoder.bias",
                                                                                      decoder_bias)):
        raise ValueError(f"state_dict has {decoder_bias_key} different from {_MLM_HEAD_RENAMES[2][column]}; "
                         "HF ties them")
    return converted


def _masked_lm_to_hf(state_dict: dict[str, Tensor], flavor: str) -> dict[str, Tensor]:
    column = FLAVORS.index(flavor)
    decoder_weight_key, decoder_bias_key = _MLM_TIED[flavor]
    state_dict = dict(state_dict)
    decoder_weight = state_dict["encoder.embeddings.word_embeddings.weight"]  # tied: kept once, as the embeddings
    converted = {}
    for key, value in _encoder_to_hf(state_dict, prefix=flavor + ".").items():
        for names in _MLM_HEAD_RENAMES:
            if key.startswith(names[2]):
                key = names[column] + key[len(names[2]):]
                break
        converted[key] = value
    converted[decoder_weight_key] = decoder_weight
    converted[decoder_bias_key] = state_dict["lm_head.decoder.bias"]
    return converted


def _bert_model_from_hf(state_dict: dict[str, Tensor], config: BertConfig) -> dict[str, Tensor]:
    """HF BertModel / RobertaModel keys, with or without the "bert." / "roberta." prefix."""
    prefix = config.flavor + "."
    return _encoder_from_hf({key.removeprefix(prefix): value for key, value in state_dict.items()}, prefix="")


def _bert_classifier_from_hf(state_dict: dict[str, Tensor], config: BertConfig) -> dict[str, Tensor]:
    return _encoder_from_hf(state_dict, prefix=config.flavor + ".")


def _bert_classifier_to_hf(state_dict: dict[str, Tensor], config: BertConfig) -> dict[str, Tensor]:
    return _encoder_to_hf(state_dict, prefix=config.flavor + ".")  # the head keeps HF's names (classifier.*)


# ---- Llama -------------------------------------------------------------------------------------------------------

# RoPE scaling types whose transformers rope_parameters are RopeScaling's fields of the same names (ntk has no static
# type in transformers: it is written as plain RoPE of its scaled theta, the same frequencies)
_ROPE_FIELDS = {"linear": ("factor",),
                "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                         "mscale", "mscale_all_dim", "truncate"),
                "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
_LLAMA_MODEL_TYPES = ("llama", "mistral", "ministral")  # Llama's layers; Mistral's and Ministral's with windows


def rope_to_hf(config: LlamaConfig) -> dict:
    """transformers' rope_parameters of config's RoPE (rope_type, rope_theta and the scaling's fields)."""
    scaling = config.rope_scaling
    if scaling.type == "default":
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    if scaling.type == "ntk":
        return {"rope_type": "default", "rope_theta": ntk_theta(config.rope_theta, scaling.factor, config.head_dim)}
    fields = {name: getattr(scaling, name) for name in _ROPE_FIELDS[scaling.type]}
    return {"rope_type": scaling.type, "rope_theta": config.rope_theta,
            **{name: value for name, value in fields.items() if value is not None}}


def rope_from_hf(hf_config) -> tuple[float, RopeScaling]:
    """(rope_theta, rope_scaling) of a transformers config's rope_parameters; ValueError for what flashtrain's RoPE
    lacks (dynamic, longrope, partial rotation)."""
    parameters = dict(hf_config.rope_parameters)
    legacy_type = parameters.pop("type", "default")  # transformers' older name of rope_type
    rope_type = parameters.pop("rope_type", legacy_type)
    theta = parameters.pop("rope_theta")
    if rope_type == "default" and not parameters:
        return theta, RopeScaling()
    if rope_type not in _ROPE_FIELDS or set(parameters) - set(_ROPE_FIELDS[rope_type]):
        raise ValueError(f"hf_config.rope_parameters {hf_config.rope_parameters}: flashtrain's RoPE takes the types "
                         f"default, {', '.join(_ROPE_FIELDS)} with their fields (flashtrain.models.rope), over the "
                         f"whole head")
    if parameters.get("factor") is None:  # transformers' yarn: the ratio of the two lengths
        parameters["factor"] = hf_config.max_position_embeddings / parameters["original_max_position_embeddings"]
    return theta, RopeScaling(type=rope_type, **parameters)


def llama_config_from_hf(hf_config, attn_impl: str = "flash") -> LlamaConfig:
    """A LlamaConfig from a transformers Llama, Mistral or Ministral config; ValueError for options this model lacks."""
    if hf_config.model_type not in _LLAMA_MODEL_TYPES:
        raise ValueError(f"hf_config.model_type must be one of {_LLAMA_MODEL_TYPES}, got {hf_config.model_type!r}")
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    unsupported = {"hidden_act": (hf_config.hidden_act, "silu"), "attention_dropout": (hf_config.attention_dropout, 0),
                   "head_dim": (hf_config.head_dim or head_dim, head_dim)}  # None: Ministral's way to say the same
    if hf_config.model_type == "llama":  # Mistral's and Ministral's layers have no such options
        unsupported |= {"attention_bias": (hf_config.attention_bias, False), "mlp_bias": (hf_config.mlp_bias, False),
                        "pretraining_tp": (hf_config.pretraining_tp, 1)}
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise ValueError(f"hf_config.{name}={value!r}: flashtrain's Llama has {name}={supported!r}")
    attn_window, window_layers = -1, None
    if hf_config.model_type != "llama" and hf_config.sliding_window is not None:
        # transformers' window of W tokens holds the query and the W - 1 before it
        kinds = hf_config.layer_types if hf_config.model_type == "ministral" else \
            ["sliding_attention"] * hf_config.num_hidden_layers
        windowed = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        if windowed:
            attn_window = hf_config.sliding_window - 1
            window_layers = None if len(windowed) == hf_config.num_hidden_layers else windowed
    theta, scaling = rope_from_hf(hf_config)
    return LlamaConfig(vocab_size=hf_config.vocab_size, n_positions=hf_config.max_position_embeddings,
                       n_embd=hf_config.hidden_size, n_layer=hf_config.num_hidden_layers,
                       n_head=hf_config.num_attention_heads, n_kv_head=hf_config.num_key_value_heads,
                       intermediate_size=hf_config.intermediate_size, rope_theta=theta, rope_scaling=scaling,
                       norm_eps=hf_config.rms_norm_eps, tie_embeddings=hf_config.tie_word_embeddings,
                       attn_window=attn_window, window_layers=window_layers, attn_impl=attn_impl)


def llama_config_to_hf(config: LlamaConfig, eos_token_id: int | None = None):
    """The transformers config of the same model: a LlamaConfig, or with sliding windows a MinistralConfig (its
    layer_types mark the windowed layers); eos_token_id also serves as bos_token_id, as in GPT-2."""
    import transformers

    common = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.intermediate_size,
                  num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                  num_key_value_heads=config.n_kv_head, head_dim=config.head_dim, hidden_act="silu",
                  max_position_embeddings=config.n_positions, rms_norm_eps=config.norm_eps,
                  tie_word_embeddings=config.tie_embeddings, rope_parameters=rope_to_hf(config),
                  attention_dropout=0.0, bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    windows = config.layer_windows()
    if max(windows) < 0:
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    return transformers.MinistralConfig(**common, sliding_window=config.attn_window + 1,
                                        layer_types=["full_attention" if window < 0 else "sliding_attention"
                                                     for window in windows])


def _llama_from_hf(state_dict: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """The names are ours; older checkpoints' rotary frequencies dropped (the config defines them). A tied head may
    come under both names (equal: the tie checks it on loading, flashtrain.models.tying)."""
    return {key: value for key, value in state_dict.items() if not key.endswith(".rotary_emb.inv_freq")}


def _llama_to_hf(state_dict: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """transformers keeps a tied head under both names; ours keeps it once, as model.embed_tokens."""
    if not config.tie_embeddings:
        return dict(state_dict)
    return {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}


# ---- the adapters ------------------------------------------------------------------------------------------------

register_hf_adapter(GPT2, HFAdapter(
    "AutoModelForCausalLM", gpt2_config_from_hf,
    lambda config, tokenizer: gpt2_config_to_hf(config, eos_token_id=tokenizer.eos_token_id),
    _gpt2_from_hf, _gpt2_to_hf, max_length=lambda config: config.n_positions))

_BERT_CONFIGS = dict(config_from_hf=bert_config_from_hf, max_length=lambda config: config.max_seqlen,
                     config_to_hf=lambda config, tokenizer: bert_config_to_hf(config))
register_hf_adapter(BertModel, HFAdapter(
    "AutoModel", from_hf=_bert_model_from_hf, to_hf=lambda state_dict, config: _encoder_to_hf(state_dict, prefix=""),
    model_kwargs=lambda hf_model: {"add_pooler": hf_model.pooler is not None}, **_BERT_CONFIGS))
register_hf_adapter(BertForMaskedLM, HFAdapter(
    "AutoModelForMaskedLM", from_hf=lambda sd, config: _masked_lm_from_hf(sd, config.flavor),
    to_hf=lambda sd, config: _masked_lm_to_hf(sd, config.flavor), **_BERT_CONFIGS))
register_hf_adapter(BertForSequenceClassification, HFAdapter(
    "AutoModelForSequenceClassification", from_hf=_bert_classifier_from_hf, to_hf=_bert_classifier_to_hf,
    **_BERT_CONFIGS))
register_hf_adapter(Llama, HFAdapter(
    "AutoModelForCausalLM", llama_config_from_hf,
    lambda config, tokenizer: llama_config_to_hf(config, eos_token_id=tokenizer.eos_token_id),
    _llama_from_hf, _llama_to_hf, max_length=lambda config: config.n_positions))
