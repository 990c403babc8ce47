"""window_size, softcap and ALiBi on the reference (tiled FlashAttention) against the naive oracle, float64: outputs,
lse and gradients; the tiles a window skips; the CUDA kernels say they do not have the features yet."""
import math

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func
from flashtrain.kernels.naive import naive_attention
from flashtrain.kernels.reference import _visible_tiles


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = lambda s, h: (batch, s, h, head_dim)  # noqa: E731
    return [torch.randn(shape(s, h), generator=generator, dtype=torch.float64, requires_grad=True)
            for s, h in ((seqlen_q, nheads), (seqlen_k, nheads_kv), (seqlen_k, nheads_kv))]


def _compare(out, lse, expected_out, expected_lse, inputs, dout):
    assert torch.allclose(out, expected_out, atol=1e-10), (out - expected_out).abs().max()
    finite = expected_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and torch.allclose(lse[finite], expected_lse[finite], atol=1e-10)
    grads = torch.autograd.grad(out, inputs, dout)
    expected = torch.autograd.grad(expected_out, inputs, dout)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-9), (got - want).abs().max()


FEATURES = [
    dict(window_size=(40, 40)),
    dict(window_size=(100, -1)),
    dict(window_size=(-1, 7)),
    dict(window_size=(130, 0)),  # a sliding window of 131 keys, written as causal's right bound
    dict(window_size=(64, -1), causal=True),  # causal local attention (Mistral)
    dict(window_size=(0, 0)),  # each query sees only its aligned key
    dict(softcap=2.0),
    dict(softcap=0.5, causal=True),
    dict(alibi="heads"),
    dict(alibi="batch", causal=True),
    dict(alibi="heads", softcap=3.0, window_size=(90, 20)),
]


@pytest.mark.parametrize("features", FEATURES, ids=[str(f) for f in FEATURES])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(300, 300), (200, 330), (330, 200)])
def test_reference_matches_the_oracle(features, seqlen_q, seqlen_k):
    features = dict(features)
    causal = features.pop("causal", False)
    alibi = features.pop("alibi", None)
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 4, 2)
    if alibi is not None:  # ALiBi's geometric slopes 2^(-8 h / nheads), per head or per (sequence, head)
        slopes = torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)], dtype=torch.float32)
        features["alibi_slopes"] = slopes if alibi == "heads" else torch.stack([slopes, 2 * slopes])
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="reference", **features)
    expected_out, expected_lse = naive_attention(q, k, v, causal=causal, **features)
    dout = torch.randn_like(out)
    _compare(out, lse, expected_out, expected_lse, (q, k, v), dout)


def test_varlen_reference_matches_the_oracle_with_every_feature():
    lengths_q, lengths_k = [150, 0, 37, 260], [150, 12, 80, 200]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths_q), 4, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 1, 16, generator=generator, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    slopes = torch.rand(4, 4, generator=generator) * 0.2  # per (sequence, head)
    features = dict(window_size=(50, 10), softcap=1.5, alibi_slopes=slopes)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True,
                                      impl="reference", **features)
    expected_out, expected_lse = naive_attention(q, k, v, cu_q, cu_k, **features)
    _compare(out, lse, expected_out, expected_lse, (q, k, v), torch.randn_like(out))


def test_a_window_skips_the_tiles_outside_it():
    # 16K tokens, window 1024 either side of the diagonal (left only, causal): a band of 128-token tiles, work
    # proportional to the window; tiles fully inside need no mask
    n = 16384 // 128
    tiles = _visible_tiles(16384, 16384, (1024, 0), None, 1, torch.device("cpu"))
    assert len(tiles) == sum(min(i, 8) + 1 for i in range(n))  # each query tile: itself and up to 8 to its left
    assert len(tiles) / (n * (n + 1) / 2) < 1 / 7.3  # 1116 of the 8256 causal tiles at 16K
    masked = [t for t in tiles if t.on_diagonal]
    assert all(t.k_tile == t.q_tile or t.k_tile == t.q_tile - 8 for t in masked)  # the diagonal and the far edge
    assert len(_visible_tiles(300, 300, (-1, -1), None, 1, torch.device("cpu"))) == 9


