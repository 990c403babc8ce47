"""Ring attention (flashtrain.parallel.ring_attention) against single-process attention on the unsharded tensors.

Real gloo processes on the CPU (tests/ring_attention_worker.py, started once per world size and module): every case
of the worker's CASES (causal and full, zigzag and contiguous, GQA and MQA, document masks with an empty and a
one-token document, a loss on lse as well as on out) runs through ring_attention on the reference, and out, lse, dq,
dk, dv gathered with unshard_sequence must equal flash_attn_func / flash_attn_varlen_func on the full tensors within
float64 1e-10 and float32 2e-5, relative to the largest magnitude (tests/test_attention.py's assert_close). Two ranks
in the default suite; four are marked slow. Without processes: the schedule of every rank computes each visible
(query, key) pair exactly once and no other, zigzag gives every rank the same causal work, and shard_positions.
On GPUs (marked cuda; NCCL, one process per GPU, 1 and 2 ranks as the GPUs allow): the same cases in bfloat16 on the
CUDA kernels, each of out, lse, dq, dk, dv within FlashAttention-2's rule of the float32 reference (at most twice
the single-process kernel's error), and deterministic runs bitwise equal.

    pytest -m cuda tests/test_ring_attention.py
"""

import itertools

import pytest
import torch

import ring_attention_worker as worker
from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func
from flashtrain.parallel.ring_attention import LAYOUTS, shard_positions, shard_sequence
from flashtrain.parallel.blockwise import ring_schedule
from tests.test_attention import RELATIVE_TOLERANCE, assert_close

WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]
RESULTS = ("out", "lse", "dq", "dk", "dv")


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """(world, backend) -> the worker's results, the processes of each started once (on first use)."""
    runs = {}

    def results(world: int, backend: str = "gloo") -> dict:
        if (world, backend) not in runs:
            directory = tmp_path_factory.mktemp(f"ring-{backend}-{world}")
            runs[world, backend] = worker.run(world, backend, directory)
        return runs[world, backend]

    return results


