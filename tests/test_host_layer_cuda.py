"""GPU tests of the C++ host layer (flashtrain/kernels/host/flash_host.cpp): the ops flashtrain::flash_attn_fwd /
flash_attn_bwd, their C++ autograd node and launch executor.

    pytest -m cuda tests/test_host_layer_cuda.py

The executor must launch exactly what the Python executor (ops._fwd_impl / _bwd_impl, the reference; tests/
test_host_layer.py checks the parameter bytes on CPU) launches: out, lse, dk, dv bitwise equal (dk, dv: unless GQA
splits of three or more reduce-add them), dq too where it is deterministic. Then what only the GPU shows: the autograd
node's backward (on the autograd device thread), streams and their tile counters, torch.compile without graph breaks,
CUDA graph capture, no host synchronisation. Numerics against the reference are tests/test_cuda_kernels.py's (every
call there runs this layer).
"""

import os

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func

pytestmark = pytest.mark.cuda


def _ops():
    from flashtrain.kernels import ops

    ops.load_host()
    return ops


def _inputs(shape_q, shape_k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for shape in (shape_q, shape_k, shape_k))
    return q, k, v, torch.randn(shape_q, device="cuda", generator=gen).to(dtype)


def _cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


# (shape_q, shape_k, head_dim, dtype, causal, dropout_p, deterministic, varlen lengths (q, k), block mask heads)
CASES = {
    "batch-hd64-causal": ((2, 97, 4), (2, 130, 2), 64, torch.bfloat16, True, 0.0, False, None, None),
    "batch-hd128-full-fp16": ((1, 300, 2), (1, 300, 2), 128, torch.float16, False, 0.0, False, None, None),
    "batch-hd40-dropout": ((2, 65, 2), (2, 65, 1), 40, torch.bfloat16, True, 0.2, False, None, None),
    "batch-hd256": ((1, 129, 2), (1, 129, 2), 256, torch.bfloat16, True, 0.0, False, None, None),
    "varlen-hd64": ((None, 4), (None, 1), 64, torch.bfloat16, True, 0.0, False, ([1, 170, 129], [64, 96, 100]), None),
    "varlen-hd96-dropout": ((None, 2), (None, 2), 96, torch.float16, False, 0.1, False, ([17, 0, 200], [33, 4, 129]),
                            None),
    "deterministic": ((2, 200, 4), (2, 200, 2), 64, torch.bfloat16, False, 0.0, True, None, None),
    "deterministic-hd128-causal": ((1, 257, 2), (1, 257, 2), 128, torch.bfloat16, True, 0.0, True, None, None),
    "block-sparse": ((1, 300, 4), (1, 260, 4), 64, torch.bfloat16, True, 0.0, False, None, 4),
}


