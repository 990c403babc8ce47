"""The Hugging Face adapter registry: one `HFAdapter` per model class of ours (registered with `register_hf_adapter`)
and the functions that use it for every model: `load_hf_state_dict(model, state_dict)`, `to_hf_state_dict(model)`
and `from_pretrained_hf(model_class, hf_model)`. It imports no model: flashtrain.models.hf_convert registers GPT-2's
and BERT/RoBERTa's adapters (flashtrain.models imports it), a new model's own file registers its own."""

from dataclasses import dataclass
from typing import Callable

from torch import Tensor, nn

StateDictMap = Callable[[dict[str, Tensor], object], dict[str, Tensor]]


@dataclass(frozen=True)
class HFAdapter:
    """How one model class of ours maps to a transformers class, both ways. Registered per model class
    (`register_hf_adapter`); a new model's own file registers its adapter, as it registers its config schema."""

    auto_class: str  # the transformers Auto class that builds and loads the counterpart: "AutoModelForCausalLM", ...
    config_from_hf: Callable  # (transformers config, attn_impl) -> our config
    config_to_hf: Callable  # (our config, its tokenizer) -> the transformers config (special-token ids from it)
    from_hf: StateDictMap  # (HF state dict, our config) -> our state dict
    to_hf: StateDictMap  # (our state dict, our config) -> the state dict the HF class loads with strict=True
    max_length: Callable[[object], int]  # (our config) -> longest input in tokens (the tokenizer's model_max_length)
    model_kwargs: Callable[[nn.Module], dict] = lambda hf_model: {}  # extra constructor arguments from the HF model


_ADAPTERS: dict[type, HFAdapter] = {}


def register_hf_adapter(model_class: type, adapter: HFAdapter) -> None:
    """Make `model_class` convertible to and from transformers: export, init_from=hf:, from_pretrained_hf."""
    _ADAPTERS[model_class] = adapter


def _adapted_class(model_class: type) -> type | None:
    """The nearest class of `model_class`'s MRO with an adapter: FSDP's fully_shard turns a GPT2 into a subclass of
    it (FSDPGPT2), which converts as a GPT2."""
    return next((cls for cls in model_class.__mro__ if cls in _ADAPTERS), None)


def has_hf_adapter(model_class: type) -> bool:
    return _adapted_class(model_class) is not None


def hf_adapter(model_class: type) -> HFAdapter:
    adapted = _adapted_class(model_class)
    if adapted is None:
        raise TypeError(f"no Hugging Face adapter for {model_class.__name__}; adapters: "
                        f"{[cls.__name__ for cls in _ADAPTERS]}")
    return _ADAPTERS[adapted]


def load_hf_state_dict(model: nn.Module, state_dict: dict[str, Tensor]) -> nn.Module:
    """Load a Hugging Face state dict of the matching transformers class into `model`, strictly; returns `model`."""
    model.load_state_dict(hf_adapter(type(model)).from_hf(state_dict, model.config), strict=True)
    return model


def to_hf_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """`model`'s state dict under the matching transformers class's names (its load_state_dict(strict=True) takes it)."""
    return hf_adapter(type(model)).to_hf(model.state_dict(), model.config)


def from_pretrained_hf(model_class: type, hf_model, attn_impl: str = "flash") -> nn.Module:
    """A `model_class` copy of a transformers model (GPT2LMHeadModel, BertModel / RobertaModel, *ForMaskedLM,
    *ForSequenceClassification): its config, weights, dtype and device. To start a classifier from an encoder-only
    checkpoint, load it with the HF class first (from_pretrained initialises the head)."""
    adapter = hf_adapter(model_class)
    model = model_class(adapter.config_from_hf(hf_model.config, attn_impl), **adapter.model_kwargs(hf_model))
    model.to(device=hf_model.device, dtype=hf_model.dtype)
    return load_hf_state_dict(model, hf_model.state_dict())
