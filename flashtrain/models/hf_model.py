"""Any transformers causal LM trained by flashtrain's trainer (`model=hf`), its attention on flashtrain's API.

`HFCausalLM` wraps an `AutoModelForCausalLM` -- built from a transformers config (`model.config`, a dict with its
`model_type`) or loaded with its weights (`model.pretrained`: a local directory, a Hub name, or pkg:MODULE/SUBDIR) --
in the trainer's model protocol: forward(input_ids, targets, position_ids) -> (logits, mean cross-entropy), the loss
computed as the other LMs compute it (flashtrain.models.losses.cross_entropy, -100 ignored). Attention runs through
`attn_implementation` (default "ft_attention", flashtrain.models.hf_attention: the CUDA kernel on a GPU, the reference
on a CPU; "sdpa" / "eager" run transformers' own). The transformers model's `_no_split_modules` (its decoder layer
classes) are this model's too: FSDP's units and activation checkpointing's blocks.

Position ids (data.reset_positions) only place tokens for the position embedding (RoPE): transformers would read a
reset in them as packed documents and mask attention at it under sdpa / eager but not under ft_attention, so the
forward passes an all-ones attention mask with them, which turns that guess off for every backend. Attention inside
each document (data.document_mask, cu_seqlens) is refused at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from torch import Tensor

from flashtrain.models import hf_attention
from flashtrain.models.attention import check_backend
from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.losses import cross_entropy

ATTN_IMPLEMENTATIONS = (hf_attention.NAME, "sdpa", "eager")


@dataclass
class HFCausalLMConfig:
    # weights and transformers config from a local directory, a Hub name (HF_HUB_OFFLINE=1 works with directories) or
    # pkg:MODULE/SUBDIR (flashtrain.pretrained); null: a from-scratch model of `config`
    pretrained: Optional[str] = None
    # a from-scratch model's transformers config fields, model_type among them ({model_type: llama, hidden_size: 64,
    # ...}); null with pretrained (the checkpoint's config is the model's)
    config: Optional[Dict[str, Any]] = None
    # the vocabulary (transformers' vocab_size; null: the config's own). With pretrained: null or the checkpoint's
    vocab_size: Optional[int] = None
    # the longest sequence (transformers' max_position_embeddings; null: the config's own). With pretrained: null or
    # the checkpoint's
    n_positions: Optional[int] = None
    # ft_attention (flashtrain's kernels: flashtrain.models.hf_attention) | sdpa | eager (transformers' own)
    attn_implementation: str = hf_attention.NAME
    # the loss on flashtrain's cross-entropy kernels on CUDA; False: F.cross_entropy of the float32 logits
    fused_loss: bool = True

    def __post_init__(self):
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"model.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got "
                             f"{self.attn_implementation!r}")
        if self.pretrained is None and not (self.config and "model_type" in self.config):
            raise ValueError("model.config must give a from-scratch model's transformers config with its model_type "
                             "({model_type: llama, hidden_size: ...}), or model.pretrained a checkpoint to load")
        if self.pretrained is not None and self.config:
            raise ValueError(f"model.pretrained={self.pretrained!r} brings its own transformers config: set "
                             f"model.config=null (model.config builds a from-scratch model)")
        for name in ("vocab_size", "n_positions"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1 (or null: the transformers config's), got "
                                 f"{getattr(self, name)}")

    def hf_config(self):
        """The transformers config of the model: the checkpoint's, or `config` with vocab_size / n_positions."""
        import transformers

        from flashtrain.pretrained import resolve_pretrained_path

        # model.<field> -> (transformers' field, the value to have)
        sizes = {"vocab_size": ("vocab_size", self.vocab_size),
                 "n_positions": ("max_position_embeddings", self.n_positions)}
        if self.pretrained is not None:
            hf_config = transformers.AutoConfig.from_pretrained(resolve_pretrained_path(self.pretrained))
            for field, (hf_field, value) in sizes.items():
                if value is not None and value != getattr(hf_config, hf_field, None):
                    raise ValueError(f"model.{field}={value}, but model.pretrained={self.pretrained!r} has "
                                     f"{hf_field}={getattr(hf_config, hf_field, None)}: set model.{field}=null (the "
                                     f"checkpoint's)")
            return hf_config
        fields = dict(self.config)
        hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        for field, (hf_field, value) in sizes.items():
            if value is not None:
                if not hasattr(hf_config, hf_field):
                    raise ValueError(f"model.{field}={value}: model.config (model_type {hf_config.model_type}) has "
                                     f"no {hf_field}")
                setattr(hf_config, hf_field, value)
        return hf_config

    def build(self) -> "HFCausalLM":
        return HFCausalLM(self)

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        if self.attn_implementation != hf_attention.NAME:
            return f"transformers {self.attn_implementation}"
        hf_config = self.hf_config()
        # configs name the head width when it is not hidden_size / heads (Qwen3, Gemma); most do not
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return f"{hf_attention.NAME}: " + check_backend("flash", device, dtype, head_dim)

    def check_data(self, data) -> None:
        """Raise ValueError when the data (a flashtrain.data.task.DataSpec) is not next-token prediction this model
        can read; fields that are None (a preview) are not checked."""
        hf_config = self.hf_config()
        problems = []
        if data.task != "causal_lm":
            problems.append(f"a transformers causal LM predicts the next token (causal_lm data); the data is "
                            f"{data.task}")
        elif data.document_mask:
            problems.append("data.document_mask=true keeps attention inside each document (cu_seqlens), which "
                            "model=hf does not run: set data.document_mask=false")
        if data.vocab_size > hf_config.vocab_size:
            problems.append(f"the tokenizer has {data.vocab_size} tokens, the model's vocab_size is "
                            f"{hf_config.vocab_size}")
        max_positions = getattr(hf_config, "max_position_embeddings", None)  # not every architecture has a limit
        if data.max_length is not None and max_positions is not None and data.max_length > max_positions:
            problems.append(f"{data.length_field}={data.max_length} is longer than the model's "
                            f"max_position_embeddings={max_positions} (model.n_positions)")
        if problems:
            raise ValueError("; ".join(problems))


