"""Attention calls with nothing to compute, and batches with empty sequences.

A call without work -- no sequence, no query row, no key row, no query head, max_seqlen 0 -- returns out 0 and
lse -inf (every query sees no key) and zero gradients, as FlashAttention does; a query row of a sequence whose keys
are empty does the same inside a batch with work, and no value anywhere is NaN. GRID lists the cases; the same
checks (check_step) run here on the reference (the CPU path) and, in tests/test_empty_inputs_cuda.py, on both CUDA
kernel families, each family in a child process so that a crash fails its case instead of the run.

Also here: the launch plans of calls without work (no launch, the outputs filled), the C++ host layer executing
them (record mode, CPU tensors: no GPU needed), and the tile sizing at zero blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func, naive_attention

# A case: "lengths" (the query and key length of each sequence: varlen, max_seqlen (q, k)) or "dense" (batch,
# seqlen_q, seqlen_k); heads (nheads, nheads_kv), head_dim, causal; optional window (left, right), softcap,
# block_mask (all ones: the block-sparse path).
GRID: dict[str, dict] = {
    # varlen, no work
    "varlen-no-rows-hd128-causal": dict(lengths=([0], [0]), max_seqlen=(1, 1), heads=(4, 4), head_dim=128,
                                        causal=True),
    "varlen-no-key-rows-hd64": dict(lengths=([130], [0]), max_seqlen=(130, 0), heads=(4, 4), head_dim=64,
                                    causal=False),
    "varlen-no-key-rows-hd128-causal-gqa": dict(lengths=([130], [0]), max_seqlen=(130, 1), heads=(4, 2),
                                                head_dim=128, causal=True),
    "varlen-no-query-rows-gqa": dict(lengths=([0, 0], [70, 3]), max_seqlen=(0, 70), heads=(4, 2), head_dim=64,
                                     causal=True),
    "varlen-no-sequences": dict(lengths=([], []), max_seqlen=(0, 0), heads=(4, 4), head_dim=64, causal=False),
    "varlen-no-sequences-max-seqlen-1": dict(lengths=([], []), max_seqlen=(1, 1), heads=(4, 2), head_dim=128,
                                             causal=True),
    "varlen-max-seqlen-0": dict(lengths=([0, 0], [0, 0]), max_seqlen=(0, 0), heads=(2, 2), head_dim=64,
                                causal=True),
    "varlen-no-query-heads": dict(lengths=([20], [20]), max_seqlen=(20, 20), heads=(0, 1), head_dim=64,
                                  causal=False),
    "varlen-no-key-rows-block-mask": dict(lengths=([130, 5], [0, 0]), max_seqlen=(130, 0), heads=(2, 2),
                                          head_dim=64, causal=True, block_mask=True),
    "varlen-no-key-rows-window-softcap": dict(lengths=([40], [0]), max_seqlen=(40, 0), heads=(2, 1), head_dim=64,
                                              causal=False, window=(16, 4), softcap=20.0),
    # varlen with work: some sequences without queries, keys or both (the kernels run)
    "varlen-empty-sequences-causal": dict(lengths=([0, 50, 0, 70], [30, 0, 0, 70]), max_seqlen=(70, 70),
                                          heads=(4, 2), head_dim=64, causal=True),
    "varlen-empty-sequences": dict(lengths=([50, 0, 70, 3], [0, 30, 70, 0]), max_seqlen=(70, 70), heads=(2, 2),
                                   head_dim=64, causal=False),
    "varlen-no-sequence-with-both": dict(lengths=([0, 40], [40, 0]), max_seqlen=(40, 40), heads=(2, 2), head_dim=64,
                                         causal=False),  # rows on both sides: the kernels run, every pair empty
    # batch form, no work
    "batch-0": dict(dense=(0, 64, 64), heads=(4, 4), head_dim=64, causal=True),
    "seqlen-q-0-gqa": dict(dense=(2, 0, 64), heads=(4, 2), head_dim=64, causal=True),
    "seqlen-k-0-gqa": dict(dense=(2, 64, 0), heads=(4, 2), head_dim=64, causal=False),
    "seqlen-k-0-hd128-causal": dict(dense=(2, 130, 0), heads=(4, 4), head_dim=128, causal=True),
    "seqlen-q-and-k-0": dict(dense=(2, 0, 0), heads=(4, 4), head_dim=128, causal=False),
    "no-query-heads": dict(dense=(2, 16, 16), heads=(0, 1), head_dim=64, causal=False),
    "seqlen-k-0-hd40": dict(dense=(1, 33, 0), heads=(2, 2), head_dim=40, causal=True),  # head dim padded to 48
}
STEPS = ("fwd", "bwd")


def has_work(case: dict) -> bool:
    """Whether some query of the case sees some key (else: out 0, lse -inf, zero gradients everywhere)."""
    if case["heads"][0] == 0:
        return False
    if "dense" in case:
        return min(case["dense"]) > 0
    return any(lq > 0 and lk > 0 for lq, lk in zip(*case["lengths"]))


def _offsets(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def case_inputs(case: dict, device, dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of the case: varlen (total, heads, head_dim), batch form (batch, seqlen, heads, head_dim)."""
    (hq, hk), d = case["heads"], case["head_dim"]
    if "dense" in case:
        batch, seqlen_q, seqlen_k = case["dense"]
        shape_q, shape_k = (batch, seqlen_q, hq, d), (batch, seqlen_k, hk, d)
    else:
        lengths_q, lengths_k = case["lengths"]
        shape_q, shape_k = (sum(lengths_q), hq, d), (sum(lengths_k), hk, d)
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
                 for shape in (shape_q, shape_k, shape_k, shape_q))


