"""A Llama-style decoder (Touvron et al. 2023) on flashtrain's attention, single device.

Pre-norm blocks with RMSNorm, rotary position embeddings (flashtrain.models.rope: plain, or stretched for a longer
context by `rope_scaling`), grouped-query attention (n_kv_head key / value heads shared by n_head query heads), a
SwiGLU MLP, no biases, the token table optionally tied to the LM head, and optional sliding-window attention on some
or all layers. Parameter names and layouts are Hugging Face's LlamaForCausalLM's (`model.layers.N.self_attn.q_proj`,
...), so converting a state dict is the identity but for the tied head (flashtrain.models.hf_convert).

Positions come from `position_ids` (B, T) when given -- documents packed with their positions reset, or a context-
parallel rank's share of a sequence -- else they are 0 .. T - 1 (after the cached tokens when generating); each
selects a row of the cos / sin tables, so any positions below n_positions work.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from flashtrain.models import gpt2
from flashtrain.models.attention import (SDPA, attention, attention_features, backend, check_attn_impl, check_backend,
                                         compute_dtype)
from flashtrain.models.flops import training_flops_per_token
from flashtrain.models.losses import cross_entropy, linear_cross_entropy, padded_logits
from flashtrain.models.rope import RopeScaling, apply_rope, rope_tables
from flashtrain.models.tying import tie_weights

# extend_positions' methods: repeat keeps the frequencies (extrapolation), interpolate is position interpolation
# (rope_scaling type linear), and the rope_scaling types by name
EXTENSIONS = ("repeat", "interpolate", "linear", "ntk", "yarn")
# config fields that weights from init_from must share with the run's model (n_positions and rope_scaling may differ)
_SHAPE_FIELDS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_kv_head", "intermediate_size", "tie_embeddings",
                 "rope_theta", "norm_eps")


@dataclass
class LlamaConfig:
    vocab_size: int = 32000  # tokens in the vocabulary
    n_positions: int = 2048  # longest sequence: rows of the RoPE tables (transformers' max_position_embeddings)
    n_embd: int = 768  # model width
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # query heads; head_dim = n_embd // n_head (even: RoPE turns pairs)
    n_kv_head: int = 4  # key / value heads, each shared by n_head / n_kv_head query heads (GQA; n_head: MHA; 1: MQA)
    intermediate_size: int = 2048  # width of the SwiGLU MLP (gate and up projections)
    rope_theta: float = 10000.0  # RoPE base: dimension pair i turns by position * rope_theta ** (-2i / head_dim)
    # a longer context from RoPE's frequencies: {type: linear | ntk | yarn | llama3, factor, ...}
    # (flashtrain.models.rope.RopeScaling); type default: plain RoPE
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # the LM head is the token table (one tensor); false: a head of its own
    # the training loss a chunk of tokens at a time, without the (B, T, vocab) logits (flashtrain.models.losses)
    chunked_loss: bool = False
    # the LM head's matmuls run on the vocabulary padded with zero rows to a multiple of this, the logits sliced back
    # (as GPT-2's: aligned GEMM shapes, the same values); 1: no padding
    vocab_multiple: int = 128
    # the loss on flashtrain's cross-entropy kernels on CUDA (flashtrain.kernels.cross_entropy); False:
    # F.cross_entropy of the float32 logits
    fused_loss: bool = True
    attn_impl: str = "flash"  # flash | sdpa | reference | auto (flashtrain.models.attention)
    # sliding-window attention: each token of a windowed layer attends to itself and the attn_window tokens before it;
    # -1: no window anywhere. Which layers: window_layers, else every layer but each global_every-th
    attn_window: int = -1
    window_layers: Optional[List[int]] = None  # the windowed layers' indices (null: global_every decides)
    # layers global_every - 1, 2 * global_every - 1, ... attend to every token before them, the others through the
    # window (Gemma 2's alternation: 2; Gemma 3's five local to one global: 6); 0: every layer has the window
    global_every: int = 0

    def __post_init__(self):
        check_attn_impl(self.attn_impl)
        sizes = dict(vocab_size=self.vocab_size, n_positions=self.n_positions, n_embd=self.n_embd,
                     n_layer=self.n_layer, n_head=self.n_head, n_kv_head=self.n_kv_head,
                     intermediate_size=self.intermediate_size, vocab_multiple=self.vocab_multiple)
        for name, size in sizes.items():
            if size <= 0:
                raise ValueError(f"{name} must be positive, got {size}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd ({self.n_embd}) must be n_head ({self.n_head}) times an even head_dim")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        if self.attn_window < -1:
            raise ValueError(f"attn_window must be >= 0 tokens, or -1 for none, got {self.attn_window}")
        if self.global_every < 0:
            raise ValueError(f"global_every must be >= 0 (0: the window on every layer), got {self.global_every}")
        if self.window_layers is not None:
            if self.global_every:
                raise ValueError("window_layers and global_every both choose the windowed layers: set one of them")
            if sorted(set(self.window_layers)) != sorted(self.window_layers) or \
                    not all(0 <= i < self.n_layer for i in self.window_layers):
                raise ValueError(f"window_layers must be distinct layer indices in [0, {self.n_layer}), got "
                                 f"{list(self.window_layers)}")
        if self.attn_window == -1 and (self.window_layers is not None or self.global_every):
            raise ValueError("window_layers / global_every choose the layers of a sliding window, and attn_window is "
                             "-1 (none): set attn_window")

    def build(self) -> "Llama":
        return Llama(self)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def layer_windows(self) -> list[int]:
        """Each layer's sliding window in tokens before the query (-1: it attends to every token before it)."""
        if self.attn_window == -1:
            return [-1] * self.n_layer
        if self.window_layers is not None:
            windowed = set(self.window_layers)
        else:
            windowed = {i for i in range(self.n_layer) if self.global_every == 0 or (i + 1) % self.global_every}
        return [self.attn_window if i in windowed else -1 for i in range(self.n_layer)]

    def attention_backend(self, device: torch.device, dtype: torch.dtype) -> str:
        features = attention_features(window_size=(max(self.layer_windows()), 0), causal=True)
        return check_backend(self.attn_impl, device, dtype, self.head_dim, features=features)

    def check_data(self, data) -> None:
        """Raise ValueError when the data (a flashtrain.data.task.DataSpec) is not next-token prediction this model
        can read; fields that are None (a preview) are not checked."""
        problems = []
        if data.task != "causal_lm":
            problems.append(f"the Llama decoder predicts the next token (causal_lm data); the data is {data.task}")
        elif data.document_mask and self.attn_impl == "sdpa":
            problems.append("data.document_mask=true keeps attention inside each document through cu_seqlens "
                            "(varlen attention), which attn_impl=sdpa does not take: use flash, reference or auto")
        if data.vocab_size > self.vocab_size:
            problems.append(f"the tokenizer has {data.vocab_size} tokens, model.vocab_size={self.vocab_size}")
        if data.max_length is not None and data.max_length > self.n_positions:
            problems.append(f"{data.length_field}={data.max_length} is longer than model.n_positions="
                            f"{self.n_positions}")
        if problems:
            raise ValueError("; ".join(problems))


