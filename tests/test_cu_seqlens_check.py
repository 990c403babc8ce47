"""flashtrain.kernels.check_cu_seqlens: offsets built on the host are checked there, before the copy to the GPU,
where a bad one would trip a device-side assert that leaves the process's CUDA context unusable. The check names the
argument and the offending sequence; the data pipelines that build cu_seqlens (document masking's collate
function, Unpadding.of) call it; flash_attn_varlen_func runs it on CPU cu_seqlens.
"""

import numpy as np
import pytest
import torch

from flashtrain.data import lm
from flashtrain.kernels import check_cu_seqlens, flash_attn_varlen_func
from flashtrain.models import padding


@pytest.mark.parametrize("offsets", [
    [0, 10, 30],
    torch.tensor([0, 10, 30], dtype=torch.int32),
    torch.tensor([0, 10, 30], dtype=torch.int64),
    np.array([0, 10, 30]),
    (0, 0, 30, 30),  # empty sequences
])
def test_good_offsets_pass(offsets):
    check_cu_seqlens(offsets, 30, 30, name="cu_seqlens_q")
    check_cu_seqlens(offsets, 30)  # without max_seqlen


@pytest.mark.parametrize("offsets, total, max_seqlen", [([0], 0, 0), ([0, 0], 0, 0), ([0, 5], 5, 5)])
def test_empty_batches_and_sequences_pass(offsets, total, max_seqlen):
    check_cu_seqlens(torch.tensor(offsets, dtype=torch.int32), total, max_seqlen)


BAD = [  # (offsets, total, max_seqlen, error, message)
    ([0, 10, 40], 30, 40, ValueError, r"cu_seqlens_k: sequence 1 \(rows 10:40\) ends past the 30 packed rows"),
    ([0, 40, 30], 30, 40, ValueError,
     r"cu_seqlens_k must be non-decreasing: sequence 1 would end before it starts \(cu_seqlens_k\[1\] = 40, "
     r"cu_seqlens_k\[2\] = 30\)"),
    ([0, 10, 29], 30, 20, ValueError, r"cu_seqlens_k\[-1\] = 29 must equal the number of packed rows 30"),
    ([3, 10, 30], 30, 20, ValueError, r"cu_seqlens_k must start at 0, got cu_seqlens_k\[0\] = 3"),
    ([0, 10, 30], 30, 19, ValueError,
     r"max_seqlen_k = 19 is below the length 20 of sequence 1 of cu_seqlens_k \(rows 10:30\)"),
    ([], 0, 0, ValueError, "cu_seqlens_k must hold batch \\+ 1 >= 1 offsets"),
    ([[0, 10, 30]], 30, 20, ValueError, r"cu_seqlens_k must be 1-D"),
    ([0.0, 10.0, 30.0], 30, 20, TypeError, "cu_seqlens_k must hold integers"),
    ([0, 10, 30], None, 20, TypeError, "total must be an int"),
    ([0, 10, 30], 30, -1, ValueError, "max_seqlen_k must be >= 0"),
]


@pytest.mark.parametrize("offsets, total, max_seqlen, error, message", BAD, ids=[case[-1][:40] for case in BAD])
@pytest.mark.parametrize("kind", ["tensor", "list"])
def test_bad_offsets_are_refused_naming_the_argument_and_sequence(offsets, total, max_seqlen, error, message, kind):
    if kind == "tensor":
        dtype = torch.float32 if offsets and isinstance(np.ravel(offsets)[0], float) else torch.int32
        offsets = torch.tensor(offsets, dtype=dtype)
    with pytest.raises(error, match=message):
        check_cu_seqlens(offsets, total, max_seqlen, name="cu_seqlens_k", max_name="max_seqlen_k")