def _options(case: dict, device) -> dict:
    options = dict(causal=case["causal"])
    if "window" in case:
        options["window_size"] = tuple(case["window"])
    if "softcap" in case:
        options["softcap"] = case["softcap"]
    if case.get("block_mask"):
        max_q, max_k = case["max_seqlen"] if "lengths" in case else case["dense"][1:]
        options["block_mask"] = torch.ones(math.ceil(max_q / 128), math.ceil(max_k / 128), dtype=torch.bool,
                                           device=device)
    return options


def attend(case: dict, q, k, v, impl: str):
    """(out, lse) of flash_attn_func / flash_attn_varlen_func on the case's inputs."""
    options = _options(case, q.device)
    if "dense" in case:
        return flash_attn_func(q, k, v, return_lse=True, impl=impl, **options)
    cu_q, cu_k = (_offsets(lengths, q.device) for lengths in case["lengths"])
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, *case["max_seqlen"], return_lse=True, impl=impl, **options)


def _sequences(case: dict) -> list[tuple[tuple, tuple]]:
    """(index of its queries, index of its keys) per sequence, into q / k: varlen rows, batch form an entry."""
    if "dense" in case:
        return [((b,), (b,)) for b in range(case["dense"][0])]
    lengths_q, lengths_k = case["lengths"]
    cu_q, cu_k = (_offsets(lengths, "cpu").tolist() for lengths in (lengths_q, lengths_k))
    return [((slice(cu_q[b], cu_q[b + 1]),), (slice(cu_k[b], cu_k[b + 1]),)) for b in range(len(lengths_q))]


def _lse_by_row(case: dict, lse: torch.Tensor) -> torch.Tensor:
    """lse in q's row layout without head_dim: varlen (total_q, nheads), batch form (batch, seqlen_q, nheads)."""
    return lse.t() if "dense" not in case else lse.transpose(1, 2)


def oracle(case: dict, q, k, v, dout) -> dict[str, torch.Tensor]:
    """out, lse (q's row layout), dq, dk, dv in float64 on the CPU: naive attention per sequence that has queries
    and keys; 0 (lse -inf) for the others. Also "unseen_keys": bool per key row, True for keys of sequences without
    queries (their dk, dv must be exactly 0)."""
    q, k, v, dout = (x.detach().double().cpu() for x in (q, k, v, dout))
    expected = dict(out=torch.zeros_like(q), lse=torch.full(q.shape[:-1], -math.inf, dtype=torch.float64),
                    dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v),
                    unseen_keys=torch.ones(k.shape[:-2], dtype=torch.bool))
    options = _options(case, "cpu")
    options.pop("block_mask", None)  # all ones
    for rows_q, rows_k in _sequences(case):
        qs, ks, vs = (x[rows].unsqueeze(0).requires_grad_() for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
        if qs.shape[1] == 0 or ks.shape[1] == 0 or qs.shape[2] == 0:
            continue
        expected["unseen_keys"][rows_k] = False
        out, lse = naive_attention(qs, ks, vs, **options)
        dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout[rows_q].unsqueeze(0))
        expected["out"][rows_q], expected["lse"][rows_q] = out[0].detach(), lse[0].t()
        expected["dq"][rows_q], expected["dk"][rows_k], expected["dv"][rows_k] = dq[0], dk[0], dv[0]
    return expected