def test_rows_whose_window_holds_no_key_output_zero():
    q, k, v = _inputs(1, 50, 10, 2, 2)  # queries aligned with keys -40 .. 9: a window of (0, 3) misses for 37
    out, lse = flash_attn_func(q, k, v, window_size=(0, 3), return_lse=True, impl="reference")
    assert torch.all(out[0, :37] == 0) and torch.all(lse[0, :, :37] == -math.inf)
    assert torch.all(lse[0, :, 37:].isfinite())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.isfinite().all() for g in grads) and torch.all(grads[0][0, :37] == 0)


def test_softcap_bounds_the_scores():
    # with q = k and huge norms, the scores are far beyond +-softcap; capped, the lse is at most softcap + log(n)
    q = torch.full((1, 64, 1, 16), 10.0, dtype=torch.float64)
    _, lse = flash_attn_func(q, q, q, softcap=5.0, return_lse=True, impl="reference")
    assert torch.all(lse <= 5.0 + math.log(64) + 1e-9)
    _, plain = flash_attn_func(q, q, q, return_lse=True, impl="reference")
    assert torch.all(plain > 100.0)


def test_the_cuda_kernels_say_which_features_they_lack():
    q, k, v = (x.detach().float() for x in _inputs(1, 8, 8, 2, 2))
    for features in (dict(window_size=(4, 0)), dict(softcap=30.0), dict(alibi_slopes=torch.ones(2))):
        with pytest.raises(RuntimeError, match="impl='cuda' cannot run"):
            flash_attn_func(q, k, v, impl="cuda", **features)
    from flashtrain.kernels import interface
    q_cuda = type("FakeCudaTensor", (), {"device": torch.device("cuda", 0)})()  # past the device check only
    ops, reason = interface._cuda_ops_or_reason(q_cuda, None, None, {"mask_mod": None, "softcap": 30.0},
                                                dropout_p=0.1)
    assert ops is None and reason == ("softcap / mask_mod with dropout run on impl='reference' only (the CUDA "
                                      "kernels have them without)")
    ops, reason = interface._cuda_ops_or_reason(q_cuda, None, None, {"window_size": (4, 0), "softcap": 3.0},
                                                dropout_p=0.1)
    assert ops is None and reason == ("window_size / softcap with dropout run on impl='reference' only (the CUDA "
                                      "kernels have them without)")


MASK_MODS = [
    ("doc[q_idx] == doc[kv_idx]", False),  # documents packed in each sequence
    ("doc[q_idx] == doc[kv_idx]", True),  # ... causal inside each document
    ("kv_idx < 40 || q_idx >= kv_idx", False),  # prefix-LM: a bidirectional prefix of 40 tokens, causal after it
    ("q_idx - kv_idx < 70 && (q_idx - kv_idx) % 3 == 0", True),  # a dilated causal window
    ("h % 2 == 0 ? q_idx >= kv_idx : kv_idx >= q_idx", False),  # heads look back or forward
    ("b == 0 || kv_idx > 150", False),  # per sequence of the batch; some rows see no key
]


@pytest.mark.parametrize("expression, causal", MASK_MODS, ids=[f"{e} causal={c}" for e, c in MASK_MODS])
def test_mask_mod_reference_matches_the_oracle(expression, causal):
    from flashtrain.kernels.mask_mod import MaskMod

    doc = torch.repeat_interleave(torch.arange(5), torch.tensor([30, 100, 1, 90, 79]))  # 300 tokens
    mod = MaskMod(expression, doc=doc) if "doc" in expression else expression
    q, k, v = _inputs(2, 300, 300, 4, 2)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, impl="reference", mask_mod=mod)
    expected_out, expected_lse = naive_attention(q, k, v, causal=causal,
                                                 mask_mod=mod if isinstance(mod, MaskMod) else MaskMod(mod))
    _compare(out, lse, expected_out, expected_lse, (q, k, v), torch.randn_like(out))


