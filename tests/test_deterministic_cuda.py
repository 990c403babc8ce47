"""GPU tests of the deterministic mode: flash_attn_func(deterministic=True) gives bitwise-identical
gradients call after call, and trainer.deterministic makes a run resumed from a checkpoint repeat the uninterrupted
run's losses bit for bit (without it, dq's atomic adds make the two drift apart)."""

import pytest
import torch

from flashtrain.kernels import flash_attn_func, flash_attn_varlen_func
from flashtrain.train import train
from hydra_config import compose_config
from test_train import tiny_overrides

pytestmark = pytest.mark.cuda


def _grads(fn, q, k, v, dout):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 512])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nheads_kv", [8, 2], ids=["mha", "gqa"])
def test_deterministic_backward_is_bitwise_repeatable(head_dim, causal, nheads_kv):
    """Hopper: the tiles in groups of units (ops._det_tile_group), key blocks taking turns at every query block (head
    dim 96: the hd128 kernels with the head dim narrowed, their S^T started at the lse term); head dim 512: the mma.sync
    backward's dQ pieces with the deterministic splits."""
    gen = torch.Generator("cuda").manual_seed(0)
    q, dout = (torch.randn(2, 2048, 8, head_dim, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2048, nheads_kv, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(2))
    fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=True, impl="cuda")  # noqa: E731
    first = _grads(fn, q, k, v, dout)
    for _ in range(2):
        again = _grads(fn, q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    # and it computes the same gradients as the default backward, up to the order of dq's fp32 additions
    default = _grads(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, impl="cuda"), q, k, v, dout)
    for a, b in zip(first, default):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("group_steps", [0, 0.5], ids=["key_blocks_fastest", "half_wave"])
def test_deterministic_tile_orders_are_bitwise_repeatable(head_dim, causal, group_steps, monkeypatch):
    """Hopper: the deterministic backward's other tile orders give repeatable gradients too: key blocks fastest, one
    unit after the other (ops.DET_GROUP_STEPS = 0, the order of a one-unit call), and small groups (half a wave of
    steps), with ops.DET_CAUSAL_GROUP_RULE off so that the setting reaches causal calls."""
    from flashtrain.kernels import ops

    monkeypatch.setattr(ops, "DET_CAUSAL_GROUP_RULE", 0)
    monkeypatch.setattr(ops, "DET_GROUP_STEPS", group_steps)
    ops.clear_plans()
    try:
        gen = torch.Generator("cuda").manual_seed(2)
        q, k, v, dout = (torch.randn(4, 1024, 8, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
                         for _ in range(4))
        fn = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=True, impl="cuda")  # noqa: E731
        first, again = _grads(fn, q, k, v, dout), _grads(fn, q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        default = _grads(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, impl="cuda"), q, k, v, dout)
        for a, b in zip(first, default):
            assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()
    finally:
        ops.clear_plans()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_varlen_backward_is_bitwise_repeatable(causal, head_dim):
    """Varlen, every length class (empty, 1 token, partial blocks)."""
    lengths = torch.tensor([0, 300, 1, 1000, 129], device="cuda")
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    gen = torch.Generator("cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(int(lengths.sum()), 4, head_dim, device="cuda", generator=gen).to(torch.float16)
                     for _ in range(4))
    fn = lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=causal,  # noqa: E731
                                                deterministic=True, impl="cuda")
    first, again = _grads(fn, q, k, v, dout), _grads(fn, q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # the same gradients as the default backward (Hopper: dq_accum in padded rows), up to the order of dq's fp32
    # additions
    default = _grads(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=causal, impl="cuda"),
                     q, k, v, dout)
    for a, b in zip(first, default):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()


def test_deterministic_run_resumes_bit_for_bit(tmp_path, tmp_path_factory):
    """Train 12 steps; train 5, save, resume to 12: the resumed losses equal the uninterrupted run's exactly."""
    cache_dir = tmp_path_factory.mktemp("flashtrain-cache-deterministic")
    extra = ["trainer.deterministic=true", "model.attn_impl=flash", "model.dropout=0.1", "model.attn_dropout=0.1",
             "trainer.max_steps=12", "trainer.log_interval=1", "trainer.eval_interval=6",
             "trainer.save_interval=100", "data.sample_tokens=0"]
    full = train(compose_config(tiny_overrides(cache_dir, *extra)), tmp_path / "full")
    first = train(compose_config(tiny_overrides(cache_dir, *extra, "trainer.stop_step=5")), tmp_path / "a")
    second = train(compose_config(tiny_overrides(cache_dir, *extra, f"resume={tmp_path / 'a'}")), tmp_path / "b")
    assert first.final_step == 5 and second.final_step == 12

    def losses(history, key):
        return {r["step"]: r[key] for r in history if key in r}

    full_train, resumed_train = losses(full.history, "train_loss"), losses(second.history, "train_loss")
    assert sorted(resumed_train) == list(range(6, 13))
    assert [resumed_train[step] for step in range(6, 13)] == [full_train[step] for step in range(6, 13)]
    assert losses(second.history, "val_loss")[12] == losses(full.history, "val_loss")[12]
    assert not torch.are_deterministic_algorithms_enabled()  # the run put the process-wide setting back
