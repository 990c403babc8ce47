"""GPU tests of the CUDA FlashAttention kernels (flashtrain/kernels/ops.py), against the fp32 reference.

Tolerance rule of FlashAttention-2: for out, dq, dk and dv, the kernel's max error against the fp32 reference must be
at most twice the max error of the same attention computed by plain PyTorch in fp16/bf16 (naive_attention on the
low-precision inputs), plus the rounding error of the reference's values in that dtype.

    pytest -m cuda tests/test_cuda_kernels.py                                   # on a GPU machine
    compute-sanitizer --tool memcheck python tests/test_cuda_kernels.py         # small grid under the sanitizer
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func, naive_attention

pytestmark = pytest.mark.cuda
DTYPES = (torch.float16, torch.bfloat16)


def _ops():
    from flashtrain.kernels import ops

    return ops


def _inputs(shape_q, shape_k, dtype, scale=1.0, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    q = (torch.randn(shape_q, device="cuda", generator=gen) * scale).to(dtype)
    k = (torch.randn(shape_k, device="cuda", generator=gen) * scale).to(dtype)
    v = torch.randn(shape_k, device="cuda", generator=gen).to(dtype)
    dout = torch.randn(shape_q, device="cuda", generator=gen).to(dtype)
    return q, k, v, dout


def _run(fn, q, k, v, dout):
    """out, lse, dq, dk, dv of fn(q, k, v) -> (out, lse)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    out.backward(dout)
    return out.detach(), None if lse is None else lse.detach(), q.grad, k.grad, v.grad


def _assert_fa2_rule(kernel, reference, lowp, dtype, what):
    """max|kernel - ref| <= 2 max|lowp - ref| + rounding of ref to dtype + 1e-5 (FlashAttention-2's tests; the
    absolute 1e-5 covers fp32 rounding where the exact result is 0, e.g. dq of a row that sees a single key)."""
    assert torch.isfinite(kernel).all(), f"{what}: non-finite values"
    kernel_err = (kernel.float() - reference).abs().max().item()
    lowp_err = (lowp.float() - reference).abs().max().item()
    rounding = (reference.to(dtype).float() - reference).abs().max().item()
    assert kernel_err <= 2 * lowp_err + 2 * rounding + 1e-5, (
        f"{what}: kernel error {kernel_err:.3g} > 2 x PyTorch {dtype} error {lowp_err:.3g} (+ rounding {rounding:.3g})"
    )


