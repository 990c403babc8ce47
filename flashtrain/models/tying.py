"""Tied weights: one tensor under two names, such as an LM head whose weight is the token embedding.

A state dict holds each tensor once, under the name the model gives it first (the embedding's): `state_dict()` leaves
the second name out, as a safetensors file must (Accelerate's checkpoints keep one name of a shared tensor), and
`load_state_dict` fills it from the first. So a checkpoint loads strictly:
`model.load_state_dict(safetensors.torch.load_file(checkpoint / "model.safetensors"))`. A state dict that has both
names (a Hugging Face one, say) must hold equal values under them, or loading says which differ.
"""

from functools import partial

import torch
from torch import nn


def tie_weights(model: nn.Module, alias: str, source: str) -> None:
    """Make the parameter named `alias` (a dotted name from `model`, e.g. "lm_head.weight") the parameter named
    `source` ("transformer.wte.weight"), kept in `model`'s state dicts under `source` only."""
    module_name, _, attribute = alias.rpartition(".")
    setattr(model.get_submodule(module_name), attribute, model.get_parameter(source))
    model.register_state_dict_post_hook(partial(_drop_alias, alias=alias))
    model.register_load_state_dict_pre_hook(partial(_fill_alias, alias=alias, source=source))


def _drop_alias(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *, alias: str) -> None:
    del state_dict[prefix + alias]


def _fill_alias(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                missing_keys: list, unexpected_keys: list, error_msgs: list, *, alias: str, source: str) -> None:
    """load_state_dict's pre-hook (on its own shallow copy of the state dict): the alias from the source."""
    alias_key, source_key = prefix + alias, prefix + source
    if source_key not in state_dict:
        return  # load_state_dict reports it missing
    if alias_key not in state_dict:
        state_dict[alias_key] = state_dict[source_key]
    elif not torch.equal(state_dict[alias_key], state_dict[source_key]):
        error_msgs.append(f"{alias_key} differs from {source_key}; this model ties them (one tensor)")
