"""flashtrain's attention for transformers models: `register()` adds attn_implementation="ft_attention".

    from flashtrain.models.hf_attention import register; register()
    model = AutoModelForCausalLM.from_pretrained(NAME, attn_implementation="ft_attention")

The name has no "flash" in it: transformers takes every attn_implementation containing "flash" for a FlashAttention
package or Hub kernel (`transformers.utils.generic.is_flash_attention_requested`) and tries to import one.

transformers (4.5x / 5.x) looks attention functions up by name in its `AttentionInterface` and the matching mask
builder in its `AttentionMaskInterface`. The mask builder registered here is transformers' own FlashAttention one: no
mask at all when no token is padding, else the 2D (B, kv_len) padding mask. The attention function then runs
`flash_attn_func` (no padding) or unpads the batch and runs `flash_attn_varlen_func` (padding, left or right), causal
aligned to the bottom-right corner, so a decoding step (query length 1 against the KV cache) is exact. GQA / MQA key
and value heads are passed as they are. A layer's `sliding_window` (Mistral, Gemma 2: W tokens, the query and the
W - 1 before it) becomes window_size (W - 1, 0), and `softcap` (Gemma 2's attention logit softcapping) flashtrain's
softcap, both applied to the scaled scores as transformers' eager attention applies them. Under autocast, query, key
and value are cast to its dtype first, as SDPA's are (a Llama's rotary embedding hands fp32 queries and keys to
attention under bf16 autocast). On CUDA tensors the kernel runs (it raises with the reason where it cannot: fp32
without autocast, an unsupported head dim); on CPU tensors the plain-PyTorch reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func
from flashtrain.models.attention import KERNEL, attention_features, backend, compute_dtype
from flashtrain.models.padding import Unpadding, pad_packed

NAME = "ft_attention"  # what attn_implementation= names


def flashtrain_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                 attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                                 is_causal: bool | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query (B, H, Tq, D), key / value (B, H_kv, Tk, D), attention_mask
    None or (B, Tk) bool, True at real tokens -> (output (B, Tq, H, D), no attention weights)."""
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='ft_attention' never forms the attention matrix: output_attentions is "
                         "not available (use attn_implementation='eager')")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attn_implementation='ft_attention' does not support s_aux (attention sinks; this model sets "
                         "it)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = score_options(kwargs.get("sliding_window"), kwargs.get("softcap"), causal)
    # under autocast, in its dtype, as SDPA: rotary embeddings hand over fp32 queries and keys from bf16 projections
    dtype = compute_dtype(query)
    # raises where the kernel cannot run (a head dim, a dtype, or an option it lacks)
    chosen, _ = backend("flash", query.device, dtype, query.shape[-1], features=attention_features(**options,
                                                                                                  causal=causal))
    impl = "cuda" if chosen == KERNEL else "reference"
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))  # (B, T, heads, D)
    if attention_mask is None:
        out = flash_attn_func(q, k, v, dropout, softmax_scale=scaling, causal=causal, impl=impl, **options)
        return out, None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected None or (batch, kv_len) from the 'ft_attention' mask builder, got "
                         f"shape {tuple(attention_mask.shape)}")
    B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
    # the queries are the last Tq of the Tk tokens (prefill: all of them; decoding: the newest)
    unpad_q, unpad_k = Unpadding.of(attention_mask[:, -Tq:]), Unpadding.of(attention_mask)
    out = flash_attn_varlen_func(q.flatten(0, 1)[unpad_q.indices], k.flatten(0, 1)[unpad_k.indices],
                                 v.flatten(0, 1)[unpad_k.indices], unpad_q.cu_seqlens, unpad_k.cu_seqlens, Tq, Tk,
                                 dropout, softmax_scale=scaling, causal=causal, impl=impl, **options)  # (total_q, H, D)
    return pad_packed(out, unpad_q.indices, B, Tq), None  # zeros at padded queries


def score_options(sliding_window: int | None, softcap: float | None, causal: bool) -> dict:
    """flash_attn_func's window_size / softcap for transformers' sliding_window (W tokens: the query and the W - 1
    before it; without causal W - 1 on each side, as its FlashAttention path: ModernBERT hands W = its mask's
    half-width + 1) and softcap (s -> softcap * tanh(s / softcap) of the scaled scores); {} for neither."""
    options = {}
    if sliding_window is not None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 token (the query itself), got {sliding_window}")
        options["window_size"] = (sliding_window - 1, 0 if causal else sliding_window - 1)
    if softcap:  # None or 0: none
        options["softcap"] = float(softcap)
    return options


def register() -> None:
    """Make attn_implementation="ft_attention" available to every transformers model (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, flashtrain_attention_forward)
    # the mask transformers builds for FlashAttention-2: None without padding, else the 2D padding mask
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