def check_step(case: dict, step: str, device, dtype, impl: str) -> list[str]:
    """Runs the case's forward ("fwd") or forward and backward ("bwd") and returns what is wrong (empty: nothing):
    shapes, NaN / inf, out and dq exactly 0 and lse exactly -inf for queries that see no key, dk and dv exactly 0
    for keys that no query sees, everything else near the float64 naive attention."""
    q, k, v, dout = case_inputs(case, device, dtype)
    expected = oracle(case, q, k, v, dout)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = attend(case, q, k, v, impl)
    got = {"out": out, "lse": _lse_by_row(case, lse)}
    if step == "bwd":
        got.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)))
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    problems = []
    no_key = expected["lse"] == -math.inf  # queries (by row and head) that see no key
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 4e-2
    for name, value in got.items():
        want = expected[name]
        value = value.detach().double().cpu()
        if value.shape != want.shape:
            problems.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(want.shape)}")
            continue
        if name == "lse":
            if torch.isnan(value).any() or (value == math.inf).any():
                problems.append(f"lse: {int((torch.isnan(value) | (value == math.inf)).sum())} NaN / +inf values")
            if not (value[no_key] == -math.inf).all():
                problems.append(f"lse: {int((value[no_key] != -math.inf).sum())} queries that see no key are not -inf")
            seen = ~no_key
            if (value[seen] == -math.inf).any():
                problems.append("lse: -inf for a query that sees keys")
            elif seen.any() and (value[seen] - want[seen]).abs().max() > tolerance * 10:
                problems.append(f"lse: off by {float((value[seen] - want[seen]).abs().max()):.3g}")
            continue
        if not torch.isfinite(value).all():
            problems.append(f"{name}: {int((~torch.isfinite(value)).sum())} non-finite values")
            continue
        if name in ("out", "dq") and (value[no_key] != 0).any():
            problems.append(f"{name}: nonzero values for queries that see no key")
        if name in ("dk", "dv") and (value[expected["unseen_keys"]] != 0).any():
            problems.append(f"{name}: nonzero values for keys that no query sees")
        if value.numel() and (value - want).abs().max() > tolerance * max(1.0, float(want.abs().max())):
            problems.append(f"{name}: off by {float((value - want).abs().max()):.3g} "
                            f"(largest expected value {float(want.abs().max()):.3g})")
    return problems


# ---------------------------------------------------------------------------------------------- the reference (CPU)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("name", GRID)
def test_reference_on_empty_and_partly_empty_calls(name, step):
    """The CPU path (flashtrain.kernels.reference) on every case: zeros, lse -inf, zero gradients, no NaN."""
    assert check_step(GRID[name], step, "cpu", torch.float32, "reference") == []


def test_grid_has_cases_with_and_without_work():
    assert {has_work(case) for case in GRID.values()} == {True, False}


# -------------------------------------------------------------------------------- the launch plans and the executors

def _op_arguments(case: dict, q: torch.Tensor):
    """cu_seqlens_q, cu_seqlens_k (None in the batch form), max_seqlen_q, max_seqlen_k of the ops."""
    cu_q = cu_k = None
    if "lengths" in case:
        cu_q, cu_k = (_offsets(lengths, q.device) for lengths in case["lengths"])
        max_q, max_k = case["max_seqlen"]
    else:
        max_q, max_k = case["dense"][1:]
    return cu_q, cu_k, max_q, max_k


def launches_nothing(case: dict) -> bool:
    """Whether the shapes and max_seqlen alone say there is no work (no sequence, query head, query row or key row,
    or a max_seqlen of 0): such a call launches no kernel."""
    if "dense" in case:
        return min(*case["dense"], case["heads"][0]) == 0
    (lengths_q, lengths_k), (max_q, max_k) = case["lengths"], case["max_seqlen"]
    return min(len(lengths_q), sum(lengths_q), sum(lengths_k), max_q, max_k, case["heads"][0]) == 0


NO_WORK = [name for name, case in GRID.items() if launches_nothing(case)]


