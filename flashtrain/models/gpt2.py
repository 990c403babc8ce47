"""GPT-2 (Radford et al. 2019) on flashtrain's attention, single device.

Same architecture and parameter names as Hugging Face's GPT2LMHeadModel: learned absolute positions (wpe),
pre-LN blocks, GELU with the tanh approximation ("gelu_new"), input and output embeddings tied
(flashtrain.models.hf_convert converts state dicts in both directions).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import attention, check_attn_impl, check_backend


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
    attn_impl: str = "flash"  # flash | sdpa | reference | auto (flashtrain.models.attention)

    def __post_init__(self):
        check_attn_impl(self.attn_impl)
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

    def build(self) -> "GPT2":
        return GPT2(self)

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        return check_backend(self.attn_impl, device, dtype, self.n_embd // self.n_head)

    def check_data(self, data) -> None:
        """Raise ValueError when the data (a flashtrain.data.spec.DataSpec) is not what this model reads."""
        if data.task != "causal_lm":
            raise ValueError(f"GPT-2 trains on causal_lm data (next-token prediction); the data is {data.task}")
        if self.vocab_size < data.vocab_size:
            raise ValueError(f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary "
                             f"({data.vocab_size})")
        if data.max_length > self.n_positions:
            raise ValueError(f"{data.length_field}={data.max_length} exceeds model.n_positions={self.n_positions}")


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
        y = attention(q, k, v, self.attn_impl, causal=True,
                      dropout_p=self.attn_dropout if self.training else 0.0)  # (B, T, H, D)
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