def test_varlen_attention_on_cpu_names_the_bad_sequence():
    """flash_attn_varlen_func checks CPU cu_seqlens with the same function, at once."""
    q, k = torch.randn(30, 2, 16), torch.randn(20, 2, 16)
    good_q, good_k = torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 5, 20], dtype=torch.int32)
    past_the_rows = torch.tensor([0, 5, 25], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: sequence 1 \(rows 5:25\) ends past the 20 packed rows"):
        flash_attn_varlen_func(q, k, k, good_q, past_the_rows, 20, 15)
    with pytest.raises(ValueError, match=r"max_seqlen_q = 19 is below the length 20 of sequence 1 of cu_seqlens_q"):
        flash_attn_varlen_func(q, k, k, good_q, good_k, 19, 15)


def test_the_docstring_says_what_a_bad_cuda_cu_seqlens_does():
    doc = flash_attn_varlen_func.__doc__
    assert "device-side assert" in doc and "unusable" in doc and "check_cu_seqlens" in doc


# ------------------------------------------------------------------------------------------------ the data pipelines


def _spy(monkeypatch, module):
    calls = []
    check = module.check_cu_seqlens

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return check(*args, **kwargs)

    monkeypatch.setattr(module, "check_cu_seqlens", spy)
    return calls


def test_document_masking_checks_the_offsets_it_builds(monkeypatch):
    """collate_documents (data.document_mask) checks the documents' cu_seqlens against the B * T packed tokens and
    the model's max_seqlen T, on the host."""
    calls = _spy(monkeypatch, lm)
    eos = 0
    samples = [(torch.tensor([5, 6, eos, 7, 8, 9, eos, 4]), torch.zeros(8, dtype=torch.int64)),
               (torch.tensor([eos, 1, 2, 3, 4, 5, 6, 7]), torch.zeros(8, dtype=torch.int64))]
    batch = lm.collate_documents(samples, eos, document_mask=True, reset_positions=False)
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 8, 9, 16]
    assert len(calls) == 1
    (offsets, total, max_seqlen), kwargs = calls[0]
    assert offsets is batch["cu_seqlens"] and (total, max_seqlen) == (16, 8) and kwargs["name"] == "cu_seqlens"


def test_corrupt_document_boundaries_stop_in_the_loader(monkeypatch):
    """Document offsets past the batch's tokens (a broken boundary finder, here simulated) raise in the collate
    function, naming cu_seqlens and the sequence, instead of reaching the kernel's device assert."""

    def corrupt(input_ids, eos_id):
        cu_seqlens, positions = document_offsets(input_ids, eos_id)
        cu_seqlens[-1] += 1  # one row past the B * T tokens
        return cu_seqlens, positions

    document_offsets = lm.document_offsets
    monkeypatch.setattr(lm, "document_offsets", corrupt)
    samples = [(torch.tensor([5, 6, 0, 7]), torch.zeros(4, dtype=torch.int64))] * 2
    with pytest.raises(ValueError, match=r"cu_seqlens: sequence 3 \(rows 7:9\) ends past the 8 packed rows"):
        lm.collate_documents(samples, 0, document_mask=True, reset_positions=False)
    lm.collate_documents(samples, 0, document_mask=False, reset_positions=True)  # no cu_seqlens handed on


def test_unpadding_checks_the_offsets_of_a_host_batch(monkeypatch):
    calls = _spy(monkeypatch, padding)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    unpadding = padding.Unpadding.of(mask)
    assert unpadding.cu_seqlens.tolist() == [0, 3, 4, 4]
    (offsets, total, max_seqlen), kwargs = calls[0]
    assert offsets is unpadding.cu_seqlens and (total, max_seqlen) == (4, 4) and kwargs["name"] == "cu_seqlens"


def test_unpadding_of_a_corrupt_offsets_builder_stops_on_the_host(monkeypatch):
    """A cu_seqlens that disagrees with the real tokens (a broken cumsum, here simulated) raises at once."""
    cumsum = torch.cumsum
    monkeypatch.setattr(padding.torch, "cumsum", lambda x, **kw: cumsum(x, **kw) * 2)
    with pytest.raises(ValueError, match=r"cu_seqlens: sequence 0 \(rows 0:6\) ends past the 4 packed rows"):
        padding.Unpadding.of(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]))
