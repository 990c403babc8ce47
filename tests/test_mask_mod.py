"""Mask expressions (flashtrain.kernels.mask_mod): parsing, C semantics of the torch evaluation, the C emitted for the
kernels (compiled here with the host C++ compiler and run on the same grid), and errors that name the expression."""

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from flashtrain.kernels import build
from flashtrain.kernels.mask_mod import MaskMod, MaskModError


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