def _case(name):
    ops = _ops()
    shape_q, shape_k, head_dim, dtype, causal, dropout_p, deterministic, lengths, mask_heads = CASES[name]
    cu_q = cu_k = None
    if lengths is not None:
        cu_q, cu_k = _cu_seqlens(lengths[0]), _cu_seqlens(lengths[1])
        shape_q, shape_k = (sum(lengths[0]), shape_q[1]), (sum(lengths[1]), shape_k[1])
        max_q, max_k = max(lengths[0]), max(lengths[1])
    else:
        max_q, max_k = shape_q[1], shape_k[1]
    q, k, v, dout = _inputs((*shape_q, head_dim), (*shape_k, head_dim), dtype)
    rng_state = ops._draw_rng_state(q.device, torch.Generator("cuda").manual_seed(5)) if dropout_p else None
    bs_rows = bs_cols = None
    if mask_heads is not None:
        blocks = (-(-max_q // 128), -(-max_k // 128))
        mask = torch.rand((mask_heads, *blocks), device="cuda", generator=torch.Generator("cuda").manual_seed(1)) < 0.6
        bs_rows, bs_cols = ops.block_sparse_lists(mask)
    options = (cu_q, cu_k, max_q, max_k, dropout_p, head_dim**-0.5, causal, rng_state)
    return q, k, v, dout, options, deterministic, bs_rows, bs_cols


@pytest.mark.parametrize("name", CASES)
def test_cpp_executor_matches_the_python_executor_bitwise(name):
    ops = _ops()
    q, k, v, dout, options, deterministic, bs_rows, bs_cols = _case(name)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = ops.flash_attn_fwd(*leaves, *options, deterministic, bs_rows, bs_cols)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)  # the C++ node's backward

    py_out, py_lse = ops._fwd_impl(q, k, v, *options, bs_rows)
    py_dq, py_dk, py_dv = ops._bwd_impl(dout, q, k, v, py_out, py_lse, *options, deterministic, bs_cols)
    for what, a, b in (("out", out, py_out), ("lse", lse, py_lse)):
        assert torch.equal(a, b), f"{name}: {what} differs from the Python executor's"
    # GQA groups split over several tiles (Hopper) reduce-add dK / dV in a varying order: from three splits on, the
    # fp32 sums may round differently (two terms added to zero commute)
    for what, a, b in (("dk", dk, py_dk), ("dv", dv, py_dv)):
        if deterministic or q.shape[-2] // k.shape[-2] <= 2:
            assert torch.equal(a, b), f"{name}: {what} differs from the Python executor's"
        else:
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    if deterministic:
        assert torch.equal(dq, py_dq), f"{name}: deterministic dq differs from the Python executor's"
    else:  # atomics add dq in a varying order
        torch.testing.assert_close(dq, py_dq, atol=1e-2, rtol=1e-2)


def test_lse_is_differentiable_and_zero_dout_gives_zero_grads():
    q, k, v, _ = _inputs((1, 64, 2, 64), (1, 64, 2, 64))
    q.requires_grad_()
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, impl="cuda")
    assert lse.requires_grad  # its gradient folds into the backward's D
    (out * 0).sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("sm90", ["1", "0"], ids=["hopper-family", "mma-sync-family"])
def test_lse_gradient_matches_the_python_executor(sm90, monkeypatch):
    """The C++ node's backward with a gradient on lse (passed as dlse, strided) equals the Python executor's given
    the same dlse: dk and dv bitwise (deterministic: dq too)."""
    monkeypatch.setenv("FLASHTRAIN_SM90", sm90)
    q, k, v, dout = _inputs((2, 384, 4, 128), (2, 384, 4, 128))
    dlse = torch.randn(2, 384, 4, device="cuda").transpose(1, 2)  # (batch, heads, rows), not lse's strides
    ops = _ops()
    options = (None, None, 384, 384, 0.0, 128 ** -0.5, True, None)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = ops.flash_attn_fwd(*leaves, *options, True, None, None)
    dq, dk, dv = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    py_out, py_lse = ops._fwd_impl(q, k, v, *options, None)
    py_dq, py_dk, py_dv = ops._bwd_impl(dout, q, k, v, py_out, py_lse, *options, True, None, dlse=dlse)
    for what, a, b in (("dq", dq, py_dq), ("dk", dk, py_dk), ("dv", dv, py_dv)):
        assert torch.equal(a, b), f"{what} differs from the Python executor's"
    no_lse = ops._bwd_impl(dout, q, k, v, py_out, py_lse, *options, True, None)
    assert not torch.equal(no_lse[0], py_dq)  # dlse changed dq


def test_side_streams_use_their_own_tile_counters():
    """The same call on two streams at once (Hopper: persistent forward, one tile counter per stream) gives the
    default stream's result bitwise."""
    q, k, v, _ = _inputs((4, 1024, 8, 64), (4, 1024, 8, 64))
    expected = flash_attn_func(q, k, v, causal=True, impl="cuda")
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append([flash_attn_func(q, k, v, causal=True, impl="cuda") for _ in range(3)])
    torch.cuda.synchronize()
    for out in (x for group in outs for x in group):
        assert torch.equal(out, expected)


def test_backward_on_a_thread_without_a_current_context():
    """Autograd runs the backward on its device thread; a plain Python thread calling the op (no CUDA context made
    current on it yet) works too."""
    import threading

    q, k, v, dout = _inputs((2, 100, 2, 64), (2, 100, 2, 64))
    q.requires_grad_()
    expected_out = flash_attn_func(q, k, v, impl="cuda")
    (expected_grad,) = torch.autograd.grad(expected_out, q, dout)
    results = {}

    def work():
        out = flash_attn_func(q, k, v, impl="cuda")
        results["out"], (results["grad"],) = out, torch.autograd.grad(out, q, dout)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert torch.equal(results["out"], expected_out)
    torch.testing.assert_close(results["grad"], expected_grad, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["batch", "varlen"])