def single_process(name: str, dtype: torch.dtype, with_lse: bool | None = None, device: str = "cpu",
                   impl: str = "auto", compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """out, lse, dq, dk, dv of the case on the full tensors, in this process (with_lse: override the case's;
    compute_dtype: cast q, k, v to it first, as for a float32 reference of bfloat16 inputs)."""
    _, nheads_kv, _, causal, _, documents, case_lse, scale = worker.CASES[name]
    with_lse = case_lse if with_lse is None else with_lse
    q, k, v, dout, dlse = worker.case_inputs(name, dtype, device)
    if compute_dtype is not None:
        q, k, v = (x.to(compute_dtype) for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    batch, seqlen, nheads, head_dim = q.shape
    if documents:
        cu_seqlens = worker.document_offsets()
        out, lse = flash_attn_varlen_func(
            q.reshape(-1, nheads, head_dim), k.reshape(-1, nheads_kv, head_dim), v.reshape(-1, nheads_kv, head_dim),
            cu_seqlens.to(device), cu_seqlens.to(device), seqlen, seqlen, softmax_scale=scale, causal=causal,
            return_lse=True, impl=impl)
        out, lse = out.view(q.shape), lse.view(nheads, batch, seqlen).transpose(0, 1)
    else:
        out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, impl=impl)
    worker.loss_of(out, lse, dout.to(q.dtype), dlse, with_lse).backward()
    return [x.cpu() for x in (out.detach(), lse.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("dtype", worker.DTYPES["gloo"], ids=str)
@pytest.mark.parametrize("name", list(worker.CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_ring_attention_matches_single_process(ring_runs, world, name, dtype):
    ring = ring_runs(world)["cases"][name, str(dtype)]
    expected = single_process(name, dtype)
    for label, actual, wanted in zip(RESULTS, ring, expected):
        assert actual.dtype == wanted.dtype, label
        assert_close(actual, wanted, RELATIVE_TOLERANCE[dtype], f"{name} world {world} {label}")
    if worker.CASES[name][6]:  # the lse term of the loss is not negligible: dq and dk differ without it
        out_only = single_process(name, dtype, with_lse=False)
        for index in (2, 3):
            assert (expected[index] - out_only[index]).abs().max() > 1e-3


@pytest.mark.parametrize("world", WORLDS)
def test_deterministic_runs_are_bitwise_equal(ring_runs, world):
    first, second = ring_runs(world)["deterministic"]
    for label, a, b in zip(RESULTS, first, second):
        assert torch.equal(a, b), label
    expected = single_process(worker.DETERMINISTIC_CASE, torch.float32)
    for label, a, wanted in zip(RESULTS, first, expected):
        assert_close(a, wanted, RELATIVE_TOLERANCE[torch.float32], label)


@pytest.mark.parametrize("world", WORLDS)
def test_shard_unshard_round_trip(ring_runs, world):
    x = torch.arange(3 * 8 * world * 5, dtype=torch.float32).view(3, 8 * world, 5)
    for (layout, dim), gathered in ring_runs(world)["round_trips"].items():
        assert torch.equal(gathered, x if dim == 1 else x.transpose(1, 2)), (layout, dim)


@pytest.mark.parametrize("world", WORLDS)
def test_refused_calls_name_the_argument(ring_runs, world):
    found = ring_runs(world)["errors"]
    assert set(found) == {"row-crossing", "int64-offsets", "short-offsets", "layout", "impl", "uneven",
                          "cuda-on-cpu"}
    assert "crosses the end of batch row 0" in found["row-crossing"] and "cu_seqlens" in found["row-crossing"]
    assert found["int64-offsets"] == "TypeError: cu_seqlens must be int32, got torch.int64"
    assert "cu_seqlens[-1] = 7" in found["short-offsets"]
    assert "layout must be one of" in found["layout"] and "'striped'" in found["layout"]
    assert "impl must be one of" in found["impl"]
    seqlen = 3 * world
    assert f"seqlen = {seqlen}" in found["uneven"] and f"world = {world}" in found["uneven"]
    assert found["cuda-on-cpu"].startswith(
        "RuntimeError: ring_attention impl='cuda' cannot run: the tensors are on cpu")


# ---- on GPUs: the CUDA kernels, NCCL -------------------------------------------------------------------------------

CUDA_WORLDS = [1, 2]


def needs_gpus(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} present")


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(worker.CASES))
@pytest.mark.parametrize("world", CUDA_WORLDS)
def test_ring_attention_cuda(ring_runs, world, name):
    """bfloat16 on the kernels: within FlashAttention-2's rule (tests/test_cuda_kernels.py) of the float32 reference,
    with the single-process kernel's error as the yardstick."""
    needs_gpus(world)
    from test_cuda_kernels import _assert_fa2_rule

    ring = ring_runs(world, "nccl")["cases"][name, str(torch.bfloat16)]
    kernel = single_process(name, torch.bfloat16, device="cuda", impl="cuda")
    reference = single_process(name, torch.bfloat16, device="cuda", impl="reference", compute_dtype=torch.float32)
    for label, actual, lowp, wanted in zip(RESULTS, ring, kernel, reference):
        assert actual.dtype == lowp.dtype, label
        finite = wanted > float("-inf")
        _assert_fa2_rule(actual[finite], wanted[finite], lowp[finite], torch.bfloat16, f"{name} {label}")


@pytest.mark.cuda
@pytest.mark.parametrize("world", CUDA_WORLDS)
def test_ring_attention_cuda_deterministic_and_refusals(ring_runs, world):
    needs_gpus(world)
    results = ring_runs(world, "nccl")
    first, second = results["deterministic"]
    for label, a, b in zip(RESULTS, first, second):
        assert torch.equal(a, b), label
    x = torch.arange(3 * 8 * world * 5, dtype=torch.float32).view(3, 8 * world, 5)
    for (layout, dim), gathered in results["round_trips"].items():
        assert torch.equal(gathered, x if dim == 1 else x.transpose(1, 2)), (layout, dim)
    assert "head_dim (q.shape[-1]) a multiple of 8, got 4" in results["errors"]["head-dim"]
    assert "cu_seqlens must be on the host" in results["errors"]["host-offsets"]


# ---- without processes: the schedule and the layout ---------------------------------------------------------------


def scheduled_pairs(batch: int, seqlen: int, world: int, layout: str, causal: bool, offsets) -> list[tuple[int, int]]:
    """Every (query, key) pair, as positions in the flattened batch * seqlen, that the schedules of all ranks
    compute, with repeats."""
    local = seqlen // world
    positions = [shard_positions(seqlen, rank, world, layout).tolist() for rank in range(world)]

    def flat(rank: int, rows: list[int]) -> list[int]:  # local rows -> positions in the flattened batch
        return [row // local * seqlen + positions[rank][row % local] for row in rows]

    pairs = []
    for rank in range(world):
        for step, calls in enumerate(ring_schedule(batch, seqlen, world, rank, layout, causal, offsets)):
            source = (rank - step) % world
            for call in calls:
                q_rows = flat(rank, call.q_rows.index(torch.device("cpu")).tolist())
                k_rows = flat(source, call.k_rows.index(torch.device("cpu")).tolist())
                cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
                for b in range(len(cu_q) - 1):
                    queries, keys = q_rows[cu_q[b]:cu_q[b + 1]], k_rows[cu_k[b]:cu_k[b + 1]]
                    assert queries and keys, "a sequence without queries or keys is never launched"
                    if call.causal:
                        assert queries == keys and queries == sorted(queries)
                        pairs += [(qi, ki) for i, qi in enumerate(queries) for ki in keys[:i + 1]]
                    else:
                        pairs += list(itertools.product(queries, keys))
                assert call.pairs == sum(
                    (n * (n + 1) // 2) if call.causal else n * m
                    for n, m in zip(torch.tensor(cu_q).diff().tolist(), torch.tensor(cu_k).diff().tolist()))
    return pairs


def visible_pairs(batch: int, seqlen: int, causal: bool, offsets) -> list[tuple[int, int]]:
    offsets = offsets or [seqlen * b for b in range(batch + 1)]
    pairs = []
    for start, end in zip(offsets, offsets[1:]):
        pairs += [(i, j) for i in range(start, end) for j in range(start, (i + 1) if causal else end)]
    return pairs


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("documents", [False, True])
def test_schedule_computes_each_visible_pair_once(world, layout, causal, documents):
    batch, seqlen = 2, 24
    offsets = None
    if documents:  # an empty and one-token documents, an empty document at a row's start
        lengths = [3, 0, 1, 12, 8, 0, 1, 9, 0, 5, 9]
        offsets = tuple(itertools.accumulate(lengths, initial=0))
    pairs = scheduled_pairs(batch, seqlen, world, layout, causal, offsets)
    assert sorted(pairs) == sorted(visible_pairs(batch, seqlen, causal, offsets))


def test_zigzag_balances_causal_work():
    """Every rank and every step: 2 c^2 pairs per batch row (c = seqlen / 2 world), c more at step 0 (the diagonals);
    the contiguous layout gives rank 0 one step of work and launches nothing at the others."""
    batch, seqlen, world = 3, 48, 4
    chunk = seqlen // (2 * world)
    for rank in range(world):
        work = [sum(call.pairs for call in calls)
                for calls in ring_schedule(batch, seqlen, world, rank, "zigzag", True)]
        assert work == [batch * (2 * chunk**2 + chunk)] + [batch * 2 * chunk**2] * (world - 1)
    contiguous = [ring_schedule(batch, seqlen, world, rank, "contiguous", True) for rank in range(world)]
    assert [len(calls) for calls in contiguous[0]] == [1, 0, 0, 0]
    assert [len(calls) for calls in contiguous[-1]] == [1, 1, 1, 1]


def test_shard_positions():
    assert shard_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert shard_positions(16, 1, 4, "contiguous").tolist() == [4, 5, 6, 7]
    assert shard_positions(16, 0, 1).tolist() == list(range(16))
    assert shard_positions(16, 1, 4).dtype == torch.int64
    for world in (1, 2, 3):
        for layout in LAYOUTS:
            everything = torch.cat([shard_positions(24, rank, world, layout) for rank in range(world)])
            assert sorted(everything.tolist()) == list(range(24))
    x = torch.randn(2, 24, 3)
    assert torch.equal(shard_sequence(x, 1, 2, 3), x[:, shard_positions(24, 2, 3)])
    assert torch.equal(shard_sequence(x, -2, 1, 3, "contiguous"), x[:, 8:16])


@pytest.mark.parametrize("arguments, message", [
    ((18, 0, 2, "zigzag"), "seqlen = 18 must be divisible by 2 * world = 4 for the zigzag layout over world = 2"),
    ((10, 0, 4, "contiguous"), "seqlen = 10 must be divisible by world = 4 for the contiguous layout over world = 4"),
    ((16, 4, 4, "zigzag"), "rank must be in [0, world) = [0, 4), got 4"),
    ((16, 0, 0, "zigzag"), "world must be >= 1, got 0"),
    ((16, 0, 2, "ring"), "layout must be one of ('zigzag', 'contiguous'), got 'ring'"),
])
def test_shard_positions_errors_name_the_argument(arguments, message):
    with pytest.raises(ValueError) as error:
        shard_positions(*arguments)
    assert message in str(error.value)
