"""attn_implementation="ft_attention" (flashtrain's attention): a tiny random Llama (GQA, causal) from transformers runs its attention through
flashtrain's API (the reference on the CPU) with the logits and gradients of attn_implementation="sdpa"."""

import copy

import pytest
import torch
import transformers

from flashtrain.models.hf_attention import NAME, register

register()


def llama_pair(**overrides):
    """The same random tiny Llama twice: attention through flashtrain and through PyTorch's SDPA."""
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                      **overrides)  # head_dim 16, 3 query heads per key/value head
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == NAME and theirs.config._attn_implementation == "sdpa"
    return ours, theirs


@pytest.fixture
def api_calls(monkeypatch):
    """(function name, q shape) of every call the registered attention makes to flashtrain's API."""
    import flashtrain.models.hf_attention as hf_attention

    calls = []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        def counting(*args, _name=name, _original=getattr(hf_attention, name), **kwargs):
            calls.append((_name, tuple(args[0].shape)))
            return _original(*args, **kwargs)
        monkeypatch.setattr(hf_attention, name, counting)
    return calls


def test_logits_and_gradients_equal_sdpa(api_calls):
    ours, theirs = llama_pair()
    input_ids = torch.randint(0, 101, (2, 37), generator=torch.Generator().manual_seed(1))
    out_ours = ours(input_ids, labels=input_ids)
    out_theirs = theirs(input_ids, labels=input_ids)
    assert api_calls == [("flash_attn_func", (2, 37, 6, 16))] * 2  # both layers, the query heads as they are
    torch.testing.assert_close(out_ours.logits, out_theirs.logits, atol=2e-5, rtol=1e-4)
    out_ours.loss.backward()
    out_theirs.loss.backward()
    grads_theirs = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, grads_theirs[name].grad, atol=2e-5, rtol=1e-4, msg=name)


def test_autocast_runs_attention_in_its_dtype(monkeypatch):
    """Under bf16 autocast with fp32 weights (mixed-precision training) the rotary embedding hands fp32 queries and
    keys over; they reach flashtrain's API in bf16, as SDPA's reach it, with SDPA's bf16 error against fp32."""
    import flashtrain.models.hf_attention as hf_attention

    dtypes = []
    original = hf_attention.flash_attn_func
    monkeypatch.setattr(hf_attention, "flash_attn_func",
                        lambda q, *args, **kwargs: dtypes.append(q.dtype) or original(q, *args, **kwargs))
    ours, theirs = llama_pair()
    input_ids = torch.randint(0, 101, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = theirs(input_ids).logits  # fp32 throughout
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits_ours, logits_theirs = ours(input_ids).logits, theirs(input_ids).logits
    assert dtypes == [torch.bfloat16] * 2 and logits_ours.dtype == torch.bfloat16

    def error(x):
        return (x.float() - reference).abs().max().item()

    assert 0 < error(logits_ours) <= 2 * error(logits_theirs) + 1e-3


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_padded_batch_equals_sdpa_at_real_tokens(padding_side, api_calls):
    ours, theirs = llama_pair()
    lengths = [23, 9, 17]
    T = max(lengths)
    mask = torch.zeros(3, T, dtype=torch.long)
    for row, n in enumerate(lengths):
        if padding_side == "left":
            mask[row, T - n:] = 1
        else:
            mask[row, :n] = 1
    input_ids = torch.randint(0, 101, (3, T), generator=torch.Generator().manual_seed(2)) * mask
    with torch.no_grad():
        logits_ours = ours(input_ids, attention_mask=mask).logits
        logits_theirs = theirs(input_ids, attention_mask=mask).logits
    assert api_calls == [("flash_attn_varlen_func", (sum(lengths), 6, 16))] * 2  # unpadded
    real = mask.bool()
    torch.testing.assert_close(logits_ours[real], logits_theirs[real], atol=2e-5, rtol=1e-4)


def test_cached_generation_equals_sdpa(api_calls):
    """Left-padded prompts, greedy, through transformers' KV cache: each new token is a query of length 1."""
    ours, theirs = llama_pair()
    input_ids = torch.randint(1, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    mask[1, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=15, min_new_tokens=15, do_sample=False, pad_token_id=0)
    assert ours.generate(input_ids, **kwargs).tolist() == theirs.generate(input_ids, **kwargs).tolist()
    # the prompt, then one query per sequence against the cache, in each of the 2 layers
    assert api_calls == [("flash_attn_varlen_func", (24 - 5, 6, 16))] * 2 + \
        [("flash_attn_varlen_func", (2, 6, 16))] * 2 * 14


@pytest.mark.cuda
def test_cuda_kernel_matches_sdpa_in_bf16():
    """On a GPU the CUDA kernel runs it: bf16 logits and gradients within 2x the error of SDPA's own bf16 run (both
    against SDPA in fp32)."""
    ours, theirs = llama_pair()
    reference = copy.deepcopy(theirs).cuda()
    ours, theirs = ours.cuda().bfloat16(), theirs.cuda().bfloat16()
    input_ids = torch.randint(0, 101, (2, 200), generator=torch.Generator().manual_seed(4)).cuda()
    out_ref, out_ours, out_theirs = (m(input_ids, labels=input_ids) for m in (reference, ours, theirs))
    for out in (out_ref, out_ours, out_theirs):
        out.loss.backward()

    def error(x, y):
        return (x.float() - y.float()).abs().max().item()

    assert error(out_ours.logits, out_ref.logits) <= 2 * error(out_theirs.logits, out_ref.logits) + 1e-3
    grads_ref, grads_theirs = dict(reference.named_parameters()), dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert error(param.grad, grads_ref[name].grad) <= 2 * error(grads_theirs[name].grad, grads_ref[name].grad) \
            + 1e-3, name


@pytest.mark.cuda
def test_cuda_kernel_under_autocast_matches_sdpa():
    """fp32 weights under bf16 autocast (mixed-precision training): the kernel gets bf16 queries, keys and values (a
    Llama's rotary embedding hands fp32 ones over) and its logits and gradients stay within 2x SDPA's autocast error."""
    ours, theirs = llama_pair()
    reference = copy.deepcopy(theirs).cuda()
    ours, theirs = ours.cuda(), theirs.cuda()
    input_ids = torch.randint(0, 101, (2, 200), generator=torch.Generator().manual_seed(5)).cuda()
    out_ref = reference(input_ids, labels=input_ids)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_ours, out_theirs = ours(input_ids, labels=input_ids), theirs(input_ids, labels=input_ids)
    for out in (out_ref, out_ours, out_theirs):
        out.loss.backward()

    def error(x, y):
        return (x.float() - y.float()).abs().max().item()

    assert error(out_ours.logits, out_ref.logits) <= 2 * error(out_theirs.logits, out_ref.logits) + 1e-3
    grads_ref, grads_theirs = dict(reference.named_parameters()), dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert error(param.grad, grads_ref[name].grad) <= 2 * error(grads_theirs[name].grad, grads_ref[name].grad) \
            + 1e-3, name
