"""Mask expressions (flashtrain.kernels.mask_mod): parsing, C semantics of the torch evaluation, the C emitted for the
kernels (compiled here with the host C++ compiler and run on the same grid), and errors that name the expression."""

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from flashtrain.kernels import build
from flashtrain.kernels.mask_mod import MaskMod, MaskModError, pack_states


def _grid(B=2, H=3, S=9):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1), torch.arange(S).view(1, 1, S, 1),
            torch.arange(S).view(1, 1, 1, S))


def test_document_mask_equals_the_explicit_one():
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = MaskMod("doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx", doc=doc).evaluate(*_grid())
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    expected = (doc[:, None] == doc[None, :]) & (q >= k)
    assert mask.shape == (2, 3, 9, 9) and mask.dtype == torch.bool and torch.equal(mask[1, 2], expected)


def test_two_dimensional_tensors_prefix_lm_and_dilated_windows():
    doc = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2], [0] * 9])  # per sequence of the batch
    mask = MaskMod("doc[b][q_idx] == doc[b][kv_idx]", doc=doc).evaluate(*_grid())
    assert torch.equal(mask[0, 0], doc[0][:, None] == doc[0][None, :]) and mask[1].all()
    prefix = MaskMod("kv_idx < 4 || kv_idx <= q_idx").evaluate(*_grid())[0, 0]
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    assert torch.equal(prefix, (k < 4) | (k <= q))
    dilated = MaskMod("q_idx >= kv_idx && q_idx - kv_idx < 6 && (q_idx - kv_idx) % 2 == 0").evaluate(*_grid())[0, 0]
    assert torch.equal(dilated, (q >= k) & (q - k < 6) & ((q - k) % 2 == 0))
    per_head = MaskMod("abs(q_idx - kv_idx) <= h").evaluate(*_grid())
    assert torch.equal(per_head[0, 2], (q - k).abs() <= 2)


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-7 / 2", -3), ("7 / -2", -3), ("-7 % 3", -1), ("7 % -3", 1),
    ("1 << 3 | 1", 9), ("6 & 3 ^ 1", 3), ("~0", -1), ("!5", 0), ("!0", 1), ("2 < 3 == 1", 1), ("0 || 3", 1),
    ("2 && 0", 0), ("1 ? 2 : 3 ? 4 : 5", 2), ("0 ? 2 : 0 ? 4 : 5", 5), ("min(3, -4) + max(2, 9)", 5),
    ("abs(-6)", 6), ("10 - 4 - 3", 3), ("64 >> 2 >> 1", 8), ("1 + -+-2", 3),
])
def test_operators_follow_c(expression, value):
    grid = (torch.zeros(1, 1, 1, 1, dtype=torch.long),) * 4
    assert (MaskMod(expression).evaluate(*grid) == bool(value)).all()
    assert int(MaskMod(expression)._eval(MaskMod(expression).ast, dict(zip(("b", "h", "q_idx", "kv_idx"),
                                                                           grid)))) == value


@pytest.mark.parametrize("expression, tensors, message", [
    ("q_idx >= ", {}, "unexpected end of the expression at column 10"),
    ("q_idx >= kv", {}, "unknown name 'kv'"),
    ("q_idx = kv_idx", {}, "unexpected character '='"),
    ("doc[q_idx] == 1", {"doc": torch.zeros(2, 2, dtype=torch.long)}, "needs as many subscripts, got 1"),
    ("q_idx[0]", {}, "q_idx is an index, it cannot be subscripted"),
    ("q_idx > 0", {"doc": torch.zeros(2, dtype=torch.long)}, "tensor 'doc' is given but not used"),
    ("sqrt(q_idx)", {}, "unknown function 'sqrt'"),
    ("min(q_idx)", {}, r"min\(\) takes 2 argument"),
    ("", {}, "empty expression"),
    ("(q_idx > 0", {}, r"expected '\)'"),
    ("q_idx > 0 )", {}, r"unexpected '\)'"),
    ("d[q_idx] > 0", {"d": torch.zeros(3)}, "must be an integer or bool tensor"),
    ("b > 0", {"h": torch.zeros(3, dtype=torch.long)}, "the name is taken"),
])
def test_errors_name_the_expression_and_what_is_wrong(expression, tensors, message):
    with pytest.raises(MaskModError, match=message) as error:
        MaskMod(expression, **tensors)
    assert repr(expression) in str(error.value)


