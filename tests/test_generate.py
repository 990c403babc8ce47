"""GPT-2 generation with a KV cache: each new token is one query against the cached keys and values through the
attention entry (bottom-right causal alignment), token for token the same as re-reading the whole context."""

import pytest
import torch

from flashtrain.kernels import flash_attn_func
from flashtrain.models.attention import attention
from flashtrain.models.gpt2 import GPT2Config


def tiny_gpt2(attn_impl: str, n_positions: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT2Config(vocab_size=97, n_positions=n_positions, n_embd=48, n_layer=3, n_head=3,
                       attn_impl=attn_impl).build().eval()
    with torch.no_grad():  # larger weights than GPT-2's init: logits far apart, so greedy has no near ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


@pytest.mark.parametrize("attn_impl", ["reference", "sdpa"])
def test_cached_step_logits_equal_the_full_forward(attn_impl):
    model = tiny_gpt2(attn_impl)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    full = model(ids)[0]  # (2, 11, V)
    cache = model.new_cache(2)
    steps = [model(ids[:, :5], cache=cache)[0]] + [model(ids[:, t:t + 1], cache=cache)[0] for t in range(5, 11)]
    assert cache.length == 11
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_impl", ["reference", "sdpa", "flash"])
@pytest.mark.parametrize("prompt_len, new_tokens", [(1, 9), (5, 30)])  # 5 + 30 > n_positions = 16: the crop
@pytest.mark.slow
def test_cached_greedy_generation_equals_uncached(attn_impl, prompt_len, new_tokens):
    model = tiny_gpt2(attn_impl)
    prompt = torch.randint(0, 97, (2, prompt_len), generator=torch.Generator().manual_seed(2))
    uncached = model.generate(prompt, new_tokens, temperature=0.0, use_cache=False)
    streamed = []
    cached = model.generate(prompt, new_tokens, temperature=0.0, on_token=streamed.append)
    assert cached.tolist() == uncached.tolist()
    assert torch.cat(streamed, dim=1).tolist() == cached[:, prompt_len:].tolist()
    assert len(set(cached[0, prompt_len:].tolist())) > 1  # a real continuation, not one token repeated


def test_one_query_against_the_cache_is_the_last_row_of_causal_attention():
    """flash_attn_func with seqlen_q=1 and causal=True: the bottom-right alignment lets the query see every key."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 17, 4, 24, generator=g) for _ in range(3))
    full = flash_attn_func(q, k, v, causal=True, impl="reference")  # (2, 17, 4, 24)
    last = flash_attn_func(q[:, -1:], k, v, causal=True, impl="reference")  # (2, 1, 4, 24)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-5)
    # the SDPA path of the attention entry aligns the same way (PyTorch's is_causal alone would align top-left)
    torch.testing.assert_close(attention(q[:, -3:], k, v, "sdpa", causal=True), full[:, -3:], atol=1e-6, rtol=1e-5)
