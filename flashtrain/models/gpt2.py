"""GPT-2 (Radford et al. 2019) on flashtrain's attention, single device.

Same architecture and parameter names as Hugging Face's GPT2LMHeadModel: learned absolute positions (wpe),
pre-LN blocks, GELU with the tanh approximation ("gelu_new"), input and output embeddings tied
(flashtrain.models.hf_convert converts state dicts in both directions).
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models.attention import (KERNEL, attention, attention_features, backend, check_attn_impl,
                                         check_backend, compute_dtype)
from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.losses import cross_entropy, linear_cross_entropy, padded_logits
from flashtrain.models.position import extended_table
from flashtrain.models.tying import tie_weights

# how the end-of-run sample, `python -m flashtrain.generate` and an export's generation_config.json sample by default:
# a repetition penalty keeps a young model from repeating its likeliest token ("0x 0x 0x ...")
SAMPLING = {"temperature": 0.8, "top_k": 50, "repetition_penalty": 1.3}


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
    # sliding-window attention: each token attends to itself and the attn_window tokens before it; -1: to all before it
    attn_window: int = -1
    # logit softcapping (Gemma 2): scores s -> attn_softcap * tanh(s / attn_softcap) before the softmax; 0: none
    attn_softcap: float = 0.0
    # the training loss a chunk of tokens at a time, without the (B, T, vocab) logits (flashtrain.models.losses):
    # half the peak memory of GPT-2 small at 16K tokens per micro-batch (16.0 -> 7.9 GiB), but 13% slower eager and
    # 9% slower compiled (H200, 2026-11-26), so off unless memory is what limits the micro-batch
    chunked_loss: bool = False
    # the LM head's matmuls run on the vocabulary padded with zero rows to a multiple of this (50257 -> 50304), the
    # logits sliced back: aligned GEMM shapes, the same values; the parameters keep vocab_size rows. 1: no padding
    vocab_multiple: int = 128
    # the loss on flashtrain's cross-entropy kernels on CUDA (flashtrain.kernels.cross_entropy: the bf16 logits read
    # once forward and once backward, no float32 copy); False: F.cross_entropy of the float32 logits
    fused_loss: bool = True

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
        if self.attn_window < -1:
            raise ValueError(f"attn_window must be >= 0 tokens, or -1 for none, got {self.attn_window}")
        if not (math.isfinite(self.attn_softcap) and self.attn_softcap >= 0):
            raise ValueError(f"attn_softcap must be finite and >= 0 (0: none), got {self.attn_softcap}")
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1 (1: no padding), got {self.vocab_multiple}")

    def build(self) -> "GPT2":
        return GPT2(self)

    @property
    def attention_options(self) -> dict:
        """window_size / softcap of every attention call (flashtrain.models.attention.attention)."""
        return {"window_size": (self.attn_window, 0), "softcap": self.attn_softcap}

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        features = attention_features(**self.attention_options, causal=True)
        head_dim = self.n_embd // self.n_head
        header = check_backend(self.attn_impl, device, dtype, head_dim, features=features)
        runs_kernel = backend(self.attn_impl, device, dtype, head_dim, features=features)[0] == KERNEL
        if features and self.attn_dropout > 0 and runs_kernel:
            # the CUDA kernels run the window and softcap without attention dropout only (flashtrain.kernels.interface
            # refuses the combination at the first call)
            named = {"window_size": ("attn_window", "a sliding window"),
                     "softcap": ("attn_softcap", "logit softcapping")}
            values = ", ".join(f"model.{named[f][0]}={getattr(self, named[f][0])}" for f in features)
            others = "model.attn_impl=reference (the plain-PyTorch path, slow)" + (
                "" if "softcap" in features else " or model.attn_impl=sdpa (the window as a mask)")
            raise ValueError(f"{values} with model.attn_dropout={self.attn_dropout}: flashtrain's CUDA kernels "
                             f"(model.attn_impl={self.attn_impl} -> {KERNEL}) do not combine "
                             f"{' or '.join(named[f][1] for f in features)} with attention dropout; set "
                             f"model.attn_dropout=0, or {others}")
        return header

    def check_data(self, data) -> None:
        """Raise ValueError when the data (a flashtrain.data.task.DataSpec) is not what this model reads; a field
        that is None (a preview, before the data is prepared) is not checked."""
        if data.task != "causal_lm":
            raise ValueError(f"GPT-2 trains on causal_lm data (next-token prediction); the data is {data.task}")
        if data.document_mask and self.attn_impl == "sdpa":
            raise ValueError("data.document_mask=true attends inside each document through the varlen API "
                             "(cu_seqlens), which attn_impl=sdpa does not run: use flash, reference or auto")
        if self.vocab_size < data.vocab_size:
            raise ValueError(f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary "
                             f"({data.vocab_size})")
        if data.max_length is not None and data.max_length > self.n_positions:
            raise ValueError(f"{data.length_field}={data.max_length} exceeds model.n_positions={self.n_positions}")


class KVCache:
    """Keys and values of the tokens a GPT-2 has read so far, for generation: one (B, n_positions, H, D) buffer per
    layer and per k / v, filled from the left; `length` tokens are in it (their positions are 0 .. length - 1)."""

    def __init__(self, config: GPT2Config, batch_size: int, device: torch.device, dtype: torch.dtype):
        shape = (config.n_layer, batch_size, config.n_positions, config.n_head, config.n_embd // config.n_head)
        self.keys = torch.empty(shape, device=device, dtype=dtype)  # (L, B, n_positions, H, D)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' k, v (B, T, H, D) of `layer` after the cached ones -> every key and value of the
        layer, (B, length + T, H, D). The model advances `length` once all layers have stored theirs."""
        end = self.length + k.shape[1]
        self.keys[layer, :, self.length:end] = k
        self.values[layer, :, self.length:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.attn_impl = config.attn_impl
        self.attn_dropout = config.attn_dropout
        self.options = config.attention_options
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # -> q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0,
                cu_seqlens: Tensor | None = None) -> Tensor:
        B, T, C = x.shape
        # c_attn's output columns are [q | k | v], each split into heads as (H, D).
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).unbind(dim=2)  # each (B, T, H, D)
        dropout_p = self.attn_dropout if self.training else 0.0
        if cu_seqlens is not None:  # documents packed in the B * T rows: each attends to itself only
            y = attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), self.attn_impl, causal=True,
                          dropout_p=dropout_p, cu_seqlens=cu_seqlens, max_seqlen=T, **self.options)  # (B * T, H, D)
            return self.resid_dropout(self.c_proj(y.reshape(B, T, C)))
        if cache is not None:  # attend to every cached token too: k, v (B, cache.length + T, H, D)
            k, v = cache.update(layer, k, v)
        # causal is aligned to the bottom-right corner: query t of T sees all cached keys and the new ones up to t
        y = attention(q, k, v, self.attn_impl, causal=True, dropout_p=dropout_p, **self.options)  # (B, T, H, D)
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

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0,
                cu_seqlens: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, cu_seqlens)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    # the repeated unit: FSDP shards each Block on its own; trainer.activation_checkpointing recomputes per Block
    _no_split_modules = ["Block"]

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
        tie_weights(self, "lm_head.weight", "transformer.wte.weight")  # one tensor, saved as wte
        self.apply(self._init_weights)
        # GPT-2 paper: residual projections scaled by 1/sqrt(N), N = 2 residual branches per block.
        for name, param in self.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at seq_len tokens per sequence (default n_positions; flashtrain.models.flops):
        the tied token table counts once, as the LM head's matmul; the position table is a lookup."""
        c = self.config
        seq_len = seq_len or c.n_positions
        # the convention counts causal attention's whole square; a window of w keys, the same share of the band
        fraction = 1.0 if c.attn_window < 0 else min(1.0, 2 * (c.attn_window + 1) / seq_len)
        return training_flops_per_token(self, [self.transformer.wpe], c.n_layer, c.n_embd, seq_len, fraction)

    @staticmethod
    def _init_weights(module: nn.Module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        # nn.LayerNorm already starts at weight 1, bias 0.

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, cache: KVCache | None = None,
                cu_seqlens: Tensor | None = None, position_ids: Tensor | None = None) -> tuple[Tensor | None,
                                                                                               Tensor | None]:
        """input_ids (B, T) -> (logits (B, T, vocab_size), mean cross-entropy or None); with targets and a vocabulary
        padded for the LM head (vocab_size not a multiple of vocab_multiple) the logits are detached (no gradient flows
        through them: the loss is what trains); set vocab_multiple=1 for logits a loss of your own can differentiate.

        targets (B, T) are already shifted: targets[:, t] is the token that follows input_ids[:, t].
        Targets equal to -100 are ignored (as in HF and F.cross_entropy).
        config.chunked_loss (with targets): logits None, the loss computed a chunk of tokens at a time without the
        (B, T, vocab_size) logits (flashtrain.models.losses): the same value and gradients.
        cache (generation): input_ids continue the cache.length tokens in it (positions from cache.length on); their
        keys and values are added to it.
        cu_seqlens (n + 1,) int32 (data.document_mask): the documents packed in the flattened B * T tokens, built on
        the host (flashtrain.data.lm.document_offsets); attention stays inside each one (varlen attention, max_seqlen
        T). Not with a cache.
        position_ids (B, T) (data.reset_positions): each token's row of the position table, instead of its index.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        past = 0 if cache is None else cache.length
        if past + T > self.config.n_positions:
            raise ValueError(f"input_ids has {T} tokens" + (f" after {past} cached ones" if past else "") +
                             f", more than n_positions={self.config.n_positions}")
        if targets is not None and targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal input_ids shape {(B, T)}")
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cu_seqlens (documents packed in a batch) does not go with a KV cache")
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} must equal input_ids shape {(B, T)}")
        positions = torch.arange(past, past + T, device=input_ids.device) if position_ids is None else position_ids
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(positions))  # (B, T, C)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, cache, layer, cu_seqlens)
        if cache is not None:
            cache.length = past + T
        x = self.transformer.ln_f(x)
        if targets is not None and self.config.chunked_loss:
            return None, linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        padded = padded_logits(x, self.lm_head.weight, self.config.vocab_multiple)  # (B, T, padded vocab)
        if targets is None:
            return self._unpadded(padded), None  # (B, T, vocab_size)
        # in float32 even when the logits are bf16/fp16
        loss = cross_entropy(padded.flatten(0, 1), targets.flatten(), self.config.vocab_size, ignore_index=-100,
                             fused=self.config.fused_loss)
        if padded.shape[-1] == self.config.vocab_size:
            return padded, loss  # (B, T, vocab_size), differentiable
        # a padded vocabulary's logits are a slice of the head's output: with a loss they come back detached (the loss
        # is what trains). A view that autograd tracks, returned by the root module of an FSDP run, makes torch warn
        # that an in-place op on it would skip FSDP's all-gather; a copy would cost the logits' size
        return self._unpadded(padded.detach()), loss

    def _unpadded(self, padded: Tensor) -> Tensor:
        """The logits (..., vocab_size) of the head's output over the padded vocabulary: that output itself when
        nothing was padded, else its first vocab_size columns (a view, no copy)."""
        vocab = self.config.vocab_size
        return padded if padded.shape[-1] == vocab else padded[..., :vocab]

    def new_cache(self, batch_size: int) -> KVCache:
        """An empty KV cache for `batch_size` sequences, on this model's device, in its (autocast) compute dtype."""
        weight = self.transformer.wte.weight
        return KVCache(self.config, batch_size, weight.device, compute_dtype(weight))

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 repetition_penalty: float = 1.0, generator: torch.Generator | None = None, use_cache: bool = True,
                 on_token: Callable[[Tensor], None] | None = None) -> Tensor:
        """Append max_new_tokens sampled tokens to input_ids (B, T) -> (B, T + max_new_tokens).

        Each step's logits, as transformers' generate processes them: repetition_penalty > 1 makes every token already
        in the sequence less likely (its logit divided by the penalty where positive, multiplied where negative: CTRL's
        penalty, transformers' repetition_penalty), then temperature == 0 picks the argmax, else the logits are divided
        by the temperature and sampled among the top_k likeliest (None: all); SAMPLING holds the defaults of the
        end-of-run sample. The context is cropped to the last n_positions tokens. use_cache: the
        prompt is read once and each new token attends to the cached keys and values (query length 1); once the
        context outgrows n_positions each step re-reads the cropped context, as without the cache. on_token(next_token
        (B, 1)) is called after each step (streaming). Call .eval() first unless dropout is wanted while sampling.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {top_k}")
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: none), got {repetition_penalty}")
        n_positions = self.config.n_positions
        cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(input_ids[:, -n_positions:])[0]
            elif cache is None or cache.length == n_positions:  # the prompt, or a context longer than the table
                cache = self.new_cache(input_ids.shape[0])
                logits = self(input_ids[:, -n_positions:], cache=cache)[0]
            else:
                logits = self(input_ids[:, -1:], cache=cache)[0]  # the newest token against the cache
            logits = logits[:, -1, :].float()  # (B, vocab_size)
            if repetition_penalty != 1.0:
                seen = logits.gather(1, input_ids)  # (B, T): the logits of the tokens so far
                logits = logits.scatter(1, input_ids, torch.where(seen < 0, seen * repetition_penalty,
                                                                  seen / repetition_penalty))
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
                    logits = logits.masked_fill(logits < kth_largest, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            input_ids = torch.cat([input_ids, next_token], dim=1)
            if on_token is not None:
                on_token(next_token)
        return input_ids

    def load_pretrained(self, init_from: str, position_extension: str = "repeat") -> str:
        """init_from= (flashtrain.train.model_init): hf:NAME_OR_DIR, a transformers GPT2LMHeadModel, or a flashtrain
        checkpoint or run directory, of this config's shape but for the number of positions; a shorter position table
        is extended (`extend_positions`). Returns the one-line note the run prints."""
        from flashtrain.models.pretrained_weights import load_gpt2_weights

        return load_gpt2_weights(self, self.config, init_from, position_extension, GPT2)

    def extend_positions(self, new_max: int, method: str = "repeat") -> None:
        """Grow the learned position table (transformer.wpe) to new_max positions by `method` (repeat | interpolate:
        flashtrain.models.position) and set config.n_positions; a new nn.Parameter: build the optimizer after this."""
        self.transformer.wpe = extended_table(self.transformer.wpe, new_max, method)
        self.config.n_positions = new_max

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (the tied lm_head is wte); exclude_embeddings drops wte and wpe, as HF does."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields each tensor once
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n
