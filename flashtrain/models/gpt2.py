"""GPT-2 (Radford et al. 2019) on flashtrain's attention, single device.

Same architecture and parameter names as Hugging Face's GPT2LMHeadModel: learned absolute positions (wpe),
pre-LN blocks, GELU with the tanh approximation ("gelu_new"), input and output embeddings tied. HF stores
its projections as Conv1D with weight (in, out); ours are nn.Linear with weight (out, in), so converting a
state dict in either direction is four transposes per block.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.kernels import flash_attn_func

ATTN_IMPLS = ("flash", "sdpa", "reference")
# HF Conv1D weights, (in, out) in HF and (out, in) here.
_CONV1D_WEIGHT_SUFFIXES = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Causal-mask buffers that transformers < 4.31 kept in the state dict; the mask is implicit here.
_HF_MASK_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


@dataclass
class GPT2Config:
    vocab_size: int = 50257  # tokens in the vocabulary (GPT-2 BPE)
    n_positions: int = 1024  # longest sequence; rows of the learned position table
    n_embd: int = 768  # model width
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads; head_dim = n_embd // n_head
    dropout: float = 0.0  # dropout on embeddings, on each residual branch and in the MLP
    attn_dropout: float = 0.0  # dropout on attention probabilities (dropout_p of the attention call), training only
    layer_norm_eps: float = 1e-5  # LayerNorm epsilon
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2 has them; HF conversion needs them)
    attn_impl: str = "flash"  # "flash" (flashtrain kernel, "auto" dispatch) | "sdpa" (PyTorch) | "reference"

    def __post_init__(self):
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        sizes = dict(vocab_size=self.vocab_size, n_positions=self.n_positions, n_embd=self.n_embd,
                     n_layer=self.n_layer, n_head=self.n_head)
        for name, size in sizes.items():
            if size <= 0:
                raise ValueError(f"{name} must be positive, got {size}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name, p in dict(dropout=self.dropout, attn_dropout=self.attn_dropout).items():
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")

    @classmethod
    def from_hf(cls, hf_config, attn_impl: str = "flash") -> "GPT2Config":
        """Build from a transformers.GPT2Config; raises ValueError for HF options this model does not have."""
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
        return cls(vocab_size=hf_config.vocab_size, n_positions=hf_config.n_positions, n_embd=hf_config.n_embd,
                   n_layer=hf_config.n_layer, n_head=hf_config.n_head, dropout=hf_config.resid_pdrop,
                   attn_dropout=hf_config.attn_pdrop, layer_norm_eps=hf_config.layer_norm_epsilon, bias=True,
                   attn_impl=attn_impl)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.attn_impl = config.attn_impl
        self.attn_dropout = config.attn_dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # -> q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        # c_attn's output columns are [q | k | v], each split into heads as (H, D).
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).unbind(dim=2)  # each (B, T, H, D)
        dropout_p = self.attn_dropout if self.training else 0.0
        if self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               dropout_p=dropout_p, is_causal=True)  # (B, H, T, D)
            y = y.transpose(1, 2)  # (B, T, H, D)
        else:
            impl = "auto" if self.attn_impl == "flash" else "reference"
            y = flash_attn_func(q, k, v, dropout_p, causal=True, impl=impl)  # (B, T, H, D)
        return self.resid_dropout(self.c_proj(y.reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # tanh GELU = HF "gelu_new"


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.n_positions, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one tensor, two names in the state dict
        self.apply(self._init_weights)
        # GPT-2 paper: residual projections scaled by 1/sqrt(N), N = 2 residual branches per block.
        for name, param in self.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        # nn.LayerNorm already starts at weight 1, bias 0.

    def forward(self, input_ids: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """input_ids (B, T) -> (logits (B, T, vocab_size), mean cross-entropy or None).

        targets (B, T) are already shifted: targets[:, t] is the token that follows input_ids[:, t].
        Targets equal to -100 are ignored (as in HF and F.cross_entropy).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > self.config.n_positions:
            raise ValueError(f"input_ids has {T} tokens, more than n_positions={self.config.n_positions}")
        if targets is not None and targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal input_ids shape {(B, T)}")
        positions = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(positions))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)
        loss = None
        if targets is not None:  # in float32 even when the logits are bf16/fp16
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Append max_new_tokens sampled tokens to input_ids (B, T) -> (B, T + max_new_tokens).

        temperature == 0 picks the argmax. The context is cropped to the last n_positions tokens.
        Call .eval() first unless dropout is wanted while sampling.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {top_k}")
        for _ in range(max_new_tokens):
            context = input_ids[:, -self.config.n_positions:]  # (B, <= n_positions)
            logits = self(context)[0][:, -1, :]  # (B, vocab_size)
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth_largest, float("-inf"))
                probs = F.softmax(logits.float(), dim=-1)
                next_token = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            input_ids = torch.cat([input_ids, next_token], dim=1)
        return input_ids

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (the tied lm_head is wte); exclude_embeddings drops wte and wpe, as HF does."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields each tensor once
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    # ---- Hugging Face conversion -------------------------------------------------------------------------------

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load a GPT2LMHeadModel (or GPT2Model, or original hub checkpoint) state dict, strictly.

        Accepts keys with or without the "transformer." prefix, drops the old causal-mask buffers
        (attn.bias / attn.masked_bias) and fills lm_head.weight from wte when absent.
        """
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
            raise ValueError("state_dict has lm_head.weight different from transformer.wte.weight; "
                             "this model ties them")
        self.load_state_dict(converted, strict=True)

    @classmethod
    def from_hf_state_dict(cls, state_dict: dict[str, Tensor], config: GPT2Config) -> "GPT2":
        """New model (default dtype, CPU) holding the weights of an HF GPT-2 state dict."""
        model = cls(config)
        model.load_hf_state_dict(state_dict)
        return model

    @classmethod
    def from_pretrained_hf(cls, hf_model, attn_impl: str = "flash") -> "GPT2":
        """Copy of a transformers.GPT2LMHeadModel: its config, weights, dtype and device."""
        model = cls(GPT2Config.from_hf(hf_model.config, attn_impl=attn_impl))
        model.to(device=hf_model.device, dtype=hf_model.dtype)
        model.load_hf_state_dict(hf_model.state_dict())
        return model

    def to_hf_state_dict(self) -> dict[str, Tensor]:
        """State dict that transformers.GPT2LMHeadModel.load_state_dict(strict=True) accepts (transformers >= 4.31,
        whose causal-mask buffers are not persistent). Tensors that need no transpose share storage with the model."""
        if not self.config.bias:
            raise ValueError("config.bias must be True to export to HF GPT-2, which always has biases")
        return {key: value.t().contiguous() if key.endswith(_CONV1D_WEIGHT_SUFFIXES) else value
                for key, value in self.state_dict().items()}
