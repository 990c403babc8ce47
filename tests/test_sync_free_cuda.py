"""GPU: a training step with our attention never waits for the GPU (no host syncs), and malformed cu_seqlens are
caught by the device assert while the kernels stay inside q / k.

    pytest -m cuda tests/test_sync_free_cuda.py

Each step runs once outside torch.cuda.set_sync_debug_mode("error") (first use compiles kernels, initialises the
optimizer state and allocator pools), then once inside it: any synchronising CUDA call (.item(), .tolist(), a blocking
copy, torch.nonzero, boolean indexing) raises there. The loader-side work (the Unpadding of a padded batch) is done
on the host batch by the data modules' collate functions (BERT: flashtrain.data.mlm.collate_with_unpadding,
flashtrain.data.documents.pad_collate) and moved with the batch by the trainer's to_device; the model is called as
the task's loss calls it.
"""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from flashtrain.data.documents import pad_collate
from flashtrain.data.mlm import collate_with_unpadding
from flashtrain.models.attention_variants import BlockSparseConfig
from flashtrain.models.bert import BertConfig
from flashtrain.models.gpt2 import GPT2Config
from flashtrain.models.lra import LRAConfig
from flashtrain.models.padding import Unpadding
from flashtrain.train.trainer import to_device

pytestmark = pytest.mark.cuda


def _gpt2_step_inputs(model):
    tokens = torch.randint(0, 1000, (2, 257), generator=torch.Generator().manual_seed(0))  # the host batch
    return lambda: model(tokens[:, :-1].to("cuda", non_blocking=True), tokens[:, 1:].to("cuda", non_blocking=True))[1]


def _bert_step_inputs(model):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([200, 131, 77, 5])
    attention_mask = (torch.arange(200)[None, :] < lengths[:, None]).long()  # (4, 200), right-padded
    input_ids = torch.randint(5, 1000, (4, 200), generator=generator) * attention_mask
    is_masked = (torch.rand(4, 200, generator=generator) < 0.15) & attention_mask.bool()
    is_masked[:, 1] = True  # every row predicts something
    labels = torch.where(is_masked, input_ids, -100)
    samples = [{"input_ids": i, "attention_mask": m, "labels": t} for i, m, t in zip(input_ids, attention_mask, labels)]
    host_batch = collate_with_unpadding(samples)  # the masked-LM loader's batch: its Unpadding built on the host
    assert isinstance(host_batch["unpadding"], Unpadding) and host_batch["unpadding"].masked_rows is not None

    def loss():
        batch = to_device(host_batch, "cuda")  # as the trainer moves it
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                     unpadding=batch["unpadding"])[1]  # as MaskedLMTask.loss calls the model

    return loss


def _bert_classification_step_inputs(model):
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(5, 1000, (n,), generator=generator), "labels": torch.tensor(n % 2)}
               for n in (200, 131, 77, 5)]
    host_batch = pad_collate(0)(samples)  # the document loader's batch, right-padded, its Unpadding built on the host
    assert isinstance(host_batch["unpadding"], Unpadding)

    def loss():
        batch = to_device(host_batch, "cuda")
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"],
                     unpadding=batch["unpadding"])[1]  # as DocumentClassificationTask.loss calls the model

    return loss


def _lra_step_inputs(model):
    tokens = torch.randint(1, 16, (4, 300), generator=torch.Generator().manual_seed(0))
    tokens[1, 250:], tokens[2, 17:], tokens[3, 129:] = 0, 0, 0  # right padding (pad_id 0)
    labels = torch.tensor([0, 3, 7, 9])

    def loss():
        unpadding = model.unpadding(tokens).to("cuda")
        return model(tokens.to("cuda", non_blocking=True), labels.to("cuda", non_blocking=True), unpadding)[1]

    return loss


BERT_SIZES = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
MODELS = {  # each config builds its model, as the trainer builds it (cfg.model.build())
    "gpt2": (GPT2Config(vocab_size=1000, n_positions=256, n_embd=128, n_layer=2, n_head=2, attn_dropout=0.1),
             _gpt2_step_inputs),
    "bert": (BertConfig(**BERT_SIZES, head="masked_lm"), _bert_step_inputs),
    "bert_classification": (BertConfig(**BERT_SIZES, head="classification"), _bert_classification_step_inputs),
    "lra": (LRAConfig(vocab_size=16, max_len=512, n_layer=2, n_head=2, d_model=128, d_ff=256,
                      attention=BlockSparseConfig("local_global", 1, 1)), _lra_step_inputs),
}


