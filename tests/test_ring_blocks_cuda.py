"""GPU, one process: the ring's compute on the CUDA kernels with every rank simulated in this process. Rank r's
queries meet the key / value block of rank (r - s) % world at step s (flashtrain.parallel.blockwise.ring_schedule),
block_forward's partial results are merged by merge_block, and block_backward's dQ stays at r while dK / dV go to the
block's owner: ring_attention's data flow without the transfers (which need one GPU per rank and NCCL,
tests/test_ring_attention.py). Gathered out, lse, dq, dk, dv must meet FlashAttention-2's rule against the float32
reference (tests/test_cuda_kernels.py: at most twice the single-process kernel's error), for every case of
tests/ring_attention_worker.py at 2 and 4 simulated ranks, and for a long GQA case with documents.

    pytest -m cuda tests/test_ring_blocks_cuda.py
"""

import math

import pytest
import torch

import ring_attention_worker as worker
from flashtrain.parallel.blockwise import block_backward, block_forward, merge_block, ring_schedule
from flashtrain.parallel.ring_attention import shard_sequence
from test_ring_attention import RESULTS, single_process

pytestmark = pytest.mark.cuda


def simulated_ring(q, k, v, dout, dlse, *, world, layout, causal, scale, offsets, with_lse, cuda=True):
    """out, lse, dq, dk, dv of the full sequences, computed rank by rank as ring_attention does (cuda False: the blocks
    on the reference, accumulating in q's dtype if float64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, seqlen, nheads, head_dim = q.shape
    nheads_kv = k.shape[2]
    scale = scale or head_dim ** -0.5
    rows = batch * seqlen // world
    shard = [[shard_sequence(x, 2 if i == 4 else 1, r, world, layout) for i, x in enumerate((q, k, v, dout, dlse))]
             for r in range(world)]
    packed = [[x.reshape(rows, x.shape[2], head_dim) for x in s[:4]] + [s[4].transpose(0, 1).reshape(nheads, rows)]
              for s in shard]
    outs, lses = [], []
    for r in range(world):  # forward
        out = torch.zeros(rows, nheads, head_dim, device=q.device, dtype=acc)
        lse = torch.full((nheads, rows), -math.inf, device=q.device, dtype=acc)
        for step, calls in enumerate(ring_schedule(batch, seqlen, world, r, layout, causal, offsets)):
            keys, values = packed[(r - step) % world][1:3]
            for call in calls:
                block_out, block_lse = block_forward(call.q_rows.take(packed[r][0]), call.k_rows.take(keys),
                                                     call.k_rows.take(values), call, scale, cuda, False)
                merge_block(out, lse, call.q_rows, block_out, block_lse)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    dq = [torch.zeros(rows, nheads, head_dim, device=q.device, dtype=acc) for _ in range(world)]
    dkv = [torch.zeros(2, rows, nheads_kv, head_dim, device=q.device, dtype=acc) for _ in range(world)]
    for r in range(world):  # backward
        for step, calls in enumerate(ring_schedule(batch, seqlen, world, r, layout, causal, offsets)):
            owner = (r - step) % world
            keys, values = packed[owner][1:3]
            for call in calls:
                take = call.q_rows.take
                block_dq, block_dk, block_dv = block_backward(
                    take(packed[r][3]), take(packed[r][0]), call.k_rows.take(keys), call.k_rows.take(values),
                    take(outs[r]), take(lses[r], 1), call, scale, cuda, False,
                    take(packed[r][4], 1) if with_lse else None)
                call.q_rows.add(dq[r], block_dq)
                call.k_rows.add(dkv[owner][0], block_dk)
                call.k_rows.add(dkv[owner][1], block_dv)

    def gather(pieces, dim):
        full = torch.empty_like(torch.cat(pieces, dim))
        for r, piece in enumerate(pieces):
            from flashtrain.parallel.ring_attention import shard_positions
            full.index_copy_(dim, shard_positions(seqlen, r, world, layout).to(q.device), piece)
        return full

    local = (batch, seqlen // world)
    return [gather([o.view(*local, nheads, head_dim) for o in outs], 1).cpu(),
            gather([l.view(nheads, *local).transpose(0, 1) for l in lses], 2).cpu(),
            gather([d.to(q.dtype).view(*local, nheads, head_dim) for d in dq], 1).cpu(),
            gather([d[0].to(q.dtype).view(*local, nheads_kv, head_dim) for d in dkv], 1).cpu(),
            gather([d[1].to(q.dtype).view(*local, nheads_kv, head_dim) for d in dkv], 1).cpu()]


def check(ring, kernel, reference, label):
    from test_cuda_kernels import _assert_fa2_rule

    for what, actual, lowp, wanted in zip(RESULTS, ring, kernel, reference):
        finite = wanted > float("-inf")
        assert torch.equal(actual == float("-inf"), ~finite) if what == "lse" else True, f"{label} {what}: -inf rows"
        _assert_fa2_rule(actual[finite], wanted[finite], lowp[finite], torch.bfloat16, f"{label} {what}")


@pytest.mark.parametrize("name", list(worker.CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ring_on_the_kernels(name, world):
    _, _, _, causal, layout, documents, with_lse, scale = worker.CASES[name]
    q, k, v, dout, dlse = worker.case_inputs(name, torch.bfloat16, "cuda")
    offsets = tuple(worker.document_offsets().tolist()) if documents else None
    ring = simulated_ring(q, k, v, dout, dlse, world=world, layout=layout, causal=causal, scale=scale,
                          offsets=offsets, with_lse=with_lse)
    kernel = single_process(name, torch.bfloat16, device="cuda", impl="cuda")
    reference = single_process(name, torch.bfloat16, device="cuda", impl="reference", compute_dtype=torch.float32)
    check(ring, kernel, reference, f"{name} world {world}")


def test_simulated_ring_long_gqa_documents():
    """1 x 4096 tokens, 8 query heads of 128 on 2 kv heads, causal zigzag over 4 ranks, 5 documents."""
    from flashtrain.kernels import flash_attn_varlen_func

    gen = torch.Generator("cuda").manual_seed(0)
    batch, seqlen, nheads, nheads_kv, head_dim = 1, 4096, 8, 2, 128
    q, dout = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", generator=gen).bfloat16() for _ in "ab")
    k, v = (torch.randn(batch, seqlen, nheads_kv, head_dim, device="cuda", generator=gen).bfloat16() for _ in "ab")
    dlse = torch.zeros(batch, nheads, seqlen, device="cuda")
    cu = torch.tensor([0, 700, 701, 2500, 3000, 4096], dtype=torch.int32)
    ring = simulated_ring(q, k, v, dout, dlse, world=4, layout="zigzag", causal=True, scale=None,
                          offsets=tuple(cu.tolist()), with_lse=False)

    def single(impl, dtype):
        x = [t.to(dtype).reshape(seqlen, t.shape[2], head_dim).requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn_varlen_func(*x, cu.cuda(), cu.cuda(), 2500, 2500, causal=True, return_lse=True,
                                          impl=impl)
        out.backward(dout.reshape(seqlen, nheads, head_dim).to(dtype))
        return [out.detach().view(q.shape).cpu(), lse.detach().view(nheads, 1, seqlen).transpose(0, 1).cpu(),
                *(t.grad.view(batch, seqlen, *t.shape[1:]).cpu() for t in x)]

    check(ring, single("cuda", torch.bfloat16), single("reference", torch.float32), "long gqa documents")