@pytest.mark.parametrize("name", GRID)
def test_no_work_is_told_from_shapes_and_max_seqlen(name):
    """ops.no_work holds for every case without work but one whose sequences each lack queries or keys (only the
    offsets tell, on the GPU: the kernels run and find nothing to do)."""
    from flashtrain.kernels import ops

    case = GRID[name]
    q, k, _, _ = case_inputs(case, "cpu", torch.bfloat16)
    cu_q, _, max_q, max_k = _op_arguments(case, q)
    assert ops.no_work(q, k, cu_q, max_q, max_k) == launches_nothing(case)
    assert not launches_nothing(case) or not has_work(case)


@pytest.mark.parametrize("name", NO_WORK)
def test_plans_of_calls_without_work_launch_nothing(name):
    """ops.no_work, and the plans the executors run for such calls: no launch (no grid, tile group or tensor map
    is sized; nothing needs the GPU or cuda-python), out 0, lse -inf, dq dk dv 0."""
    from flashtrain.kernels import ops

    case = GRID[name]
    q, k, v, dout = case_inputs(case, "cpu", torch.bfloat16)
    cu_q, cu_k, max_q, max_k = _op_arguments(case, q)
    fwd = ops._fwd_plan(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, 0.125, case["causal"], None)
    assert fwd.launches == []
    out, lse = ops._execute(fwd, [q, k, v, cu_q, cu_k])
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == ops._output_shapes(q, cu_q)[1][0] and (lse == -math.inf).all()
    bwd = ops._bwd_plan(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, 0.125, case["causal"], False, None)
    assert bwd.launches == []
    grads = ops._execute(bwd, [dout, q, k, v, out, lse, cu_q, cu_k])
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all((g == 0).all() for g in grads)
    assert fwd.flat()[:2] == [ops._PLAN_FORMAT, 2] and bwd.flat()[:2] == [ops._PLAN_FORMAT, 3]


@pytest.fixture(scope="module")
def host_layer():
    """The C++ host layer (compiled with g++ at first use, then cached on disk) in record mode: CPU tensors, every
    launch recorded instead of issued."""
    from flashtrain.kernels import build, ops

    if build.cxx_path() is None:
        pytest.skip("no C++ compiler (g++ or $CXX) for the host layer")
    ops.load_host()
    torch.ops.flashtrain._clear_plans()
    torch.ops.flashtrain._record_launches(True)
    yield ops
    torch.ops.flashtrain._record_launches(False)
    torch.ops.flashtrain._clear_plans()


@pytest.mark.parametrize("name", NO_WORK)
def test_host_layer_runs_calls_without_work_without_launching(host_layer, name):
    """The whole CUDA path -- ops.flash_attn_cuda (head dim padding included), the C++ op, its plan, executor and
    autograd node -- on a call without work: no launch, out 0, lse -inf, zero gradients (no Hopper plan encoding
    tensor maps over zero rows at a null address, the SIGSEGV of such calls on sm_90a)."""
    ops = host_layer
    case = GRID[name]
    q, k, v, dout = case_inputs(case, "cpu", torch.bfloat16)
    cu_q, cu_k, max_q, max_k = _op_arguments(case, q)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.ops.flashtrain._recorded_launches()  # (clears)
    out, lse = ops.flash_attn_cuda(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                   max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=0.125, causal=case["causal"],
                                   generator=None, validated=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.ops.flashtrain._recorded_launches() == []
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == ops._output_shapes(q, cu_q)[1][0] and (lse == -math.inf).all()
    for grad, x in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == x.shape and (grad == 0).all()


def test_tile_sizing_with_zero_blocks():
    """max_seqlen 0: the causal tile groups and the Hopper backward's GQA splits are sized without dividing by zero
    or taking the max of no key blocks."""
    from flashtrain.kernels import build, ops

    assert ops._causal_tile_group(0, 8, 132) == 8
    tiles = build.BWD_SM90_TILES[128]
    assert ops._gqa_splits(4, 0, 0, tiles, True, 2, 132) == 1
    assert ops._gqa_splits(4, 100, 0, tiles, False, 2, 132) == 1


def test_tensor_map_of_an_empty_tensor_is_refused():
    """An empty tensor (null address, a dimension of size 0) has no valid tensor map: the Python executor's
    encoder refuses it by name instead of handing it to the driver."""
    from flashtrain.kernels import tma

    layout = (tma._DTYPES[torch.bfloat16], (64, 0, 4, 1), (128, 128, 16), 64, 128, tma.SWIZZLE_128B)
    with pytest.raises(ValueError, match="tensor map over an empty tensor"):
        tma.tensor_map(0, layout)