def test_too_many_tensors_and_out_of_range_subscripts():
    five = {f"t{i}": torch.zeros(3, dtype=torch.long) for i in range(5)}
    with pytest.raises(MaskModError, match="at most 4 tensors"):
        MaskMod(" + ".join(f"t{i}[q_idx]" for i in range(5)) + " > 0", **five)
    with pytest.raises(MaskModError, match="subscript 0 of 'doc' reaches 0..8, outside 0..3"):
        MaskMod("doc[q_idx] == 0", doc=torch.zeros(4, dtype=torch.long)).evaluate(*_grid())


def test_emitted_c_computes_the_same_mask():
    cxx = build.cxx_path()
    if cxx is None:
        pytest.skip("no C++ compiler")
    doc = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 1, 1, 2, 2, 2, 2, 3, 3]], dtype=torch.int32)
    flags = torch.tensor([1, 0, 1], dtype=torch.bool)
    mod = MaskMod("(doc[b][q_idx] == doc[b][kv_idx] && q_idx >= kv_idx) || (flags[h] && q_idx - kv_idx < 3 && "
                  "(q_idx - kv_idx) % 2 == 0) || kv_idx == min(b, 1) * 8 ? abs(-1) : 0 / 1", doc=doc, flags=flags)
    params = ", ".join(["long long b", "long long h", "long long q_idx", "long long kv_idx"] + mod.c_declarations())
    values = lambda t: ", ".join(str(int(x)) for x in t.flatten().tolist())  # noqa: E731
    program = f"""#include <cstdio>
static long long mask(%s) {{ return %s; }}
int main() {{
    const int doc[] = {{{values(doc)}}};
    const bool flags[] = {{{values(flags)}}};
    for (int b = 0; b < 2; ++b) for (int h = 0; h < 3; ++h) for (int q = 0; q < 9; ++q) for (int k = 0; k < 9; ++k)
        std::putchar(mask(b, h, q, k, doc, 9, 1, flags, 1) != 0 ? '1' : '0');
}}
""" % (params, mod.c_source())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.cpp"
        path.write_text(program)
        subprocess.run([cxx, "-O1", "-o", str(Path(tmp) / "m"), str(path)], check=True, capture_output=True)
        out = subprocess.run([str(Path(tmp) / "m")], check=True, capture_output=True, text=True).stdout
    from_c = torch.tensor([c == "1" for c in out]).view(2, 3, 9, 9)
    assert torch.equal(from_c, mod.evaluate(*_grid()))
    assert 0 < int(from_c.sum()) < from_c.numel()


# ---- block states: the skip list of the kernels ------------------------------------------------------------------

def _cases():
    """(MaskMod, batch, nheads, lengths_q, lengths_k): document masks (per sequence, varlen), prefix-LM, a head-
    dependent dilated window; lengths not multiples of the tile."""
    doc = torch.tensor([[0] * 5 + [1] * 20 + [2] * 12, [0] * 30 + [3] * 7], dtype=torch.int32)
    flags = torch.tensor([True, False, True])
    return [
        (MaskMod("doc[b][q_idx] == doc[b][kv_idx] && q_idx >= kv_idx", doc=doc), 2, 3, [37, 37], [37, 37]),
        (MaskMod("kv_idx < 11 || kv_idx <= q_idx"), 2, 3, [37, 37], [30, 30]),
        (MaskMod("flags[h] ? (q_idx - kv_idx) % 3 == 0 && kv_idx <= q_idx : abs(q_idx - kv_idx) < 6", flags=flags),
         2, 3, [37, 37], [37, 37]),
        (MaskMod("q_idx >= kv_idx"), 3, 2, [20, 0, 33], [25, 9, 33]),  # varlen (a sequence without queries)
    ]