def test_torch_compile_traces_the_ops_without_graph_breaks(layout):
    torch._dynamo.reset()
    if layout == "batch":
        q, k, v, dout = _inputs((2, 256, 4, 64), (2, 256, 2, 64))

        def block(q, k, v):
            return flash_attn_func(q.sin(), k, v, causal=True, impl="cuda").cos()
    else:
        cu = _cu_seqlens([100, 56, 100])
        q, k, v, dout = _inputs((256, 4, 64), (256, 2, 64))

        def block(q, k, v):
            return flash_attn_varlen_func(q.sin(), k, v, cu, cu, 100, 100, causal=True, impl="cuda").cos()

    explanation = torch._dynamo.explain(block)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    compiled_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    expected = block(*leaves)
    got = torch.compile(block, fullgraph=True)(*compiled_leaves)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    for a, b in zip(torch.autograd.grad(got, compiled_leaves, dout), torch.autograd.grad(expected, leaves, dout)):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_cuda_graph_captures_forward_and_backward():
    q, k, v, dout = _inputs((2, 300, 4, 64), (2, 300, 2, 64))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step():
        out = flash_attn_func(q, k, v, causal=True, impl="cuda")
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile, load, build the plans outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        q.mul_(0.5)
        k.add_(0.25)
    graph.replay()
    expected = step()
    torch.testing.assert_close(captured[0], expected[0], atol=0, rtol=0)
    for a, b in zip(captured[1:], expected[1:]):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_forward_and_backward_do_not_synchronise():
    """Batch, varlen, dropout, deterministic, block-sparse: after a warm-up call, no host sync."""
    cu = _cu_seqlens([100, 1, 155])
    q, k, v, dout = _inputs((2, 256, 4, 64), (2, 256, 2, 64))
    qp, kp, vp, doutp = _inputs((256, 4, 64), (256, 2, 64))
    mask = torch.ones(2, 2, dtype=torch.bool, device="cuda")

    def calls():
        for kwargs in ({}, {"deterministic": True}, {"block_mask": mask}):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            torch.autograd.grad(flash_attn_func(*leaves, 0.1, causal=True, impl="cuda", **kwargs), leaves, dout)
        leaves = [x.detach().requires_grad_() for x in (qp, kp, vp)]
        out = flash_attn_varlen_func(*leaves, cu, cu, 155, 155, 0.1, causal=True, impl="cuda")
        torch.autograd.grad(out, leaves, doutp)

    calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_sm90_switch_and_smem_limit_rebuild_plans(monkeypatch):
    """FLASHTRAIN_SM90=0 and a lower shared-memory limit (launch._smem_limits, as tests set it) select other kernels
    for calls the executor has plans for already: it must not keep launching the old ones."""
    from flashtrain.kernels import build, launch

    if os.environ.get("FLASHTRAIN_MAX_SMEM") or os.environ.get("FLASHTRAIN_SM90") == "0":
        pytest.skip("FLASHTRAIN_MAX_SMEM / FLASHTRAIN_SM90=0 is set: this test switches both itself")
    ops = _ops()
    q, k, v, dout = _inputs((1, 200, 2, 128), (1, 200, 2, 128))
    q.requires_grad_()
    first_out = flash_attn_func(q, k, v, causal=True, impl="cuda")
    first_grad = torch.autograd.grad(first_out, q, dout)[0]
    built = []
    monkeypatch.setattr(ops, "_fwd_plan", lambda *args, build_plan=ops._fwd_plan: built.append(1) or build_plan(*args))
    monkeypatch.setenv("FLASHTRAIN_SM90", "0")
    flash_attn_func(q, k, v, causal=True, impl="cuda")
    assert built == [1]  # a new key: FLASHTRAIN_SM90 is part of it
    device = torch.device("cuda", torch.cuda.current_device())
    launch.device_smem_limit(device)
    monkeypatch.setitem(launch._smem_limits, device.index, build.SMEM_OPTIN_SM86)
    out = flash_attn_func(q, k, v, causal=True, impl="cuda")
    assert built == [1, 1]  # the plans were dropped when the limit changed
    torch.testing.assert_close(out, first_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(torch.autograd.grad(out, q, dout)[0], first_grad, atol=2e-2, rtol=2e-2)