def test_a_document_mask_equals_varlen_attention_over_the_documents_and_skips_tiles():
    from flashtrain.kernels.mask_mod import MaskMod
    from flashtrain.kernels.reference import _GroupCompute, _seq_groups

    lengths = [200, 1, 300, 11]
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))  # 512 tokens
    q, k, v = _inputs(1, 512, 512, 2, 1)
    out = flash_attn_func(q, k, v, causal=True, impl="reference",
                          mask_mod=MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 300, 300, causal=True, impl="reference")
    assert torch.allclose(out[0], packed, atol=1e-12)
    # 4 x 4 tiles of 128 tokens, causal: 10; the documents leave out the tiles between document 0 (tokens 0-199)
    # and document 2 (tokens 201-500) that hold no pair of one document: (2, 0), (3, 0)
    group = _seq_groups(torch.tensor([0, 512]), torch.tensor([0, 512]))[0]
    compute = _GroupCompute(group, nheads=2, nheads_kv=1, device=q.device, window=(-1, 0), block_mask=None,
                            dropout_p=0.0, dropout_mask=None, dropout_seed=0,
                            mask_mod=MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc))
    assert sorted((t.q_tile, t.k_tile) for t in compute.tiles) == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 1),
                                                                   (3, 2), (3, 3)]


def test_mask_mod_is_validated_and_the_cuda_kernels_refuse_it_with_a_block_mask():
    from flashtrain.kernels import interface
    from flashtrain.kernels.mask_mod import MaskModError

    q, k, v = (x.detach() for x in _inputs(1, 8, 8, 2, 2))
    with pytest.raises(TypeError, match="mask_mod must be a MaskMod"):
        flash_attn_func(q, k, v, impl="reference", mask_mod=3)
    with pytest.raises(MaskModError, match="unknown name 'doc'"):
        flash_attn_func(q, k, v, impl="reference", mask_mod="doc[q_idx] > 0")
    q_cuda = type("FakeCudaTensor", (), {"device": torch.device("cuda", 0)})()
    ops, reason = interface._cuda_ops_or_reason(q_cuda, torch.ones(1, 1, dtype=torch.bool), None, {"mask_mod": None})
    assert ops is None and reason.startswith("mask_mod with a block_mask run on impl='reference' only")


@pytest.mark.parametrize("head_dim", [320, 512])
def test_head_dims_up_to_512_on_the_reference(head_dim):
    q, k, v = _inputs(1, 140, 140, 2, 1, head_dim=head_dim)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, impl="reference", softcap=5.0)
    expected_out, expected_lse = naive_attention(q, k, v, causal=True, softcap=5.0)
    _compare(out, lse, expected_out, expected_lse, (q, k, v), torch.randn_like(out))
    with pytest.raises(ValueError, match=r"head_dim \(q.shape\[-1\]\) must be in \[1, 512\]"):
        flash_attn_func(*(torch.zeros(1, 4, 1, 520) for _ in range(3)), impl="reference")


def test_the_feature_benchmark_compares_like_with_like(monkeypatch):
    """benchmarks/attention_features.py: each row's FlexAttention score_mod / mask_mod computes what flashtrain's call
    computes (CPU, float32, rows scaled down), and its pair counts are the masks' (the FLOPs of the rows)."""
    import dataclasses

    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_WARNINGS_SHOWN", set())  # its once-per-process warning stays for other tests
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "attention_features.py"
    monkeypatch.syspath_prepend(str(path.parent))  # (its sibling modules: fa4_baseline, attention_timing)
    spec = importlib.util.spec_from_file_location("attention_features", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # (its dataclass resolves annotations through sys.modules)
    spec.loader.exec_module(bench)
    cpu = torch.device("cpu")
    for row in bench.feature_rows():
        small = dataclasses.replace(row, batch=2, seqlen=256, nheads=2, head_dim=16,
                                    window=min(row.window, 40), documents=4 if row.documents else 0)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 256, 2, 16, generator=gen) for _ in range(3))
        expected = bench.flashtrain_fn(small, cpu, impl="reference")(q, k, v)
        got = bench.flex_fn(small, cpu, compile_flex=False)(q, k, v)
        assert torch.allclose(got, expected, atol=2e-5), (row.name, (got - expected).abs().max())
        _, mask_mod = bench.flex_mods(small, cpu)
        i = torch.arange(256)
        visible = mask_mod(0, 0, i[:, None], i[None, :])
        assert int(visible.sum()) == small.pairs(), row.name
        tiles = visible.view(256 // 32, 32, 256 // 32, 32).any(dim=3).any(dim=1)  # 32 x 32 tiles holding a pair
        assert small.computed_tiles(32) == int(tiles.sum()), row.name
    assert bench.feature_rows()[0].pairs() == 1025 * 1026 // 2 + (16384 - 1025) * 1025  # window 1024 at 16K
    assert bench.feature_rows()[0].computed_tiles() == 36 + 9 * 120  # 128-row tiles: 9 key tiles from the 9th