def _brute_states(mod, batch, nheads, lengths_q, lengths_k, block):
    """Tile states from evaluating every pair of every (sequence, head)."""
    n_q, n_k = -(-max(lengths_q) // block), -(-max(lengths_k) // block)
    out = torch.zeros(batch, nheads, n_q, n_k, dtype=torch.uint8)
    for b in range(batch):
        for h in range(nheads):
            if not lengths_q[b] or not lengths_k[b]:
                continue
            full = mod.evaluate(b, h, torch.arange(lengths_q[b])[:, None], torch.arange(lengths_k[b])[None, :])
            for qb in range(-(-lengths_q[b] // block)):
                for kb in range(-(-lengths_k[b] // block)):
                    tile = full[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
                    out[b, h, qb, kb] = 2 if bool(tile.all()) else 1 if bool(tile.any()) else 0
    return out


@pytest.mark.parametrize("index", range(4))
def test_block_states_are_exact(index):
    """MaskMod.block_states (the torch path): 0 / 1 / 2 per tile as every pair's value says; the batch and head
    dimensions only where the expression reads b / h (or the sequences are varlen)."""
    mod, batch, nheads, lengths_q, lengths_k = _cases()[index]
    block = 8
    varlen = len(set(lengths_q)) > 1 or len(set(lengths_k)) > 1
    cu = {}
    if varlen:
        cu = {f"cu_seqlens_{side}": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
              for side, lengths in (("q", lengths_q), ("k", lengths_k))}
    states, error = mod.block_states(batch, nheads, max(lengths_q), max(lengths_k), device="cpu", block=block, **cu)
    expected = _brute_states(mod, batch, nheads, lengths_q, lengths_k, block)
    batches = batch if "b" in mod.index_names or varlen else 1
    heads = nheads if "h" in mod.index_names else 1
    assert states.shape == (batches, heads, *expected.shape[2:]) and int(error) == 0
    assert torch.equal(states, expected[:batches, :heads])
    assert set(states.unique().tolist()) <= {0, 1, 2} and int((states == 1).sum()) > 0


def test_checked_c_reads_nothing_outside_a_tensor():
    """The kernels' C (c_source(checked=True)): an out-of-range subscript calls FT_MM_OOB() (records the error, reads
    0) instead of loading; in range it computes what evaluate does."""
    cxx = build.cxx_path()
    if cxx is None:
        pytest.skip("no C++ compiler")
    doc = torch.tensor([3, 3, 5, 5], dtype=torch.int32)
    mod = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    params = ", ".join(["long long q_idx", "long long kv_idx"] + mod.c_declarations() + ["long long mm_doc_n0"])
    program = f"""#include <cstdio>
static int errors = 0;
#define FT_MM_OOB() (++errors, 0LL)
static long long mask({params}) {{ return {mod.c_source(checked=True)}; }}
int main() {{
    const int doc[] = {{3, 3, 5, 5}};
    for (int q = 0; q < 6; ++q) for (int k = 0; k < 6; ++k) std::putchar(mask(q, k, doc, 1, 4) ? '1' : '0');
    std::printf(" %d", errors);
}}
"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.cpp"
        path.write_text(program)
        subprocess.run([cxx, "-O1", "-o", str(Path(tmp) / "m"), str(path)], check=True, capture_output=True)
        out = subprocess.run([str(Path(tmp) / "m")], check=True, capture_output=True, text=True).stdout
    bits, errors = out.split()
    got = torch.tensor([c == "1" for c in bits]).view(6, 6)
    i = torch.arange(4)
    assert torch.equal(got[:4, :4], mod.evaluate(0, 0, i[:, None], i[None, :]))
    # one error per subscript past the tensor: 16 pairs with one of q, kv past it, 4 pairs with both (two each)
    assert int(errors) == 16 + 2 * 4
    assert not bool(got[:4, 4:].any()) and not bool(got[4:, :4].any())  # doc 3 / 5 against the 0 read instead


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
@pytest.mark.slow
def test_mask_blocks_kernel_compiles_for_each_expression():
    """csrc/mask_blocks.cu with each case's expression compiled in (nvcc, sm_80 and sm_90a), one kernel per
    expression, cached by the macros; the emitted C has no comma (nvcc splits -D values at commas)."""
    specs = [build.mask_blocks_kernel(case[0]) for case in _cases()]
    assert len({spec.name for spec in specs}) == len(specs)
    # the mma.sync forward and backward with the first expression compiled in (FT_MASK_EXPR: skip empty tiles,
    # the expression on partial ones)
    # and the warpgroup-MMA (sm_90a) ones
    forward = [kernel(64, "bf16", causal, False, arch=arch, score_mods=True,
                      mask_defines=_cases()[0][0].kernel_defines())
               for kernel in (build.fwd_kernel, build.bwd_kernel) for causal in (False, True)
               for arch in ("sm_80", "sm_90a")]
    assert {spec.source for spec in forward} == {"flash_fwd.cu", "flash_bwd.cu", "flash_fwd_sm90.cu",
                                                 "flash_bwd_sm90.cu"}
    assert all(spec.name.endswith(specs[0].name.removeprefix("ft_mask_blocks_")) for spec in forward)
    assert build.check_nvcc(["sm_80", "sm_90a"], jobs=2, specs=specs + forward) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("index", range(4))
def test_gpu_block_states_are_the_torch_ones(index):
    """csrc/mask_blocks.cu (the expression compiled in, one CTA per tile) gives the torch path's states."""
    mod, batch, nheads, lengths_q, lengths_k = _cases()[index]
    gpu_mod = MaskMod(mod.expression, **{name: t.cuda() for name, t in mod.tensors.items()})
    varlen = len(set(lengths_q)) > 1 or len(set(lengths_k)) > 1
    for block in (8, 16):
        cu, cu_gpu = {}, {}
        if varlen:
            cu = {f"cu_seqlens_{side}": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                     dtype=torch.int32) for side, lengths in (("q", lengths_q),
                                                                                              ("k", lengths_k))}
            cu_gpu = {name: t.cuda() for name, t in cu.items()}
        for window in ((-1, -1), (-1, 0), (5, 3), (12, 0)):
            expected, _ = mod.block_states(batch, nheads, max(lengths_q), max(lengths_k), device="cpu", block=block,
                                           window=window, **cu)
            states, error = gpu_mod.block_states(batch, nheads, max(lengths_q), max(lengths_k), device="cuda",
                                                 block=block, window=window, **cu_gpu)
            assert torch.equal(states.cpu(), expected) and int(error) == 0, (block, window)


@pytest.mark.parametrize("window", [(-1, 0), (5, 3), (12, 0), (0, -1)])
def test_block_states_zero_the_tiles_a_window_hides(window):
    """window=(before, after) (causal: after 0): a tile whose every pair lies outside the window is 0 without being
    evaluated (the kernels never visit it); every other tile keeps the expression's state. Varlen and bottom-right
    alignment (seqlen_k != seqlen_q) included."""
    zeros = [0, 0]  # tiles at 0 without / with the window, over the cases
    for mod, batch, nheads, lengths_q, lengths_k in _cases():
        varlen = len(set(lengths_q)) > 1 or len(set(lengths_k)) > 1
        cu = {}
        if varlen:
            cu = {f"cu_seqlens_{side}": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                     dtype=torch.int32) for side, lengths in (("q", lengths_q),
                                                                                              ("k", lengths_k))}
        plain, _ = mod.block_states(batch, nheads, max(lengths_q), max(lengths_k), device="cpu", block=8, **cu)
        cut, _ = mod.block_states(batch, nheads, max(lengths_q), max(lengths_k), device="cpu", block=8,
                                  window=window, **cu)
        for b in range(cut.shape[0]):
            len_q, len_k = (lengths_q[b], lengths_k[b]) if varlen else (lengths_q[0], lengths_k[0])
            q, k = torch.arange(len_q)[:, None], torch.arange(len_k)[None, :]
            dist = k - q - (len_k - len_q)
            inside = torch.ones(len_q, len_k, dtype=torch.bool)
            if window[1] >= 0:
                inside &= dist <= window[1]
            if window[0] >= 0:
                inside &= dist >= -window[0]
            for qb in range(-(-len_q // 8)):
                for kb in range(-(-len_k // 8)):
                    seen = bool(inside[qb * 8:(qb + 1) * 8, kb * 8:(kb + 1) * 8].any())
                    assert torch.equal(cut[b, :, qb, kb], plain[b, :, qb, kb] if seen else
                                       torch.zeros_like(plain[b, :, qb, kb])), (mod, b, qb, kb)
        zeros = [zeros[0] + int((plain == 0).sum()), zeros[1] + int((cut == 0).sum())]
    assert zeros[1] > zeros[0]


def test_packed_states_hold_each_rows_and_columns_range():
    """pack_states (the kernels' layout, flash.h mm_states): rows padded to 4 bytes, then per query block the first /
    last non-empty key block, then per key block the first / last query block non-empty in any head."""
    states = torch.zeros(2, 3, 5, 6, dtype=torch.uint8)
    states[0, 1, 2, 1:4] = torch.tensor([1, 2, 1])
    states[0, 2, 4, 5] = 2
    states[1, 0, 0, 0] = 1
    packed = pack_states(states)
    assert packed.shape == (2, 3, 5 * 8 + 8 * 5 + 8 * 6)
    assert torch.equal(packed[:, :, :40].view(2, 3, 5, 8)[..., :6], states)
    rows = packed[:, :, 40:80].contiguous().view(torch.int32).view(2, 3, 5, 2)
    cols = packed[:, :, 80:].contiguous().view(torch.int32).view(2, 3, 6, 2)
    for b in range(2):
        for h in range(3):
            for q in range(5):
                keys = states[b, h, q].nonzero().flatten().tolist()
                assert rows[b, h, q].tolist() == ([keys[0], keys[-1]] if keys else [6, -1])
            for k in range(6):
                queries = states[b, :, :, k].any(0).nonzero().flatten().tolist()
                assert cols[b, h, k].tolist() == ([queries[0], queries[-1]] if queries else [5, -1])


def test_mask_states_op_fake_gives_the_packed_shape():
    """flashtrain::mask_states (the states as one op, for torch.compile): its fake implementation (meta tensors)
    has the shape of pack_states(block_states(...)) for batch / head / varlen expressions."""
    from flashtrain.kernels.mask_mod import mask_mod_text, mask_states

    doc = torch.zeros(3, 300, dtype=torch.int32)
    flags = torch.zeros(4, dtype=torch.bool)
    cu = torch.tensor([0, 100, 300, 300], dtype=torch.int32)
    for mod, varlen in [(MaskMod("doc[b][q_idx] == doc[b][kv_idx]", doc=doc), False),
                        (MaskMod("flags[h] ? q_idx >= kv_idx : 1", flags=flags), False),
                        (MaskMod("kv_idx < 40 || q_idx >= kv_idx"), True)]:
        tensors = list(mod.tensors.values())
        expected = pack_states(mod.block_states(3, 4, 300, 300, device="cpu", block=128,
                                                **({"cu_seqlens_q": cu, "cu_seqlens_k": cu} if varlen else {}))[0])
        meta = lambda x: None if x is None else x.to("meta")  # noqa: E731
        states, error = mask_states(torch.empty(3, 300, 4, 64, device="meta"), mask_mod_text(mod), 3, 300, 300, -1,
                                    0, meta(cu if varlen else None), meta(cu if varlen else None),
                                    *[meta(t) for t in tensors], *[None] * (4 - len(tensors)))
        assert states.shape == expected.shape and states.dtype == torch.uint8 and error.shape == (1,)


@pytest.mark.parametrize("expression, tensors, proven", [
    ("doc[q_idx] == doc[kv_idx]", {"doc": 16}, True),
    ("doc[q_idx] == doc[kv_idx]", {"doc": 15}, False),  # seqlen 16: q_idx reaches 15
    ("doc[b][q_idx / 2] == doc[b][kv_idx / 2]", {"doc": (2, 8)}, True),
    ("doc[min(q_idx + 3 * h, 15)] > 0", {"doc": 16}, True),
    ("doc[q_idx + h] > 0", {"doc": 16}, False),
    ("doc[(q_idx - kv_idx) % 16 + 15] > 0", {"doc": 31}, True),  # C's %: -15..15
    ("doc[abs(q_idx - kv_idx)] > 0", {"doc": 16}, True),
    ("doc[doc[q_idx]] > 0", {"doc": 16}, False),  # a tensor's value as a subscript: not bounded
    ("doc[q_idx >> 1] == doc[kv_idx & 7]", {"doc": 8}, True),
    ("q_idx % (kv_idx - 3) == 0", {}, False),  # a divisor that may be zero
    ("q_idx % (kv_idx + 1) == 0", {}, True),
    ("flags[h] ? doc[q_idx] > 0 : 1", {"doc": 16, "flags": 4}, True),
])
def test_subscripts_proven_in_range(expression, tensors, proven):
    """Interval arithmetic over b < 2, h < 4, q_idx, kv_idx < 16: proven means no pair of the grid subscripts outside
    a tensor (checked against evaluating every pair); unproven subscripts are checked on the error word instead."""
    made = {name: torch.zeros(shape if isinstance(shape, tuple) else (shape,), dtype=torch.int32)
            for name, shape in tensors.items()}
    mod = MaskMod(expression, **made)
    assert mod.subscripts_in_range(2, 4, 16, 16) == proven
    if proven:
        i = torch.arange(16)
        mod.evaluate(torch.arange(2)[:, None, None, None], torch.arange(4)[None, :, None, None],
                     i[None, None, :, None], i[None, None, None, :])  # raises on a subscript outside


def test_bounds_that_64_bit_arithmetic_could_wrap_are_not_proven():
    """The kernels compute in 64-bit integers: a bound past them (a shift or product that wraps, abs of INT64_MIN) is
    unproven, and a literal that does not fit is refused."""
    x = torch.zeros(5, dtype=torch.int32)
    t = torch.zeros(4, dtype=torch.int64)
    assert not MaskMod("x[(q_idx << 62) % 5] == 0", x=x).subscripts_in_range(1, 1, 4, 4)
    assert not MaskMod("x[(q_idx * 4611686018427387904 * 2) % 5] == 0", x=x).subscripts_in_range(1, 1, 4, 4)
    assert not MaskMod("x[abs(t[q_idx]) % 5] == 0", x=x, t=t).subscripts_in_range(1, 1, 4, 4)
    assert MaskMod("x[abs(t[q_idx] % 5)] == 0", x=x, t=t).subscripts_in_range(1, 1, 4, 4)
    assert MaskMod("x[(q_idx << 2) % 5] == 0", x=x).subscripts_in_range(1, 1, 4, 4)
    with pytest.raises(MaskModError, match="64-bit"):
        MaskMod("q_idx < 9223372036854775808")


def test_checked_c_catches_a_zero_divisor():
    """A divisor of 0 in the kernels' C sets the error word and reads 0 (C's division by zero is undefined)."""
    cxx = build.cxx_path()
    if cxx is None:
        pytest.skip("no C++ compiler")
    mod = MaskMod("q_idx % kv_idx == 0 && q_idx / kv_idx < 3")
    program = f"""#include <cstdio>
static int errors = 0;
#define FT_MM_OOB() (++errors, 0LL)
static long long mask(long long q_idx, long long kv_idx) {{ return {mod.c_source(checked=True)}; }}
int main() {{
    for (int q = 0; q < 4; ++q) for (int k = 0; k < 4; ++k) std::putchar(mask(q, k) ? '1' : '0');
    std::printf(" %d", errors);
}}
"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.cpp"
        path.write_text(program)
        subprocess.run([cxx, "-O1", "-o", str(Path(tmp) / "m"), str(path)], check=True, capture_output=True)
        bits, errors = subprocess.run([str(Path(tmp) / "m")], check=True, capture_output=True,
                                      text=True).stdout.split()
    i = torch.arange(4)
    got = torch.tensor([c == "1" for c in bits]).view(4, 4)
    assert torch.equal(got[:, 1:], mod.evaluate(0, 0, i[:, None], i[None, 1:]))
    assert int(errors) == 2 * 4  # kv_idx = 0: both divisions, for each of the 4 queries


def test_call_states_are_cached_until_a_tensor_changes():
    """MaskMod.call_states: one evaluation for repeated calls with the same shapes and unmodified tensors (the
    layers of a model), a new one after an in-place write, other shapes or other cu_seqlens tensors."""
    doc = torch.arange(40, dtype=torch.int32) // 13
    mod = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    first = mod.call_states(1, 2, 40, 40, device="cpu", block=8)
    assert mod.call_states(1, 2, 40, 40, device="cpu", block=8)[0] is first[0]
    doc[20:] = 7  # an in-place write bumps the version counter
    again = mod.call_states(1, 2, 40, 40, device="cpu", block=8)
    assert again[0] is not first[0] and not torch.equal(again[0], first[0])
    assert torch.equal(again[0], pack_states(mod.block_states(1, 2, 40, 40, device="cpu", block=8)[0]))
    assert mod.call_states(1, 2, 40, 40, device="cpu", block=8, window=(-1, 0))[0] is not again[0]
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    varlen = mod.call_states(2, 2, 20, 20, device="cpu", block=8, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert mod.call_states(2, 2, 20, 20, device="cpu", block=8, cu_seqlens_q=cu, cu_seqlens_k=cu)[0] is varlen[0]
    other = cu.clone()
    assert mod.call_states(2, 2, 20, 20, device="cpu", block=8, cu_seqlens_q=other,
                           cu_seqlens_k=other)[0] is not varlen[0]
    replaced = mod.call_states(1, 2, 40, 40, device="cpu", block=8)
    mod.tensors["doc"] = torch.zeros(40, dtype=torch.int32)  # another tensor (version 0 again): a new evaluation
    assert mod.call_states(1, 2, 40, 40, device="cpu", block=8)[0] is not replaced[0]
    with pytest.raises(MaskModError, match="outside"):  # the torch path raises on a subscript outside
        mod.call_states(1, 2, 41, 41, device="cpu", block=8)


@pytest.mark.cuda
def test_out_of_range_subscript_raises_before_attention():
    """On the kernels an unproven subscript (here one past the tensor) is caught on the block states' error word:
    MaskModError naming the expression, no attention output computed from zeros."""
    from flashtrain.kernels import flash_attn_func

    doc = torch.arange(200, device="cuda", dtype=torch.int32) // 50
    q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(MaskModError, match=r"doc\[q_idx\].*left its tensor"):
        flash_attn_func(q, q, q, causal=True, mask_mod=MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc))
    ok = MaskMod("doc[min(q_idx, 199)] == doc[min(kv_idx, 199)]", doc=doc)
    assert ok.subscripts_in_range(1, 2, 256, 256)
    out = flash_attn_func(q, q, q, causal=True, mask_mod=ok)
    assert out.shape == q.shape and bool(out.isfinite().all())


@pytest.mark.cuda
def test_gpu_out_of_range_subscript_sets_the_error_word():
    mod = MaskMod("doc[q_idx] == doc[kv_idx]", doc=torch.tensor([3, 3, 5, 5], dtype=torch.int32, device="cuda"))
    states, error = mod.block_states(1, 1, 6, 6, device="cuda", block=4)
    assert int(error) == 1 and states.shape == (1, 1, 2, 2)
    _, fine = mod.block_states(1, 1, 4, 4, device="cuda", block=4)
    assert int(fine) == 0