def _check_against_reference(q, k, v, dout, *, causal, dropout_p=0.0, generator_seed=None, softmax_scale=None,
                             features=None, **varlen):
    """Kernel vs fp32 reference vs naive attention in q.dtype; varlen: cu_seqlens_q/k, max_seqlen_q/k; features:
    window_size / softcap for all three."""
    dtype = q.dtype
    features = features or {}
    mask = None
    if dropout_p > 0:
        mask = _ops().dropout_mask_for_testing(
            q, k, dropout_p=dropout_p, generator=torch.Generator("cuda").manual_seed(generator_seed), **varlen)
    if varlen:
        cu_q, cu_k, max_q, max_k = (varlen[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                              "max_seqlen_k"))

        def attn(q, k, v, impl, **kw):
            return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, causal=causal,
                                          softmax_scale=softmax_scale, return_lse=True, impl=impl, **kw, **features)

        def naive(q, k, v):
            return naive_attention(q, k, v, cu_q, cu_k, causal=causal, dropout_p=dropout_p, dropout_mask=mask,
                                   softmax_scale=softmax_scale, **features)
    else:
        def attn(q, k, v, impl, **kw):
            return flash_attn_func(q, k, v, dropout_p=dropout_p, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=True, impl=impl, **kw, **features)

        def naive(q, k, v):
            return naive_attention(q, k, v, causal=causal, dropout_p=dropout_p, dropout_mask=mask,
                                   softmax_scale=softmax_scale, **features)

    gen = {} if dropout_p == 0 else {"generator": torch.Generator("cuda").manual_seed(generator_seed)}
    kernel = _run(lambda q, k, v: attn(q, k, v, "cuda", **gen), q, k, v, dout)
    ref_mask = {} if mask is None else {"dropout_mask": mask}
    reference = _run(lambda q, k, v: attn(q, k, v, "reference", **ref_mask), q.float(), k.float(), v.float(),
                     dout.float())
    lowp = _run(naive, q, k, v, dout)
    for name, got, ref, low in zip(("out", "lse", "dq", "dk", "dv"), kernel, reference, lowp):
        if name == "lse":  # fp32 from fp32 accumulation: close to the reference, -inf where it is -inf
            assert torch.equal(got == -math.inf, ref == -math.inf), "lse: -inf rows differ"
            finite = ref > -math.inf
            torch.testing.assert_close(got[finite], ref[finite], atol=2e-3, rtol=1e-3)
        else:
            _assert_fa2_rule(got, ref, low, dtype, name)
    return kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_long_causal_tiles_match_reference(dtype):
    """Causal head dim 64 from build.LONG_CAUSAL_SEQLEN query rows on runs other tiles (three consumer warpgroups on
    Hopper): batch form with a partial last tile and seqlen_k > seqlen_q, and varlen with one long sequence."""
    from flashtrain.kernels import build

    long = build.LONG_CAUSAL_SEQLEN
    q, k, v, dout = _inputs((1, long + 67, 2, 64), (1, long + 200, 2, 64), dtype, seed=3)
    _check_against_reference(q, k, v, dout, causal=True)
    lengths = torch.tensor([33, long + 5, long * 2 // 3])  # (each at most max_seqlen_q: the call checks it)
    cu = torch.tensor([0, *lengths.cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((int(lengths.sum()), 4, 64), (int(lengths.sum()), 2, 64), dtype, seed=4)
    _check_against_reference(q, k, v, dout, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=long + 5, max_seqlen_k=long + 5)


@pytest.mark.parametrize("head_dim", [128, 96, 80])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_keys_tiles_match_reference(causal, head_dim):
    """Head dim 128 from build.long_keys_seqlen(causal) keys on runs 192-key tiles (O stored from the registers): a
    partial last key block, seqlen_q = seqlen_k and a short query block against the long keys (causal: aligned to the
    end), forward and gradients by FlashAttention-2's rule. Head dims 96 / 80: the same tiles with 96 / 80 columns of
    MMA work, and the backward's query blocks narrowed likewise. Head dim 128 causal also on the backward's 80-query
    blocks (build.BWD_SM90_Q80_CAUSAL_SEQLEN set to 4K here; by default they take 64 at every length), dq_accum in
    fragment order, and in plain rows with build.BWD_DQ_FRAG = 0."""
    from flashtrain.kernels import build, ops

    long = build.long_keys_seqlen(causal) + 77  # (not a multiple of 192)
    assert build.fwd_kernel(128, "bf16", causal, False, arch=build.SM90_ARCH, seqlen_q=long, seqlen_k=long,
                            effective_head_dim=head_dim).tiles.block_n == 192
    q, k, v, dout = _inputs((1, long, 2, head_dim), (1, long, 1, head_dim), torch.bfloat16, seed=5)
    _check_against_reference(q, k, v, dout, causal=causal)
    q, k, v, dout = _inputs((2, 333, 2, head_dim), (2, long, 2, head_dim), torch.bfloat16, seed=6)
    _check_against_reference(q, k, v, dout, causal=causal)
    if head_dim == 128 and causal:  # the causal 80-query kernel, dq_accum in fragment order and in plain rows
        n = 4096 + 40
        q, k, v, dout = _inputs((1, n, 1, 128), (1, n, 1, 128), torch.bfloat16, seed=7)
        for frag, name in ((1, "flash_bwd_sm90_hdim128_bf16_causal_q80"),
                           (0, "flash_bwd_sm90_hdim128_bf16_causal_q80_dqrows")):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(build, "BWD_SM90_Q80_CAUSAL_SEQLEN", 4096)
                patch.setattr(build, "BWD_DQ_FRAG", frag)
                ops.clear_plans()  # (the launch plans hold the kernel they were built with)
                assert build.bwd_kernel(128, "bf16", True, False, arch=build.SM90_ARCH, seqlen_q=n).name == name
                _check_against_reference(q, k, v, dout, causal=True)
        ops.clear_plans()


@pytest.mark.parametrize("seqlen, batch", [(512, 5), (1024, 3)])
def test_short_hd128_causal_tile_groups_match_reference(seqlen, batch, monkeypatch):
    """Short head-dim-128 causal calls with their tiles in groups of one wave (ops.CAUSAL_GROUP_WAVES_SHORT = 1, the
    default, set here whatever it is): with 16 heads, two groups, the last one taking the remainder (tma.cuh
    tile_group_unit), forward and gradients against the reference."""
    from flashtrain.kernels import launch

    if not _is_hopper():
        pytest.skip("the tile groups are the Hopper kernels'")
    ops, units = _ops(), batch * 16
    monkeypatch.setattr(ops, "CAUSAL_GROUP_WAVES_SHORT", 1.0)
    ops.clear_plans()  # (a plan holds the group it was built with)
    group = ops._causal_tile_group(seqlen // 128, units, launch.sm_count(torch.device("cuda")), short_hd128=True)
    assert 2 * group <= units < 3 * group and units % group  # (132 SMs: groups of 33 + 47 units at 512, 17 + 31 at 1K)
    q, k, v, dout = _inputs((batch, seqlen, 16, 128), (batch, seqlen, 16, 128), torch.bfloat16, seed=11)
    _check_against_reference(q, k, v, dout, causal=True)
    monkeypatch.undo()
    ops.clear_plans()


@pytest.mark.parametrize("head_dim, seqlen, batch", [(64, 512, 5), (64, 1024, 3), (128, 512, 5)])
def test_small_l2_short_causal_forward_matches_reference(head_dim, seqlen, batch, monkeypatch):
    """The short causal forward as a GPU with a small L2 runs it (launch.l2_bytes set to an H100's 50 MB, whatever this
    GPU has): hd64 on 192-row tiles with two Q buffers (`_q2`), both head dims at 512 in tile groups of half a wave
    (two groups or more at 16 heads, the last taking the remainder); forward and gradients against the reference."""
    from flashtrain.kernels import build, launch

    if not _is_hopper():
        pytest.skip("the Hopper forward")
    ops = _ops()
    monkeypatch.setattr(launch, "l2_bytes", lambda device: 50 << 20)
    monkeypatch.setattr(build, "SMALL_L2_BYTES", 50 << 20)
    ops.clear_plans()  # (a plan holds the tiles and group it was built with)
    q, k, v, dout = _inputs((batch, seqlen, 16, head_dim), (batch, seqlen, 16, head_dim), torch.bfloat16, seed=13)
    plan = ops._fwd_plan(q, k, v, None, None, seqlen, seqlen, 0.0, head_dim ** -0.5, True, None).launches[0]
    spec = build.fwd_kernel(head_dim, "bf16", True, False, arch=build.SM90_ARCH, seqlen_q=seqlen, small_l2=True)
    assert spec.tiles.q_buffers == 2 and plan.kernel.smem_bytes == spec.smem_bytes  # (the _q2 kernel runs)
    if seqlen <= 768:  # (the half-wave groups: hd128 to 1K, hd64 to 768 rows)
        group = plan.params.fwd.causal_tile_group
        assert 2 * group <= batch * 16 and (batch * 16) % group, group
    _check_against_reference(q, k, v, dout, causal=True)
    monkeypatch.undo()
    ops.clear_plans()


@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_head_dim_short_causal_tile_groups_match_reference(head_dim, monkeypatch):
    """Short causal calls at head dims 192 / 256 with their tiles in the short groups (ops.FWD_WIDE_SHORT_WAVES,
    BWD_WIDE_SHORT_WAVES, set here whatever the defaults are): 1K tokens, 16 heads, batch 4, so that both passes
    run several groups, the last taking the remainder (132 SMs: forward 25 + 39 units, backward groups of 12 at
    hd192's 11 key blocks, of 9 at hd256's 16); forward and gradients against the reference."""
    from flashtrain.kernels import build, launch

    if not _is_hopper():
        pytest.skip("the tile groups are the Hopper kernels'")
    ops, units, sms = _ops(), 4 * 16, launch.sm_count(torch.device("cuda"))
    for name, value in (("FWD_WIDE_SHORT_WAVES", 1.5), ("FWD_WIDE_SHORT_BLOCKS", 8), ("BWD_WIDE_SHORT_WAVES", 1.0),
                        ("BWD_WIDE_SHORT_BLOCKS", 16)):
        monkeypatch.setattr(ops, name, value)
    ops.clear_plans()  # (a plan holds the group it was built with)
    key_blocks = math.ceil(1024 / build.BWD_SM90_TILES[head_dim].block_n)  # (96 keys at hd192: 11; 64 at hd256: 16)
    for group in (ops._causal_tile_group(8, units, sms, wide_fwd=True),
                  ops._causal_tile_group(key_blocks, units, sms, wide_bwd=True)):
        assert 2 * group <= units and units % group  # (two groups or more, the last one larger)
    q, k, v, dout = _inputs((4, 1024, 16, head_dim), (4, 1024, 16, head_dim), torch.bfloat16, seed=12)
    _check_against_reference(q, k, v, dout, causal=True)
    monkeypatch.undo()
    ops.clear_plans()


@pytest.mark.parametrize("head_dim", [192, 256])
def test_wide_head_dim_short_causal_forward_tiles_match_reference(head_dim):
    """Causal calls at head dims 192 / 256 up to build.FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN query rows run the forward on
    64-key tiles (three / two stages): 700 rows (the partial tile first), 16 query heads on 4 key / value heads, batch
    4 (several tiles per CTA); forward and gradients against the reference."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the 64-key tiles are the Hopper forward's")
    assert 700 <= build.FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN
    spec = build.fwd_kernel(head_dim, "bf16", True, False, arch=build.SM90_ARCH, seqlen_q=700, seqlen_k=700)
    assert (spec.tiles.block_n, spec.tiles.stages) == (64, 3 if head_dim == 192 else 2)
    q, k, v, dout = _inputs((4, 700, 16, head_dim), (4, 700, 4, head_dim), torch.bfloat16, seed=13)
    _check_against_reference(q, k, v, dout, causal=True)


def _variant_matches_reference(monkeypatch, variant, cases, varlen_head_dim, seed):
    """Under ab_probe's kernel_variant (its macros set through FLASHTRAIN_EXTRA_DEFINES, the loaded kernels and the
    plans dropped, then restored): each (batch, seqlen, heads, heads_kv, head_dim, causal) case and one causal varlen
    batch of three sequences (33, 667 and 433 tokens, 4 heads) against the reference."""
    probes = Path(__file__).resolve().parents[1] / "benchmarks" / "probes"
    monkeypatch.syspath_prepend(str(probes.parent))
    monkeypatch.syspath_prepend(str(probes))
    import ab_probe

    with ab_probe.kernel_variant(variant):
        for index, (batch, seqlen, heads, heads_kv, head_dim, causal) in enumerate(cases):
            q, k, v, dout = _inputs((batch, seqlen, heads, head_dim), (batch, seqlen, heads_kv, head_dim),
                                    torch.bfloat16, seed=seed + index)
            _check_against_reference(q, k, v, dout, causal=causal)
        cu = torch.tensor([0, 33, 700, 1133], dtype=torch.int32, device="cuda")
        shape = (1133, 4, varlen_head_dim)
        q, k, v, dout = _inputs(shape, shape, torch.bfloat16, seed=seed + 10)
        _check_against_reference(q, k, v, dout, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=667,
                                 max_seqlen_k=667)


def test_aux_kernels_in_ascending_order_match_reference(monkeypatch):
    """The backward's preprocess and dQ conversion with their CTAs in ascending grid order (flash_aux.cuh
    FT_AUX_REVERSE = 0, an A/B build; the default is reversed): every row still written once, checked against the
    reference on the dq_accum layouts they handle: scrambled 64-query blocks (hd128 causal), the 80-query fragment
    order (hd128 non-causal, a partial last block), hd64, GQA, and varlen (padded rows)."""
    _variant_matches_reference(monkeypatch, "flashtrain+FT_AUX_REVERSE=0",
                               [(3, 512, 16, 16, 128, True), (1, 1064, 4, 4, 128, False), (2, 700, 4, 4, 64, True),
                                (2, 1024, 8, 2, 128, True)], varlen_head_dim=128, seed=20)


def test_forward_without_block_max_matches_reference(monkeypatch):
    """The Hopper forward whose unmasked key-block steps skip the block's row max (flash_fwd_sm90.cuh FT_FWD_REF_MAX=2,
    here built into every kernel, the guard's vote before the P V wait): plain inputs (hd64 / hd128, causal or not, GQA,
    a partial tile, a varlen batch), then inputs where 15 keys spread over key block 0 (every pair of n8 tiles) score 10
    to 150 binary orders above the others: bf16, fp16 for hd128 causal, GQA over a partial last tile, and the second
    sequence of a varlen batch. The walk takes key block 0 last, so there every warp's exponentials against the running
    max exceed 2^8 or overflow, and the warp computes its S again (mma.sync) and runs the plain softmax. Besides the
    FlashAttention-2 rule (loose here: the low-precision comparison rounds the large scores), the output must be within
    0.02 of the fp32 reference's: a wrong row, key, head or head-dim chunk in the recomputation moves it by far more."""
    if not _is_hopper():
        pytest.skip("the Hopper forward's switch")
    variant = "flashtrain+FT_FWD_REF_MAX=2"
    _variant_matches_reference(monkeypatch, variant,
                               [(2, 1000, 8, 8, 64, False), (2, 1000, 8, 8, 128, True), (1, 2048, 16, 4, 128, False),
                                (2, 777, 4, 4, 64, True)], varlen_head_dim=64, seed=40)
    import ab_probe  # (on the path: _variant_matches_reference)

    def boost(q, k, jump, head_dim, first_key=0):  # keys first_key + 0, 9, ..., 126 score `jump` orders higher
        q[..., 0] = 4.0
        keys = first_key + torch.arange(0, 128, 9, device="cuda")
        k[..., keys, :, 0] = jump / (4.0 * head_dim**-0.5 * math.log2(math.e))

    with ab_probe.kernel_variant(variant):
        for index, (head_dim, causal, jump, dtype, seqlen, heads_kv) in enumerate([
                (64, False, 10, torch.bfloat16, 1024, 4), (64, True, 150, torch.bfloat16, 1024, 4),
                (128, False, 150, torch.bfloat16, 1024, 4), (128, False, 20, torch.bfloat16, 1024, 4),
                (128, True, 10, torch.float16, 1024, 4), (128, True, 14, torch.float16, 1024, 4),
                (128, True, 20, torch.bfloat16, 1000, 2), (64, False, 150, torch.bfloat16, 1000, 1)]):
            q, k, v, dout = _inputs((2, seqlen, 4, head_dim), (2, seqlen, heads_kv, head_dim), dtype, seed=50 + index)
            boost(q, k, jump, head_dim)
            out = _check_against_reference(q, k, v, dout, causal=causal)[0]
            ref = flash_attn_func(q.float(), k.float(), v.float(), causal=causal, impl="reference")
            assert (out.float() - ref).abs().max().item() <= 0.02
        for head_dim in (64, 128):  # varlen: sequences of 300 and 1024 tokens, the second one's key block 0 boosted
            cu = torch.tensor([0, 300, 1324], dtype=torch.int32, device="cuda")
            q, k, v, dout = _inputs((1324, 4, head_dim), (1324, 2, head_dim), torch.bfloat16, seed=60 + head_dim)
            boost(q, k, 20, head_dim, first_key=300)
            for causal in (False, True):
                out = _check_against_reference(q, k, v, dout, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                               max_seqlen_q=1024, max_seqlen_k=1024)[0]
                ref = flash_attn_varlen_func(q.float(), k.float(), v.float(), cu, cu, 1024, 1024, causal=causal,
                                             impl="reference")
                assert (out.float() - ref).abs().max().item() <= 0.02


def _backward_cases_match_reference(head_dim, causal, seed, extra_cases=()):
    """The Hopper backward's tile-walk cases against the reference (seeds seed, seed + 1, ..., varlen seed + 9): many
    tiles per CTA, queries past the keys (whole query blocks that no key block sees: zero dq where causal), keys past
    the queries, a partial last query block, GQA with its group split over tiles, fp16, and varlen with a sequence
    without keys (zero dq)."""
    cases = [((4, 1000, 8, head_dim), (4, 1000, 8, head_dim), torch.bfloat16),
             ((2, 700, 4, head_dim), (2, 300, 4, head_dim), torch.bfloat16),
             ((2, 300, 4, head_dim), (2, 777, 4, head_dim), torch.float16),
             ((1, 2048, 16, head_dim), (1, 2048, 2, head_dim), torch.bfloat16), *extra_cases]
    for index, (shape_q, shape_k, dtype) in enumerate(cases):
        q, k, v, dout = _inputs(shape_q, shape_k, dtype, seed=seed + index)
        _, _, dq, _, _ = _check_against_reference(q, k, v, dout, causal=causal)
        if causal and shape_q[1] > shape_k[1]:  # rows that see no key
            unseen = shape_q[1] - shape_k[1]
            assert torch.equal(dq[:, :unseen], torch.zeros_like(dq[:, :unseen]))
    lengths_q, lengths_k = [129, 0, 640, 70, 300], [129, 5, 640, 0, 100]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((sum(lengths_q), 4, head_dim), (sum(lengths_k), 2, head_dim), torch.bfloat16,
                            seed=seed + 9)
    _, _, dq, _, _ = _check_against_reference(q, k, v, dout, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    no_keys = slice(129 + 640, 129 + 640 + 70)
    assert torch.equal(dq[no_keys], torch.zeros_like(dq[no_keys]))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fused", [2, 0], ids=["fused", "kernel"])
def test_causal_backward_dq_conversion_matches_reference(head_dim, fused, monkeypatch):
    """The causal Hopper backward converting dq itself (build.BWD_FUSED_DQ 2: head dims 64 and 128, hd128 on the
    descending walk; the key block that completes a query block's count hands it to the converter warps, which drop
    the converted lines of dq_accum from L2; whole blocks and partial ones) and with the conversion kernel after it,
    against the reference: many tiles per CTA, queries past the keys (whole query blocks that no key block sees, whose
    dq the preprocess zeroes), keys past the queries, a partial last query block, GQA with its group split over tiles,
    fp16, varlen with a sequence without keys. The cases run twice, so the second calls' preprocess zero-fills the
    dropped lines again."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the Hopper backward")
    ops = _ops()
    monkeypatch.setattr(build, "BWD_FUSED_DQ", fused)
    monkeypatch.setattr(build, "BWD_FUSED_DQ_MAX_SEQLEN", 1 << 20)  # (every case, the 2048-row one too)
    monkeypatch.setattr(build, "BWD_FUSED_DQ_HD128_MAX_SEQLEN", 1 << 20)
    ops.clear_plans()  # (a plan holds the kernel it was built with)
    spec = build.bwd_sm90_kernel(head_dim, "bf16", True, seqlen_q=2048)
    assert build.bwd_fused_dq(spec) == bool(fused)
    for _ in range(2):
        _backward_cases_match_reference(head_dim, True, seed=90)
    monkeypatch.undo()
    ops.clear_plans()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_backward_two_kv_buffers_matches_reference(causal, monkeypatch):
    """The hd64 Hopper backward with two K / V buffers (build.BWD_SM90_HD64_KV2_*_SEQLEN; tile t's K / V in buffer
    t % 2, copied before the tile's first Q / dO) against the reference: many tiles per CTA (both buffers, both
    phases of each), tiles without query blocks (keys past the queries), queries past the keys, a partial last block,
    GQA with its group split over tiles, fp16, the non-causal tail pieces, varlen with a sequence without keys."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the Hopper backward")
    ops = _ops()
    switch = "BWD_SM90_HD64_KV2_CAUSAL_SEQLEN" if causal else "BWD_SM90_HD64_KV2_FULL_SEQLEN"
    monkeypatch.setattr(build, switch, 1 << 20)
    ops.clear_plans()  # (a plan holds the kernel it was built with)
    spec = build.bwd_sm90_kernel(64, "bf16", causal, seqlen_q=1024)
    assert spec.name.endswith("_kv2") and not build.bwd_fused_dq(spec)
    _backward_cases_match_reference(64, causal, seed=190,
                                    extra_cases=[((8, 512, 32, 64), (8, 512, 32, 64), torch.bfloat16)])
    monkeypatch.undo()
    ops.clear_plans()


def test_cluster_forward_matches_reference_and_the_one_cta_kernel(monkeypatch):
    """The non-causal hd128 forward in 2-CTA clusters (build.FWD_SM90_CLUSTER: neighbouring query tiles share
    their K / V copies by TMA multicast) against the reference, on 66 query tiles per head with a partial last one, and
    bitwise against the one-CTA kernel (FWD_SM90_CLUSTER = 0; the same tiles and order of operations) on batch / GQA /
    key length / dtype variations, among them a grid of fewer CTAs than tiles and a key length past the last tile."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the 2-CTA clusters are a Hopper forward's")
    ops = _ops()

    def clusters(on):
        monkeypatch.setattr(build, "FWD_SM90_CLUSTER", on)
        ops.clear_plans()

    clusters(1)
    head_dim, n = 128, 66 * 128 - 40
    assert build.fwd_kernel(128, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=n,
                            seqlen_k=n).name == "flash_fwd_sm90_hdim128_bf16_128x192_c2"
    q, k, v, dout = _inputs((1, n, 2, head_dim), (1, n, 1, head_dim), torch.bfloat16, seed=8)
    _check_against_reference(q, k, v, dout, causal=False)

    def forward(q, k, v, cluster):
        clusters(cluster)
        return flash_attn_func(q, k, v, return_lse=True, impl="cuda")

    long = build.FWD_SM90_CLUSTER_SEQLEN
    for batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype in (
            (1, 2 * long, 2 * long, 16, 16, torch.bfloat16), (2, long, long + 808, 8, 2, torch.float16),
            (3, 256, long + 108, 4, 4, torch.bfloat16), (1, long - 50, long, 3, 1, torch.bfloat16)):
        q, k, v, _ = _inputs((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_kv, head_dim), dtype,
                             seed=seqlen_k)
        (out, lse) = forward(q, k, v, 1)
        assert build.fwd_kernel(128, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=seqlen_q,
                                seqlen_k=seqlen_k).tiles.cluster == 2
        (out1, lse1) = forward(q, k, v, 0)
        assert torch.equal(out, out1) and torch.equal(lse, lse1), (batch, seqlen_q, seqlen_k, nheads, nheads_kv)
    monkeypatch.undo()
    ops.clear_plans()


def test_hd64_cluster_forward_matches_reference_and_the_one_cta_kernel(monkeypatch):
    """The dense non-causal hd64 forward in 2-CTA clusters (build.FWD_SM90_CLUSTER_HD64: each CTA copies half of a
    key block's rows into both) against the reference, with a partial last query tile and a last key block of 30 rows
    (the second CTA's half starts at the last key instead of past the keys) or 100, and bitwise against the one-CTA
    kernel (FWD_SM90_CLUSTER_HD64 = 0: the same 192 x 128 tiles and order of operations) on batch / GQA / key length /
    dtype variations, among them launches with more tiles than CTAs."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the 2-CTA clusters are a Hopper forward's")
    ops = _ops()
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)  # (the one-CTA kernel whole tiles, whatever the environment)

    def forward(q, k, v, cluster):
        monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", cluster)
        ops.clear_plans()
        spec = build.fwd_kernel(64, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=q.shape[1],
                                seqlen_k=k.shape[1], effective_head_dim=q.shape[-1])
        assert spec.tiles.cluster == 1 + cluster, (q.shape, k.shape)
        return flash_attn_func(q, k, v, return_lse=True, impl="cuda")

    long = build.FWD_SM90_CLUSTER_SEQLEN
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", 1)
    ops.clear_plans()
    for seqlen_k in (long + 30, long + 100):  # (the last key block's second half past the keys, or cut part-way)
        q, k, v, dout = _inputs((1, 4 * 192 - 7, 2, 64), (1, seqlen_k, 1, 64), torch.bfloat16, seed=9)
        assert build.fwd_kernel(64, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=q.shape[1],
                                seqlen_k=seqlen_k).tiles.cluster == 2
        _check_against_reference(q, k, v, dout, causal=False)
    for batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype in (
            (1, 2 * long, 2 * long, 4, 4, 64, torch.bfloat16), (2, 384, long + 808, 8, 2, 64, torch.float16),
            (2, 384, long + 100, 8, 8, 64, torch.bfloat16),
            (3, 4 * 192 - 7, long + 30, 16, 4, 64, torch.bfloat16), (1, 2 * 192, long, 40, 40, 64, torch.bfloat16),
            (1, 2 * 192, long + 5, 8, 8, 40, torch.bfloat16)):  # (head dim 40: the hd64 kernel, zero-filled columns)
        q, k, v, _ = _inputs((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_kv, head_dim), dtype,
                             seed=seqlen_k)
        (out, lse) = forward(q, k, v, 1)
        (out1, lse1) = forward(q, k, v, 0)
        assert torch.equal(out, out1) and torch.equal(lse, lse1), (batch, seqlen_q, seqlen_k, nheads, head_dim)
    monkeypatch.undo()
    ops.clear_plans()


def _force_tail_split(monkeypatch, switch: str, on: bool, tail=None, pieces=None, calls=None):
    """build.<switch> (BWD_TAIL_SPLIT / FWD_TAIL_SPLIT) on or off, and ops._tail_split forced to run the last `tail`
    tiles of a launch in `pieces` pieces (None: one step each), its arguments appended to `calls`; plans dropped (a
    plan holds its kernel and tail split)."""
    from flashtrain.kernels import build

    ops = _ops()

    def forced(n_tiles, sm_count, steps):
        calls.append((n_tiles, steps))
        return n_tiles - min(n_tiles, tail), min(pieces or steps, steps)

    monkeypatch.setattr(build, switch, int(on))
    monkeypatch.setattr(ops, "_tail_split", forced)
    ops.clear_plans()


@pytest.mark.parametrize("head_dim, seqlen, nheads, nheads_kv, dropout_p, dtype", [
    (64, 1024, 9, 9, 0.0, torch.bfloat16), (128, 1040, 5, 5, 0.0, torch.float16),
    (96, 1000, 6, 3, 0.0, torch.bfloat16), (64, 640, 6, 6, 0.1, torch.float16),
    (128, 1040, 16, 16, 0.0, torch.bfloat16)])
def test_backward_tail_split_matches_reference_and_whole_tiles(head_dim, seqlen, nheads, nheads_kv, dropout_p, dtype,
                                                                monkeypatch):
    """The Hopper backward with the launch's last tiles in pieces over their query blocks (build.BWD_TAIL_SPLIT = 1;
    ops._tail_split forced to tails of 5 tiles and of every tile, in 2, 3 and one-block pieces, GQA pieces crossing a
    query head, whose group is not split over tiles: ops._gqa_splits forced to 1; 144 and 288 tiles on 132 SMs:
    CTAs that take whole tiles, then pieces): gradients against the reference; dk, dv of two calls bitwise equal (the
    pieces' sums are added in piece order) and dq, dk, dv within bf16 rounding of the whole tiles' (BWD_TAIL_SPLIT =
    0). The forward runs whole tiles (FWD_TAIL_SPLIT = 0, whatever the environment says)."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the tail split is the Hopper backward's")
    ops, calls = _ops(), []
    monkeypatch.setattr(ops, "_gqa_splits", lambda *args: 1)
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)
    q, k, v, dout = _inputs((2, seqlen, nheads, head_dim), (2, seqlen, nheads_kv, head_dim), dtype, seed=seqlen)
    gen = {} if dropout_p == 0 else {"generator_seed": 5}

    def grads(split, tail=None, pieces=None, reference=True):
        _force_tail_split(monkeypatch, "BWD_TAIL_SPLIT", split, tail, pieces, calls)
        if split and reference:
            return _check_against_reference(q, k, v, dout, causal=False, dropout_p=dropout_p, **gen)[2:]
        seeded = {} if dropout_p == 0 else {"generator": torch.Generator("cuda").manual_seed(5)}
        return _run(lambda q, k, v: flash_attn_func(q, k, v, dropout_p, return_lse=True, impl="cuda", **seeded),
                    q, k, v, dout)[2:]

    whole = grads(False)
    assert not calls
    for tail, pieces in ((5, 2), (5, 3), (10 ** 6, 3), (5, None)):
        split = grads(True, tail, pieces)
        assert calls and calls[-1][0] == 2 * nheads_kv * -(-seqlen // 128), calls  # (tiles of 128 keys)
        again = grads(True, tail, pieces, reference=False)
        assert torch.equal(split[1], again[1]) and torch.equal(split[2], again[2]), (tail, pieces)
        for name, a, b in zip(("dq", "dk", "dv"), split, whole):
            assert (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max(), (name, tail, pieces)
    monkeypatch.undo()
    ops.clear_plans()


@pytest.mark.parametrize("head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, batch, dtype", [
    (64, 1000, 1000, 6, 6, 2, torch.bfloat16), (128, 700, 1100, 4, 2, 2, torch.float16),
    (80, 1024, 1024, 5, 5, 2, torch.bfloat16), (256, 500, 900, 3, 3, 2, torch.bfloat16),
    (64, 1024, 1024, 16, 16, 4, torch.bfloat16), (192, 1000, 1000, 12, 12, 2, torch.float16),
    (256, 1024, 1024, 16, 8, 2, torch.bfloat16)])
def test_forward_tail_split_matches_reference_and_whole_tiles(head_dim, seqlen_q, seqlen_k, nheads, nheads_kv, batch,
                                                               dtype, monkeypatch):
    """The Hopper forward with the launch's last tiles in pieces over their key blocks (build.FWD_TAIL_SPLIT = 1;
    ops._tail_split forced to tails of 5 tiles and of every tile, in 2, 3 and one-block pieces; a partial last key
    block, more keys than queries, GQA, a narrowed head dim; 192-384 tiles on 132 SMs: CTAs that take whole tiles,
    then pieces, the register epilogue of head dims 192 / 256 among them): out and lse against the reference (and the
    gradients through them; the backward on whole tiles, BWD_TAIL_SPLIT = 0), out / lse of two calls bitwise equal
    (the pieces merged in piece order) and within rounding of the whole tiles' (FWD_TAIL_SPLIT = 0)."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the tail split is the Hopper forward's")
    ops, calls = _ops(), []
    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 0)
    q, k, v, dout = _inputs((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_kv, head_dim), dtype,
                            seed=seqlen_k)

    def forward(split, tail=None, pieces=None, reference=False):
        _force_tail_split(monkeypatch, "FWD_TAIL_SPLIT", split, tail, pieces, calls)
        if reference:
            return _check_against_reference(q, k, v, dout, causal=False)[:2]
        return flash_attn_func(q, k, v, return_lse=True, impl="cuda")

    out0, lse0 = forward(False)
    assert not calls
    for tail, pieces in ((5, 2), (5, 3), (10 ** 6, 3), (5, None)):
        out, lse = forward(True, tail, pieces, reference=True)
        spec = build.fwd_kernel(build.rounded_head_dim(head_dim, False, build.SM90_ARCH),
                                "bf16" if dtype == torch.bfloat16 else "fp16", False, False,
                                arch=build.SM90_ARCH, seqlen_q=seqlen_q, seqlen_k=seqlen_k, effective_head_dim=head_dim)
        assert spec.name.endswith("_tail"), spec.name
        assert calls[-1] == (batch * nheads * -(-seqlen_q // spec.block_m), -(-seqlen_k // spec.tiles.block_n)), calls
        again = forward(True, tail, pieces)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), (tail, pieces)
        assert (out.float() - out0.float()).abs().max() <= 2 ** -7 * out0.float().abs().max(), (tail, pieces)
        torch.testing.assert_close(lse, lse0, atol=1e-3, rtol=1e-4)
    monkeypatch.undo()
    ops.clear_plans()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_negative_softmax_scale_matches_reference(causal, head_dim):
    """softmax_scale < 0 is softmax(q k^T * scale) like any other scale. The kernels take each row's running max over
    the raw scores (the max of the scaled ones only for a positive scale), so the call runs them on -q with -scale:
    otherwise exp() of (score - max) * scale overflows once a row's scaled scores spread by more than ~88, as here
    (scores with a standard deviation of 9 * sqrt(head_dim)). Batch and varlen forms, forward and gradients."""
    q, k, v, dout = _inputs((2, 300, 4, head_dim), (2, 300, 2, head_dim), torch.bfloat16, scale=3.0, seed=11)
    _check_against_reference(q, k, v, dout, causal=causal, softmax_scale=-0.4)
    cu = torch.tensor([0, 77, 600], dtype=torch.int32, device="cuda")
    q, k, v, dout = (x.reshape(600, *x.shape[2:]) for x in (q, k, v, dout))
    _check_against_reference(q, k, v, dout, causal=causal, softmax_scale=-0.4, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=523, max_seqlen_k=523)


@pytest.mark.parametrize("softmax_scale", [0.0, 1e-30, 2.0 ** -64, 1e-3])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_tiny_softmax_scale_matches_reference(head_dim, softmax_scale):
    """Scales down to 0 are softmax(q k^T * scale) too (0: a uniform average, zero dq and dk). The Hopper backward of
    head dims 65-128 (hd128: its 64-query kernels, which the causal call takes) holds each row's lse in raw score
    units, -lse / scale (build.BWD_SM90_LSE_BIAS), which a scale below 2^-64 would overflow: the call folds such a
    scale into q. Forward and gradients, causal, GQA."""
    q, k, v, dout = _inputs((2, 200, 4, head_dim), (2, 200, 2, head_dim), torch.bfloat16, scale=3.0, seed=12)
    _check_against_reference(q, k, v, dout, causal=True, softmax_scale=softmax_scale)


# ---------------------------------------------------------------------------------------------------- batch form
SEQLENS = [(1, 1), (17, 17), (97, 97), (128, 128), (1025, 1025), (17, 97), (97, 17), (128, 1025)]


@pytest.mark.parametrize("head_dim", [32, 40, 64, 80, 96, 128, 160, 192, 256, 320, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference(head_dim, dtype, causal):
    for index, (seqlen_q, seqlen_k) in enumerate(SEQLENS):
        nheads, nheads_kv = (4, 2) if index % 2 else (3, 3)  # GQA on every other shape
        q, k, v, dout = _inputs((2, seqlen_q, nheads, head_dim), (2, seqlen_k, nheads_kv, head_dim), dtype,
                                seed=index)
        _check_against_reference(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_long(head_dim, causal):
    q, k, v, dout = _inputs((1, 4097, 2, head_dim), (1, 4097, 1, head_dim), torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("head_dim", [192, 256, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads_kv", [16, 2])
def test_wide_head_dims_many_tiles(head_dim, causal, nheads_kv):
    """Head dims 192 / 256 (on Hopper the backward that splits the head dim over its warpgroups) and 512 (the forward
    whose warp pairs split O's columns, the backward's dQ in pieces): many key tiles per CTA of the persistent grid,
    and GQA 16 / 2, whose dK / dV are partial sums over the group's query heads."""
    q, k, v, dout = _inputs((1, 2048 + 33, 16, head_dim), (1, 2048 + 33, nheads_kv, head_dim), torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=causal)


def _is_hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("switch", ["BWD_SM90_HD192_STAGE_DQ", "BWD_SM90_HD192_N96"])
def test_hd192_backward_alternatives_match_reference(switch, monkeypatch):
    """The head-dim-192 Hopper backward's forms kept for A/Bs, by FlashAttention-2's rule: the 96-key kernel with dQ
    added from the registers (BWD_SM90_HD192_STAGE_DQ = 0: two dO stages, P^T / dS^T double-buffered) and the 64-key
    split-head-dim kernel (BWD_SM90_HD192_N96 = 0); causal or not, GQA 4 / 2, a partial last key tile."""
    from flashtrain.kernels import build

    if not _is_hopper():
        pytest.skip("the head-dim-192 warpgroup-MMA backward is Hopper's")
    ops = _ops()
    monkeypatch.setattr(build, switch, 0)
    ops.clear_plans()
    try:
        for causal in (False, True):
            q, k, v, dout = _inputs((2, 1000 + 33, 4, 192), (2, 1000 + 33, 2, 192), torch.bfloat16, seed=int(causal))
            _check_against_reference(q, k, v, dout, causal=causal)
    finally:
        monkeypatch.undo()
        ops.clear_plans()


@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mma_sync_kernels_on_hopper_match_reference(head_dim, causal, monkeypatch):
    """On Hopper dense attention without dropout runs on the warpgroup-MMA kernels (flash_fwd_sm90.cuh,
    flash_bwd_sm90.cuh); the mma.sync kernels, which every other GPU runs, are tested there too (FLASHTRAIN_SM90=0)."""
    if not _is_hopper():
        pytest.skip("the mma.sync kernels are the ones the tests above ran")
    monkeypatch.setenv("FLASHTRAIN_SM90", "0")
    for index, (seqlen_q, seqlen_k) in enumerate(SEQLENS):
        q, k, v, dout = _inputs((2, seqlen_q, 4, head_dim), (2, seqlen_k, 2, head_dim), torch.bfloat16, seed=index)
        _check_against_reference(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_99kb_tiles_match_reference(head_dim, monkeypatch):
    """The tiles of GPUs with 99 KB of shared memory per block (sm_86 / sm_89 / sm_120: A10G, L4, L40S, RTX), run
    here by lowering this device's limit as FLASHTRAIN_MAX_SMEM=99K does for a whole run; batch and varlen, causal,
    dropout, GQA."""
    from flashtrain.kernels import build, launch

    device = torch.device("cuda", torch.cuda.current_device())
    launch.device_smem_limit(device)  # read the real limit first, then lower it
    monkeypatch.setitem(launch._smem_limits, device.index, build.SMEM_OPTIN_SM86)
    monkeypatch.setenv("FLASHTRAIN_SM90", "0")
    spec = build.bwd_kernel(head_dim, "bf16", True, False, smem_limit=build.SMEM_OPTIN_SM86)
    assert spec.smem_bytes <= build.SMEM_OPTIN_SM86 and spec.tiles == build.BWD_TILES_SMALL_SMEM[head_dim]
    for index, (seqlen_q, seqlen_k) in enumerate([(97, 97), (1025, 1025), (17, 200)]):
        q, k, v, dout = _inputs((2, seqlen_q, 4, head_dim), (2, seqlen_k, 2, head_dim), torch.bfloat16, seed=index)
        _check_against_reference(q, k, v, dout, causal=bool(index % 2))
    lengths_q, lengths_k = [1, 300, 129], [64, 17, 300]
    cu_q = torch.tensor([0, 1, 301, 430], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 81, 381], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((430, 4, head_dim), (381, 1, head_dim), torch.float16, seed=7)
    _check_against_reference(q, k, v, dout, causal=True, dropout_p=0.17, generator_seed=3, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


def test_hopper_runs_the_warpgroup_mma_kernels():
    from flashtrain.kernels import build, launch

    if build.smem_cap() is not None:
        pytest.skip(f"{build.SMEM_ENV} is set: the tiles of that limit run")
    arch = launch.device_arch(torch.device("cuda", torch.cuda.current_device()))
    names = [build.fwd_kernel(head_dim, "bf16", False, False, arch=arch).name for head_dim in (64, 128)]
    names += [build.bwd_kernel(head_dim, "bf16", False, False, arch=arch).name for head_dim in (64, 128)]
    kind = "_sm90" if _is_hopper() else ""
    expected = [f"flash_{pass_}{kind}_hdim{head_dim}_bf16" for pass_ in ("fwd", "bwd") for head_dim in (64, 128)]
    if _is_hopper() and build.bwd_sm90_q80_enabled():  # the dense hd128 backward's 80-query blocks
        expected[-1] += "_q80"
    if _is_hopper() and build.BWD_TAIL_SPLIT:  # the dense backward's kernels with the tail split (BWD_TAIL_SPLIT)
        expected[2:] = [name + "_tail" for name in expected[2:]]
    assert names == expected


def test_mqa_many_heads():
    q, k, v, dout = _inputs((2, 300, 8, 64), (2, 200, 1, 64), torch.float16)
    _check_against_reference(q, k, v, dout, causal=True)


def test_rows_without_visible_keys_give_zeros_and_no_nan():
    """Causal with seqlen_q > seqlen_k: query i sees key j iff j <= i - 80, so rows 0..79 see nothing."""
    q, k, v, dout = _inputs((2, 97, 2, 64), (2, 17, 2, 64), torch.bfloat16)
    out, lse, dq, dk, dv = _check_against_reference(q, k, v, dout, causal=True)
    assert torch.equal(out[:, :80], torch.zeros_like(out[:, :80]))
    assert torch.all(lse[:, :, :80] == -math.inf) and torch.isfinite(lse[:, :, 80:]).all()
    assert torch.equal(dq[:, :80], torch.zeros_like(dq[:, :80]))


@pytest.mark.parametrize("head_dim", [128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_running_max_rising_by_steps(head_dim, causal):
    """Scores rising toward the first keys (the forward walks key blocks from the last), by 3 or 10 binary orders per
    64 keys in turn: the Hopper forward's conditional rescale (flash_fwd_sm90.cuh kLazyRescale) keeps a row's max
    through rises of at most 2^8, so P reaches up to 2^8 there, and moves it past them; FlashAttention-2's rule against
    the fp32 reference, outputs, lse and gradients."""
    seqlen = 1024
    q, k, v, dout = _inputs((2, seqlen, 2, head_dim), (2, seqlen, 2, head_dim), torch.bfloat16, scale=0.1, seed=5)
    # score of key j ~ (log2 units) sum of the steps of the 64-key groups from j's on: q . k_j scale log2(e) = rise_j
    steps = torch.tensor([3.0, 10.0], device="cuda").repeat(seqlen // 128)
    rise = steps.flip(0).cumsum(0).flip(0).repeat_interleave(64)  # highest at key 0
    unit = head_dim ** 0.5 * math.log2(math.e)  # q . k_j scale log2(e) for q = 1 and k_j = u: u * unit
    q = (q.float() + 1.0).to(torch.bfloat16)
    k = (k.float() + (rise / unit)[None, :, None, None]).to(torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_large_magnitude_inputs_do_not_overflow(dtype):
    """q, k of magnitude 1e3: scores ~1e7 overflow fp16 in plain PyTorch (NaN), not in the kernel (fp32 scores)."""
    q, k, v, dout = _inputs((2, 257, 2, 64), (2, 257, 2, 64), dtype, scale=1e3)
    kernel = _run(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="cuda"), q, k, v, dout)
    reference = _run(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="reference"), q.float(),
                     k.float(), v.float(), dout.float())
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), kernel, reference):
        assert torch.isfinite(got).all(), name
    out, lse = kernel[0].float(), kernel[1]
    # softmax is (nearly) one-hot: out is a row of v, up to rounding P to the dtype before P @ V
    assert (out - reference[0]).abs().max().item() <= 2 * torch.finfo(dtype).eps * v.abs().max().item()
    torch.testing.assert_close(lse, reference[1], atol=0, rtol=1e-4)


def test_non_contiguous_inputs():
    """q, k, v as strided views of one packed qkv tensor (as a fused projection produces)."""
    qkv = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    dout = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=True)


# ---------------------------------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 72, 160, 256, 512])
def test_varlen_matches_reference(dtype, causal, head_dim):
    lengths_q = [0, 1, 17, 97, 128, 300, 5]
    lengths_k = [3, 1, 0, 97, 200, 129, 40]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((sum(lengths_q), 4, head_dim), (sum(lengths_k), 2, head_dim), dtype)
    _check_against_reference(q, k, v, dout, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


# ---------------------------------------------------------------------------------------------------- dropout
SCORE_MODS = [dict(window_size=(100, 50)), dict(window_size=(-1, 7)), dict(window_size=(130, -1)),
              dict(softcap=0.5), dict(softcap=2.0, window_size=(64, 64)), dict(alibi_slopes="heads"),
              dict(alibi_slopes="batch", softcap=3.0, window_size=(90, 20)),
              dict(alibi_slopes="heads", window_size=(90, 20)),  # both without softcap: the `_nocap` kernels
              dict(window_size=(2**31 - 1, 3))]  # wider than any sequence (ops caps it: int32 index arithmetic)


@pytest.mark.parametrize("family", ["default", "mma_sync"])
@pytest.mark.parametrize("features", SCORE_MODS, ids=[str(f) for f in SCORE_MODS])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_softcap_and_alibi_match_reference(features, head_dim, causal, family, monkeypatch):
    """The score-modification kernels: local window, softcap, ALiBi; batch and varlen, GQA, bottom-right
    alignment, a long sequence (many key blocks outside the window). Both kernel families: on Hopper the default runs
    the warpgroup-MMA kernels (forward: FWD_SM90_MODS_HEAD_DIMS; backward: 64 / 128), FLASHTRAIN_SM90=0 the mma.sync
    ones, which every other GPU runs."""
    from flashtrain.kernels import build

    if family == "mma_sync":
        if not _is_hopper():
            pytest.skip("the default family is the mma.sync one here")
        monkeypatch.setenv("FLASHTRAIN_SM90", "0")
    elif _is_hopper():  # the warpgroup-MMA kernels are the ones these calls dispatch to
        fwd = build.fwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True)
        softcap = "softcap" in features
        bwd = build.bwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True, softcap=softcap)
        assert (fwd.source == "flash_fwd_sm90.cu") == (head_dim in build.FWD_SM90_MODS_HEAD_DIMS)
        assert (bwd.source == "flash_bwd_sm90.cu") == (head_dim in build.BWD_SM90_MODS_HEAD_DIMS and
                                                       (not softcap or build.BWD_SM90_MODS_SOFTCAP[head_dim]))
        if causal and head_dim == 128 and not softcap:  # long calls: 80-query blocks unless a short sliding window
            left = features.get("window_size", (-1, -1))[0]
            sliding = 0 <= left <= build.BWD_SM90_WINDOW_Q64_MAX_LEFT
            assert build.bwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                                    seqlen_q=build.BWD_SM90_MODS_Q80_CAUSAL_SEQLEN,
                                    window_left=left).block_m == (64 if sliding else 80)
    features = dict(features)
    if causal and features.get("window_size", (-1, -1))[1] not in (-1, 0):
        features["window_size"] = (features["window_size"][0], 0)
    if "alibi_slopes" in features:  # ALiBi's geometric slopes, per head or per (sequence, head)
        slopes = torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)], device="cuda")
        features["alibi_slopes"] = slopes if features["alibi_slopes"] == "heads" else torch.stack([slopes] * 4) * \
            torch.arange(1, 5, device="cuda")[:, None]
    batch_features = dict(features)
    if "alibi_slopes" in features and features["alibi_slopes"].dim() == 2:
        batch_features["alibi_slopes"] = features["alibi_slopes"][:2]
    shapes = [(300, 300), (200, 457), (457, 200), (1, 333), (1100, 1100)]
    long_q80 = family == "default" and causal and head_dim == 128 and "softcap" not in features
    long = build.BWD_SM90_MODS_Q80_CAUSAL_SEQLEN + 52
    if long_q80:  # the Hopper hd128 causal mods backward's 80-query blocks (from BWD_SM90_MODS_Q80_CAUSAL_SEQLEN
        # queries; the short sliding windows: 64-query blocks with the early K / V release, over many key blocks)
        shapes += [(long, long), (long, long + 300)]
    for index, (seqlen_q, seqlen_k) in enumerate(shapes):
        q, k, v, dout = _inputs((2, seqlen_q, 4, head_dim), (2, seqlen_k, 2, head_dim), torch.bfloat16, seed=index)
        _check_against_reference(q, k, v, dout, causal=causal, features=batch_features)
    if long_q80:
        lengths = [long, 300]
        cu = torch.tensor([0, long, long + 300], dtype=torch.int32, device="cuda")
        q, k, v, dout = _inputs((long + 300, 4, head_dim), (long + 300, 2, head_dim), torch.bfloat16, seed=7)
        _check_against_reference(q, k, v, dout, causal=causal, features=batch_features, cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    lengths_q, lengths_k = [150, 0, 37, 260], [150, 12, 80, 200]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((sum(lengths_q), 4, head_dim), (sum(lengths_k), 2, head_dim), torch.float16, seed=9)
    _check_against_reference(q, k, v, dout, causal=causal, features=features, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


@pytest.mark.parametrize("case", ["documents", "prefix-lm", "dilated-per-head", "empty-rows"])
@pytest.mark.parametrize("head_dim", [64, 128, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("family", ["default", "mma_sync"])
def test_mask_mod_matches_reference(case, head_dim, causal, family, monkeypatch):
    """A mask expression compiled into the kernels (mask_mod): block states on the GPU, empty tiles skipped, the
    expression on partial ones; documents per sequence (batch and varlen), prefix-LM, a head-dependent dilated window
    combined with a window, rows that see no key; GQA; sequences longer than a tile. Both kernel families: on Hopper
    the default runs the warpgroup-MMA forward and backward (head dims 64 / 128), FLASHTRAIN_SM90=0 the mma.sync
    ones."""
    from flashtrain.kernels import build
    from flashtrain.kernels.mask_mod import MaskMod

    lengths = [700, 260, 333]
    doc = torch.stack([torch.arange(700) // d for d in (90, 300, 700)]).to(torch.int32).cuda()
    flags = torch.tensor([True, False, True, False], device="cuda")
    mods = {"documents": (MaskMod("doc[b][q_idx] == doc[b][kv_idx]", doc=doc), {}),
            "prefix-lm": (MaskMod("kv_idx < 150 || q_idx >= kv_idx"), {}),
            "dilated-per-head": (MaskMod("flags[h] ? (q_idx - kv_idx) % 3 == 0 : 1", flags=flags),
                                 {"window_size": (200, 200)}),
            "empty-rows": (MaskMod("q_idx % 5 != 0 && (q_idx / 128 + kv_idx / 128) % 3 != 1"), {})}
    mask, extra = mods[case]
    if family == "mma_sync":
        if not _is_hopper():
            pytest.skip("the default family is the mma.sync one here")
        monkeypatch.setenv("FLASHTRAIN_SM90", "0")
    elif _is_hopper():  # the warpgroup-MMA kernels are the ones these calls dispatch to (head dim 512: mma.sync)
        defines = mask.kernel_defines()
        fwd = build.fwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                               mask_defines=defines)
        bwd = build.bwd_kernel(head_dim, "bf16", causal, False, arch=build.SM90_ARCH, score_mods=True,
                               mask_defines=defines)
        hopper = head_dim in build.MASK_SM90_HEAD_DIMS
        assert (fwd.source == "flash_fwd_sm90.cu") == hopper == (bwd.source == "flash_bwd_sm90.cu"), (fwd.name,
                                                                                                      bwd.name)
    features = {"mask_mod": mask, **extra}
    if causal and "window_size" in features:
        features["window_size"] = (features["window_size"][0], 0)
    q, k, v, dout = _inputs((3, 700, 4, head_dim), (3, 700, 2, head_dim), torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=causal, features=features)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((sum(lengths), 4, head_dim), (sum(lengths), 2, head_dim), torch.float16, seed=3)
    _check_against_reference(q, k, v, dout, causal=causal, features=features, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    q, k, v, dout = _inputs((2, 457, 4, head_dim), (2, 200, 2, head_dim), torch.bfloat16, seed=5)  # seqlen_q > k
    if case != "documents":  # (doc's 700 positions cover either length)
        _check_against_reference(q, k, v, dout, causal=causal, features=features)


@pytest.mark.parametrize("head_dim", [4, 36, 100, 250, 500])  # not multiples of 8: padded with zero columns
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dims_off_the_multiples_of_8_run_on_the_kernel(head_dim, causal):
    q, k, v, dout = _inputs((2, 300, 4, head_dim), (2, 300, 2, head_dim), torch.bfloat16)
    out = _check_against_reference(q, k, v, dout, causal=causal)[0]
    assert out.shape == q.shape and out.is_contiguous()
    _check_against_reference(q, k, v, dout, causal=causal, dropout_p=0.1, generator_seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 512])
def test_dropout_matches_reference_with_the_kernels_mask(dtype, causal, head_dim):
    q, k, v, dout = _inputs((2, 300, 4, head_dim), (2, 257, 2, head_dim), dtype)
    _check_against_reference(q, k, v, dout, causal=causal, dropout_p=0.17, generator_seed=1234)


def test_dropout_varlen_matches_reference():
    lengths_q, lengths_k = [17, 0, 200, 1], [33, 4, 129, 1]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((sum(lengths_q), 2, 64), (sum(lengths_k), 2, 64), torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=True, dropout_p=0.3, generator_seed=7, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


def test_dropout_mask_statistics():
    q, k, _, _ = _inputs((2, 1024, 4, 64), (2, 1024, 4, 64), torch.float16)
    gen = torch.Generator("cuda").manual_seed(0)
    first = _ops().dropout_mask_for_testing(q, k, dropout_p=0.25, generator=gen)
    second = _ops().dropout_mask_for_testing(q, k, dropout_p=0.25, generator=gen)
    assert abs(first.float().mean().item() - 0.75) < 2e-3  # 8.4M draws: 4 standard deviations is 6e-4
    assert abs((first == second).float().mean().item() - (0.75**2 + 0.25**2)) < 2e-3  # a new draw per call
    # neighbouring rows and columns are not correlated (the 16x16 Philox tiles must not repeat)
    for a, b in ((first[..., 1:, :], first[..., :-1, :]), (first[..., 1:], first[..., :-1])):
        assert abs((a & b).float().mean().item() - 0.75**2) < 2e-3


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])  # (192: the 96-key kernel's transposed dK / dV partials)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_split_backward_matches_reference(head_dim, causal):
    """GQA shapes whose Hopper backward splits the group's query heads over tiles (ops._gqa_splits > 1; the splits
    reduce-add dK / dV into one fp32 copy): batch, uneven lengths, varlen, each by FlashAttention-2's rule; and the
    deterministic backward (a copy per split, summed in order) bitwise repeatable and close to the default."""
    q, k, v, dout = _inputs((2, 1000, 8, head_dim), (2, 1000, 1, head_dim), torch.bfloat16)
    _check_against_reference(q, k, v, dout, causal=causal)
    q, k, v, dout = _inputs((1, 777, 16, head_dim), (1, 901, 2, head_dim), torch.bfloat16, seed=1)
    _check_against_reference(q, k, v, dout, causal=causal)
    cu = torch.tensor([0, 1, 300, 1100], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs((1100, 8, head_dim), (1100, 2, head_dim), torch.bfloat16, seed=2)
    _check_against_reference(q, k, v, dout, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=800,
                             max_seqlen_k=800)

    def grads(deterministic):
        def fn(q, k, v):
            return _ops().flash_attn_cuda(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=1000,
                                          max_seqlen_k=1000, dropout_p=0.0, softmax_scale=head_dim**-0.5, causal=causal,
                                          generator=None, deterministic=deterministic)
        return _run(fn, q4, k4, v4, dout4)[2:]

    q4, k4, v4, dout4 = _inputs((2, 1000, 8, head_dim), (2, 1000, 1, head_dim), torch.bfloat16, seed=3)
    first, second, reduced = grads(True), grads(True), grads(False)
    for a, b, c in zip(first, second, reduced):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------------- backward modes
def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v, dout = _inputs((2, 1000, 4, 64), (2, 1000, 2, 64), torch.bfloat16)

    def grads(deterministic):
        def fn(q, k, v):
            return _ops().flash_attn_cuda(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=1000,
                                          max_seqlen_k=1000, dropout_p=0.0, softmax_scale=0.125, causal=True,
                                          generator=None, deterministic=deterministic)
        return _run(fn, q, k, v, dout)[2:]

    first, second, atomic = grads(True), grads(True), grads(False)
    for a, b, c in zip(first, second, atomic):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=2e-2, rtol=1e-2)


def test_opcheck():
    ops = _ops()
    q, k, v, _ = _inputs((2, 70, 4, 64), (2, 50, 2, 64), torch.float16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    rng_state = ops._draw_rng_state(q.device, None)
    for args in [(q, k, v, None, None, 70, 50, 0.0, 0.125, True, None, False),
                 (q, k, v, None, None, 70, 50, 0.1, 0.125, False, rng_state, True)]:
        torch.library.opcheck(ops.flash_attn_fwd, args)
    cu_q = torch.tensor([0, 30, 70], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 20, 50], dtype=torch.int32, device="cuda")
    torch.library.opcheck(ops.flash_attn_fwd, (q[0], k[0], v[0], cu_q, cu_k, 40, 30, 0.0, 0.125, True, None, False))
    # the score modifications: window (left, right), softcap, ALiBi slopes per (sequence, head)
    slopes = torch.rand(2, 4, device="cuda") * 0.1
    torch.library.opcheck(ops.flash_attn_fwd, (q, k, v, None, None, 70, 50, 0.0, 0.125, False, None, False, None,
                                               None, 20, 5, 30.0, slopes))


def test_torch_compile_has_no_graph_break_at_attention():
    q, k, v, dout = _inputs((2, 256, 4, 64), (2, 256, 4, 64), torch.bfloat16)

    def block(q, k, v):
        return flash_attn_func(q.sin(), k, v, causal=True).cos()

    compiled = torch.compile(block, fullgraph=True)  # fullgraph: any graph break raises
    expected = _run(lambda q, k, v: (block(q, k, v), None), q, k, v, dout)
    got = _run(lambda q, k, v: (compiled(q, k, v), None), q, k, v, dout)
    for a, b in zip(got, expected):
        if a is not None:  # inductor's fused sin/cos round differently from eager's: bf16 tolerances
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("feature", ["score_mods", "mask_mod"])
def test_torch_compile_with_the_features(feature):
    """window_size, softcap and alibi_slopes, and mask_mod, under torch.compile(fullgraph=True): the ops' fake
    implementations take them (mask_mod: the block states as the flashtrain::mask_states op, its fake giving the
    packed shape), no graph break; out and gradients those of eager."""
    from flashtrain.kernels.mask_mod import MaskMod

    if feature == "score_mods":
        q, k, v, dout = _inputs((2, 256, 4, 64), (2, 256, 4, 64), torch.bfloat16)
        slopes = torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)], device="cuda")
        options = {"window_size": (64, 0), "softcap": 20.0, "alibi_slopes": slopes}
    else:
        q, k, v, dout = _inputs((2, 300, 4, 64), (2, 300, 2, 64), torch.bfloat16)
        doc = (torch.arange(300, device="cuda") // 70).to(torch.int32)
        options = {"mask_mod": MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)}

    def block(q, k, v):
        return flash_attn_func(q.sin(), k, v, causal=True, **options).cos()

    compiled = torch.compile(block, fullgraph=True)
    expected = _run(lambda q, k, v: (block(q, k, v), None), q, k, v, dout)
    got = _run(lambda q, k, v: (compiled(q, k, v), None), q, k, v, dout)
    for a, b in zip(got, expected):
        if a is not None:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_cuda_graph_capture_replays():
    q, k, v, _ = _inputs((2, 300, 4, 64), (2, 300, 4, 64), torch.float16)
    expected = flash_attn_func(q, k, v, causal=True, impl="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(q, k, v, causal=True, impl="cuda")  # warm-up: compile and load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True, impl="cuda")
    q.mul_(0.5)
    graph.replay()
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True, impl="cuda"), atol=0, rtol=0)
    assert not torch.equal(out, expected)


def test_cuda_graph_capture_replays_a_mask_mod_with_new_tensor_contents():
    """mask_mod inside a CUDA graph: the block states are computed in the captured work (not taken from the cache
    filled by the warm-up), so a replay after the mask's tensor changed in place uses its new contents."""
    from flashtrain.kernels.mask_mod import MaskMod

    q, k, v, _ = _inputs((1, 600, 4, 64), (1, 600, 4, 64), torch.bfloat16)
    doc = (torch.arange(600, device="cuda") // 300).to(torch.int32)
    mask = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(q, k, v, causal=True, mask_mod=mask)  # warm-up: compiles, and fills the states cache
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(q, k, v, causal=True, mask_mod=mask)
    doc.copy_((torch.arange(600, device="cuda") // 100).to(torch.int32))  # six documents instead of two
    graph.replay()
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True, mask_mod=mask), atol=0, rtol=0)
    torch.testing.assert_close(out, flash_attn_func(q, k, v, causal=True, impl="reference", mask_mod=mask),
                               atol=2e-2, rtol=2e-2)


def _sanitizer_grid() -> None:
    """A small grid of forward + backward calls covering every kernel path (on Hopper the warpgroup-MMA kernels too:
    head dims 40, 64, 128 with and without dropout, the dense hd128 backward's 80-query blocks, the causal hd128
    forward's two Q buffers, its long-key tiles, alone and in 2-CTA clusters, the hd64 forward in clusters, head
    dims 72 / 80 / 96 on the hd128 tiles narrowed to 80 / 96 columns, the dense kernels' tail split, the hd64 causal
    forward's two Q buffers on a small L2), for compute-sanitizer."""
    for head_dim, dtype, causal, dropout_p in [(64, torch.float16, False, 0.0), (128, torch.bfloat16, True, 0.1),
                                                (96, torch.float16, True, 0.0), (256, torch.bfloat16, False, 0.0),
                                                (40, torch.bfloat16, True, 0.0), (192, torch.float16, False, 0.2),
                                                (128, torch.bfloat16, True, 0.0), (72, torch.float16, False, 0.0),
                                                (128, torch.float16, False, 0.0), (192, torch.bfloat16, True, 0.0),
                                                (160, torch.float16, False, 0.0)]:
        q, k, v, dout = _inputs((2, 97, 4, head_dim), (2, 130, 2, head_dim), dtype)
        _run(lambda q, k, v: flash_attn_func(q, k, v, dropout_p, causal=causal, return_lse=True, impl="cuda"),
             q, k, v, dout)
        lengths = torch.tensor([0, 1, 17, 97, 33])
        cu = torch.tensor([0, *lengths.cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v, dout = _inputs((int(lengths.sum()), 4, head_dim), (int(lengths.sum()), 1, head_dim), dtype)
        _run(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 97, 97, dropout_p, causal=causal,
                                                    return_lse=True, impl="cuda"), q, k, v, dout)
    # the persistent Hopper backward with several tiles per CTA (256 tiles: its epilogue staging), GQA-split and
    # deterministic; head dim 512: the Hopper forward's two warpgroups over several tiles per CTA (512 tiles: the
    # partial-S buffers' parity across tiles), the mma.sync backward's dQ pieces, deterministic too
    for head_dim, nheads_kv, causal, deterministic in [(64, 16, False, False), (64, 4, True, False),
                                                       (64, 16, False, True), (64, 16, True, True),
                                                       (128, 16, True, False), (128, 16, False, False),
                                                       (128, 4, False, False), (128, 16, False, True),
                                                       (80, 16, True, False), (96, 16, True, False),
                                                       (256, 2, True, False),
                                                       (192, 16, False, False), (192, 2, True, False),
                                                       (512, 16, True, False),
                                                       (512, 2, False, True)]:
        q, k, v, dout = _inputs((1, 2048, 16, head_dim), (1, 2048, nheads_kv, head_dim), torch.bfloat16)
        _run(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, return_lse=True,
                                             impl="cuda"), q, k, v, dout)
    # the causal hd128 backward at 16K + 40 queries (64-query blocks, S^T waited for before dP^T is issued), and on
    # 80-query blocks (BWD_SM90_Q80_CAUSAL_SEQLEN set to 4K for it), each with a partial last block
    from flashtrain.kernels import build, ops

    for n, q80_from in ((16384 + 40, build.BWD_SM90_Q80_CAUSAL_SEQLEN), (4096 + 40, 4096)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(build, "BWD_SM90_Q80_CAUSAL_SEQLEN", q80_from)
            ops.clear_plans()  # (the launch plans hold the kernel they were built with)
            q, k, v, dout = _inputs((1, n, 2, 128), (1, n, 2, 128), torch.bfloat16)
            _run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True, impl="cuda"), q, k, v, dout)
    ops.clear_plans()
    # the dense forward and backward with their last tiles in pieces (build.FWD_TAIL_SPLIT, BWD_TAIL_SPLIT; the split
    # forced: 7 tail tiles in 3 pieces, hd64 and hd128, and the hd256 forward over 320 tiles)
    for head_dim, nheads in ((64, 4), (128, 4), (256, 40)):  # (hd256: 320 tiles, the register epilogue)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(build, "BWD_TAIL_SPLIT", 1)
            patch.setattr(build, "FWD_TAIL_SPLIT", 1)
            patch.setattr(ops, "_tail_split", lambda n_tiles, sm_count, steps: (n_tiles - 7, 3))
            ops.clear_plans()
            q, k, v, dout = _inputs((1, 1000, nheads, head_dim), (1, 1000, nheads, head_dim), torch.bfloat16)
            _run(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="cuda"), q, k, v, dout)
    ops.clear_plans()
    # the causal hd128 mods backward with a sliding window (64-query blocks, K / V released by a tile's last query
    # block), GQA, more keys than queries (key blocks before the first query's window: tiles without query blocks)
    q, k, v, dout = _inputs((1, 700, 8, 128), (1, 1500, 2, 128), torch.bfloat16)
    _run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(256, 0), return_lse=True, impl="cuda"),
         q, k, v, dout)
    # the causal hd128 forward below 1K query rows (two Q buffers) with several tiles per CTA (256 tiles)
    q, k, v, dout = _inputs((2, 960, 16, 128), (2, 960, 16, 128), torch.bfloat16)
    _run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True, impl="cuda"), q, k, v, dout)
    # the causal forward at head dims 192 / 256 up to FWD_SM90_WIDE_SHORT_CAUSAL_SEQLEN query rows (64-key tiles),
    # GQA, several tiles per CTA, the partial tile first
    for head_dim in (192, 256):
        q, k, v, dout = _inputs((4, 700, 16, head_dim), (4, 700, 4, head_dim), torch.bfloat16)
        _run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True, impl="cuda"), q, k, v, dout)
    # the hd128 forward's long-key tiles (192 keys, O from registers) with a partial last key block
    for causal in (False, True):
        q, k, v, dout = _inputs((1, 333, 4, 128), (1, 8269, 2, 128), torch.bfloat16)
        _run(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="cuda"), q, k, v, dout)
    # ... non-causal in 2-CTA clusters (2 query tiles per head, the second partial)
    q, k, v, dout = _inputs((2, 250, 4, 128), (2, 8269, 2, 128), torch.bfloat16)
    assert not build.FWD_SM90_CLUSTER or build.fwd_kernel(128, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=250,
                                                          seqlen_k=8269).tiles.cluster == 2
    _run(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="cuda"), q, k, v, dout)
    # ... and at head dim 64 (build.FWD_SM90_CLUSTER_HD64: halves of a key block's rows; the last block's 30 rows
    # leave the second half past the keys), more tiles than CTAs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "FWD_SM90_CLUSTER_HD64", 1)
        patch.setattr(build, "FWD_TAIL_SPLIT", 0)
        ops.clear_plans()
        q, k, v, dout = _inputs((2, 4 * 192 - 7, 40, 64), (2, 8192 + 30, 10, 64), torch.bfloat16)
        spec = build.fwd_kernel(64, "bf16", False, False, arch=build.SM90_ARCH, seqlen_q=q.shape[1],
                                seqlen_k=k.shape[1])
        assert not build.FWD_SM90_CLUSTER or spec.tiles.cluster == 2
        _run(lambda q, k, v: flash_attn_func(q, k, v, return_lse=True, impl="cuda"), q, k, v, dout)
    ops.clear_plans()
    # the short causal forward on a GPU with a small L2 (launch.l2_bytes as an H100's): hd64 on 192-row tiles with two
    # Q buffers, several tiles per CTA, the partial tile first, GQA
    with pytest.MonkeyPatch.context() as patch:
        from flashtrain.kernels import launch

        patch.setattr(launch, "l2_bytes", lambda device: 50 << 20)
        patch.setattr(build, "SMALL_L2_BYTES", 50 << 20)
        ops.clear_plans()
        q, k, v, dout = _inputs((4, 700, 16, 64), (4, 700, 4, 64), torch.bfloat16)
        assert build.fwd_kernel(64, "bf16", True, False, arch=build.SM90_ARCH, seqlen_q=700,
                                small_l2=True).tiles.q_buffers == 2
        _run(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True, impl="cuda"), q, k, v, dout)
    ops.clear_plans()
    torch.cuda.synchronize()
    print("sanitizer grid done")


if __name__ == "__main__":
    sys.exit(_sanitizer_grid())