@pytest.mark.parametrize("name", MODELS)
def test_training_step_never_syncs(name):
    from flashtrain.kernels import ops

    reason = ops.unavailable_reason(torch.device("cuda"), head_dim=64, dtype=torch.bfloat16, block_mask=name == "lra")
    assert reason is None, reason  # the step below runs our kernel, not the reference
    torch.manual_seed(0)
    config, step_inputs = MODELS[name]
    # (the LRA config names its block-sparse preset first: "block_sparse local_global: flash -> kernel")
    assert config.attention_backend(torch.device("cuda"), torch.bfloat16).endswith("flash -> kernel")
    model = config.build().cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loss_of_batch = step_inputs(model)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of_batch()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = step()  # compiles kernels, builds optimizer state: may synchronise
    before = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert math.isfinite(first.item()) and math.isfinite(second.item())
    changed = sum(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert changed == len(before)  # the synchronisation-free step did update every parameter


def test_bad_cu_seqlens_on_the_gpu_stop_with_the_argument_named():
    """A device assert kills the CUDA context, so the bad call runs in its own process."""
    script = textwrap.dedent("""
        import torch
        from flashtrain.kernels import flash_attn_varlen_func
        q = torch.randn(30, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(20, 2, 64, device="cuda", dtype=torch.bfloat16)
        good = torch.tensor([0, 10, 30], dtype=torch.int32, device="cuda")
        bad = torch.tensor([1, 5, 20], dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(q, k, k, good, bad, 20, 15, impl="cuda")
        torch.cuda.synchronize()
        print("NOT RAISED")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "NOT RAISED" not in output
    assert "device-side assert" in output and "cu_seqlens_k must start at 0" in output, output[-3000:]


def test_kernels_stay_inside_q_and_k_whatever_cu_seqlens_hold():
    """cu_seqlens past the packed total and sequences longer than max_seqlen (the device assert fires only after the
    kernels ran): the kernels clamp each sequence to [0, total) and max_seqlen rows, so they never read the NaN guard
    rows around q, k, v and compute exactly what the clamped sequences give."""
    from flashtrain.kernels import ops

    guard, total_q, total_k, heads, head_dim = 64, 150, 200, 2, 64
    generator = torch.Generator("cuda").manual_seed(0)

    def guarded(rows):  # (rows, heads, head_dim) inside a NaN buffer with `guard` rows on each side
        buffer = torch.full((rows + 2 * guard, heads, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
        inner = buffer[guard:guard + rows]
        inner.copy_(torch.randn(inner.shape, device="cuda", generator=generator))
        return inner

    q, k, v = guarded(total_q), guarded(total_k), guarded(total_k)
    dout = torch.randn(q.shape, device="cuda", generator=generator, dtype=torch.bfloat16)
    bad_q = torch.tensor([0, 100, 350], dtype=torch.int32, device="cuda")  # clamped: rows [0, 80), [100, 150)
    bad_k = torch.tensor([0, 120, 400], dtype=torch.int32, device="cuda")  # clamped: rows [0, 90), [120, 200)
    rows_q = torch.cat([torch.arange(0, 80), torch.arange(100, 150)]).cuda()
    rows_k = torch.cat([torch.arange(0, 90), torch.arange(120, 200)]).cuda()
    good_q = torch.tensor([0, 80, 130], dtype=torch.int32, device="cuda")
    good_k = torch.tensor([0, 90, 170], dtype=torch.int32, device="cuda")

    def run(q, k, v, dout, cu_q, cu_k):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out, lse = ops.flash_attn_cuda(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=80,
                                       max_seqlen_k=90, dropout_p=0.0, softmax_scale=0.125, causal=True,
                                       generator=None, deterministic=True)
        out.backward(dout)
        return out.detach(), lse, q.grad, k.grad, v.grad

    clamped = run(q, k, v, dout, bad_q, bad_k)
    expected = run(q[rows_q], k[rows_k], v[rows_k], dout[rows_q], good_q, good_k)
    out, lse, dq, dk, dv = clamped
    got = (out[rows_q], lse[:, rows_q], dq[rows_q], dk[rows_k], dv[rows_k])
    for name, value, want in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(value).all(), f"{name}: a NaN guard row was read"
        assert torch.equal(value, want), name