class KVCache(gpt2.KVCache):
    """GPT-2's cache (filled from the left, `update` per layer) with n_kv_head heads: the keys are stored rotated,
    one (B, n_positions, n_kv_head, head_dim) buffer per layer and per k / v."""

    def __init__(self, config: LlamaConfig, batch_size: int, device: torch.device, dtype: torch.dtype):
        shape = (config.n_layer, batch_size, config.n_positions, config.n_kv_head, config.head_dim)
        self.keys, self.values = (torch.empty(shape, device=device, dtype=dtype) for _ in range(2))
        self.length = 0


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, the statistics in float32 at least (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: LlamaConfig, window: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.attn_impl = config.attn_impl
        self.window_size = (window, 0)  # (-1, 0) is plain causal attention
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, layer: int = 0,
                cu_seqlens: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_head, self.head_dim), cos, sin)  # (B, T, H, D)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim), cos, sin)  # (B, T, H_kv, D)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        if cu_seqlens is not None:  # documents packed in the B * T rows: each attends to itself only
            y = attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), self.attn_impl, causal=True,
                          cu_seqlens=cu_seqlens, max_seqlen=T, window_size=self.window_size)  # (B * T, H, D)
            return self.o_proj(y.view(B, T, -1))
        if cache is not None:  # the cached tokens' keys and values too: (B, cache.length + T, H_kv, D)
            k, v = cache.update(layer, k, v)
        if self.n_kv_head != self.n_head and self._runs_sdpa(q):
            # the attention entry hands SDPA equal head counts: each key / value head repeated for its query heads
            k, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=2) for t in (k, v))
        # causal aligns to the bottom-right corner: query t of T sees every cached key and the new ones up to t
        y = attention(q, k, v, self.attn_impl, causal=True, window_size=self.window_size)  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, -1))

    def _runs_sdpa(self, q: Tensor) -> bool:
        features = attention_features(window_size=self.window_size, causal=True)
        return backend(self.attn_impl, q.device, q.dtype, self.head_dim, features=features)[0] == SDPA


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig, window: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.self_attn = SelfAttention(config, window)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, layer: int = 0,
                cu_seqlens: Tensor | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, cu_seqlens)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    # the repeated unit: FSDP shards each LlamaBlock on its own; trainer.activation_checkpointing recomputes per block
    _no_split_modules = ["LlamaBlock"]

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, config.n_embd),
            layers=nn.ModuleList(LlamaBlock(config, window) for window in config.layer_windows()),
            norm=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            tie_weights(self, "lm_head.weight", "model.embed_tokens.weight")  # one tensor, saved as embed_tokens
        self._set_rope_tables()
        self.apply(gpt2.GPT2._init_weights)  # normal(0, 0.02)
        # residual projections scaled by 1/sqrt(N), N = 2 residual branches per block (GPT-2's rule)
        for block in self.model.layers:
            for proj in (block.self_attn.o_proj, block.mlp.down_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _set_rope_tables(self) -> None:
        """cos / sin (n_positions, head_dim / 2) of the config's RoPE, float64 (rotations run in float32 at least,
        flashtrain.models.rope.apply_rope); buffers outside the state dict: the config is what defines them."""
        c = self.config
        device = self.model.embed_tokens.weight.device
        cos, sin = rope_tables(c.n_positions, c.head_dim, c.rope_theta, c.rope_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, cache: KVCache | None = None,
                cu_seqlens: Tensor | None = None, position_ids: Tensor | None = None) -> tuple[Tensor | None,
                                                                                               Tensor | None]:
        """input_ids (B, T) -> (logits (B, T, vocab_size), mean cross-entropy or None), as GPT2.forward: targets
        (B, T) already shifted, -100 ignored; with targets and a padded vocabulary the logits come back detached;
        config.chunked_loss: logits None. cache: input_ids continue the cache.length tokens in it. cu_seqlens (n + 1,)
        int32: the documents packed in the flattened B * T tokens (data.document_mask), not with a cache.
        position_ids (B, T): each token's position (data.reset_positions, context parallelism); default 0 .. T - 1
        after the cached tokens."""
        past = 0 if cache is None else cache.length
        self._check_inputs(input_ids, past, targets, cache, cu_seqlens, position_ids)
        T = input_ids.shape[1]
        positions = torch.arange(past, past + T, device=input_ids.device) if position_ids is None else position_ids
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        # (T or B, T, D / 2), cast once for every layer's rotation (float32 at least: apply_rope)
        rope_dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = self.rope_cos[positions].to(rope_dtype), self.rope_sin[positions].to(rope_dtype)
        for layer, block in enumerate(self.model.layers):
            x = block(x, cos, sin, cache, layer, cu_seqlens)
        if cache is not None:
            cache.length = past + T
        return self._logits_and_loss(self.model.norm(x), targets)

    def _check_inputs(self, input_ids: Tensor, past: int, targets: Tensor | None, cache: KVCache | None,
                      cu_seqlens: Tensor | None, position_ids: Tensor | None) -> None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        if past + input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"input_ids has {input_ids.shape[1]} tokens after {past} cached ones, more than "
                             f"n_positions={self.config.n_positions}")
        for name, tensor in (("targets", targets), ("position_ids", position_ids)):
            if tensor is not None and tensor.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(tensor.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}")
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cu_seqlens (documents packed in a batch) does not go with a KV cache")

    def _logits_and_loss(self, x: Tensor, targets: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The head on the final hidden states x (B, T, C): (logits, loss) as forward returns them."""
        c, weight = self.config, self.lm_head.weight
        if targets is None:
            return self._unpadded(padded_logits(x, weight, c.vocab_multiple)), None
        if c.chunked_loss:
            return None, linear_cross_entropy(x.flatten(0, 1), weight, targets.flatten())
        padded = padded_logits(x, weight, c.vocab_multiple)  # (B, T, padded vocab)
        loss = cross_entropy(padded.flatten(0, 1), targets.flatten(), c.vocab_size, ignore_index=-100,
                             fused=c.fused_loss)  # float32
        # a padded vocabulary's logits are a slice: detached (the loss is what trains; see GPT2.forward)
        return (padded if padded.shape[-1] == c.vocab_size else self._unpadded(padded.detach())), loss

    _unpadded = gpt2.GPT2._unpadded
    # GPT-2's sampling loop: it reads config.n_positions, new_cache() and forward(input_ids, cache=cache)
    generate = gpt2.GPT2.generate

    def new_cache(self, batch_size: int) -> KVCache:
        """An empty KV cache for `batch_size` sequences, on this model's device, in its (autocast) compute dtype."""
        weight = self.model.embed_tokens.weight
        return KVCache(self.config, batch_size, weight.device, compute_dtype(weight))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at seq_len tokens per sequence (default n_positions; flashtrain.models.flops): an
        untied token table is a lookup; a windowed layer's attention counts the share of the square its band covers."""
        c = self.config
        seq_len = seq_len or c.n_positions
        fraction = sum(1.0 if w < 0 else min(1.0, 2 * (w + 1) / seq_len) for w in c.layer_windows()) / c.n_layer
        lookups = [] if c.tie_embeddings else [self.model.embed_tokens]
        return training_flops_per_token(self, lookups, c.n_layer, c.n_embd, seq_len, fraction)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (a tied lm_head is the token table); exclude_embeddings drops the token table, as
        transformers does."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.model.embed_tokens.weight.numel() if exclude_embeddings else n

    def extend_positions(self, new_max: int, method: str = "repeat") -> None:
        """Take inputs of up to new_max tokens (config.n_positions). RoPE has no table of weights to grow; `method`
        says what the frequencies do: repeat keeps them (positions past the old end are extrapolated; the first
        n_positions compute what they did, as GPT-2's repeat keeps its rows), interpolate is position interpolation
        (rope_scaling type linear), linear / ntk / yarn set that rope_scaling with factor new_max / n_positions
        (original_max_position_embeddings: the old n_positions). Updates the config; no parameter changes."""
        c = self.config
        if method not in EXTENSIONS:
            raise ValueError(f"method must be one of {EXTENSIONS}, got {method!r}")
        if new_max <= c.n_positions:
            raise ValueError(f"new_max must exceed n_positions={c.n_positions}, got {new_max}")
        if method != "repeat":
            if c.rope_scaling.type != "default":
                raise ValueError(f"extend_positions(method={method!r}): the frequencies are already scaled "
                                 f"(rope_scaling {c.rope_scaling.describe()}); stretch them once, from plain RoPE")
            c.rope_scaling = RopeScaling("linear" if method == "interpolate" else method, new_max / c.n_positions,
                                         original_max_position_embeddings=c.n_positions)
        c.n_positions = new_max
        self._set_rope_tables()

    def load_pretrained(self, init_from: str, position_extension: str = "repeat") -> str:
        """init_from= (flashtrain.train.model_init): hf:NAME_OR_DIR (a transformers LlamaForCausalLM) or a flashtrain
        Llama checkpoint / run directory, of this config's shapes and rope_theta. Its weights do not depend on the
        context, so a longer run needs no new weights; the run's own n_positions and rope_scaling decide its RoPE,
        and the config saved with the run says so: a source of fewer positions is extrapolated (repeat), or extended
        by the run's model.rope_scaling (a source with rope_scaling must have the run's). Returns the run's note."""
        source, state = self._pretrained_source(init_from)
        c = self.config
        differ = [f"model.{name}={getattr(c, name)!r} (init_from: {source[name]!r})" for name in _SHAPE_FIELDS
                  if source.get(name) != getattr(c, name)]
        if differ:
            raise ValueError(f"init_from={init_from!r} does not fit the run's model: {', '.join(differ)}")
        scaling = asdict(c.rope_scaling)
        if source["rope_scaling"]["type"] != "default" and source["rope_scaling"] != scaling:
            raise ValueError(f"init_from={init_from!r} has rope_scaling {source['rope_scaling']}; the run's "
                             f"model.rope_scaling={scaling} must be the same (a further extension: from plain RoPE)")
        if position_extension == "interpolate" and c.rope_scaling.type != "linear":
            n_source = source["n_positions"]
            raise ValueError(
                f"init_position_extension=interpolate: RoPE's position interpolation is model.rope_scaling, which the "
                f"run's saved config must carry: set model.rope_scaling={{type: linear, factor: "
                f"{c.n_positions / n_source:g}, original_max_position_embeddings: {n_source}}} (or type ntk / yarn) "
                f"and leave init_position_extension=repeat")
        self.load_state_dict(state)
        note = f"initialised from {init_from}"
        if source["n_positions"] < c.n_positions:
            how = "RoPE extrapolated" if c.rope_scaling.type == "default" else f"RoPE {c.rope_scaling.describe()}"
            note += f", positions {source['n_positions']} -> {c.n_positions} ({how})"
        return note

    def _pretrained_source(self, init_from: str) -> tuple[dict, dict[str, Tensor]]:
        """(the source's model config as a dict, its state dict) of init_from: hf:NAME_OR_DIR through the Hugging Face
        adapter, or a flashtrain checkpoint (its config from the checkpoint's manifest)."""
        if init_from.startswith("hf:"):
            import transformers

            from flashtrain.models.hf_adapters import from_pretrained_hf
            from flashtrain.pretrained import resolve_pretrained_path

            path = resolve_pretrained_path(init_from[len("hf:"):])
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            source = from_pretrained_hf(type(self), hf_model, attn_impl=self.config.attn_impl)
            return asdict(source.config), source.state_dict()
        from flashtrain.models.pretrained_weights import checkpoint_weights
        from flashtrain.train.checkpoint import read_manifest

        ckpt, state = checkpoint_weights(init_from)
        saved = read_manifest(ckpt)["config"]
        if saved.get("model") != type(self.config).__name__:
            raise ValueError(f"init_from={init_from!r} is a checkpoint of {saved.get('model')}, not of a "
                             f"{type(self.config).__name__} model")
        return {key.removeprefix("model."): value for key, value in saved.items() if key.startswith("model.")}, state