class HFCausalLM(nn.Module):
    """A transformers causal LM (`self.hf`) with flashtrain's forward: (logits, mean cross-entropy)."""

    def __init__(self, config: HFCausalLMConfig):
        super().__init__()
        import transformers

        from flashtrain.pretrained import resolve_pretrained_path

        self.config = config
        hf_attention.register()  # attn_implementation="ft_attention" exists before the model looks it up
        if config.pretrained is not None:
            config.hf_config()  # vocab_size / n_positions checked against the checkpoint's
            # float32 master weights whatever the checkpoint's dtype (autocast runs the low precision)
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(
                resolve_pretrained_path(config.pretrained), dtype=torch.float32,
                attn_implementation=config.attn_implementation)
        else:
            self.hf = transformers.AutoModelForCausalLM.from_config(
                config.hf_config(), dtype=torch.float32, attn_implementation=config.attn_implementation)
        # the decoder layer classes: FSDP's units, activation checkpointing's blocks
        self._no_split_modules = list(self.hf._no_split_modules or ())

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, cu_seqlens: Tensor | None = None,
                position_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids (B, T) -> (logits (B, T, vocab_size), mean cross-entropy against targets (B, T) (already
        shifted, -100 ignored) or None). position_ids (B, T): each token's position (default 0 .. T - 1)."""
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: model=hf does not keep attention inside documents (data.document_mask)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        for name, tensor in (("targets", targets), ("position_ids", position_ids)):
            if tensor is not None and tensor.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(tensor.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}")
        # with position ids, a mask of ones: no padding, and transformers does not take a reset for packed documents
        attention_mask = None if position_ids is None else torch.ones_like(input_ids)
        logits = self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).logits  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        loss = cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                             fused=self.config.fused_loss)  # float32
        return logits, loss

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at seq_len tokens (default max_position_embeddings; flashtrain.models.flops):
        6 per parameter, an untied token table being a lookup, plus 12 * layers * hidden_size * seq_len."""
        c = self.hf.config
        embeddings, head = self.hf.get_input_embeddings(), self.hf.get_output_embeddings()
        lookups = [] if head is not None and head.weight is embeddings.weight else [embeddings]
        return training_flops_per_token(self, lookups, c.num_hidden_layers, c.hidden_size,
                                        seq_len or c.max_position_embeddings)

