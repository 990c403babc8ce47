"""flashtrain.train.optim's FSDP2 fast paths on two gloo processes: ShardLocalAdamW and clip_grad_norm_ give exactly
what torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ give on the same DTensors, and leave other layouts to them."""

import copy
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from flashtrain.train.optim import ShardLocalAdamW, clip_grad_norm_


class StubAccelerator:
    """What clip_grad_norm_ uses of an Accelerator, counting the calls (its clip_grad_norm_ only records the
    fallback)."""

    def __init__(self):
        self.unscaled = self.fallbacks = 0

    def unscale_gradients(self):
        self.unscaled += 1

    def clip_grad_norm_(self, parameters, max_norm):
        self.fallbacks += 1
        return torch.zeros(())


def _models(mesh):
    """Two copies of a small model under fully_shard (the first layer its own unit), 7 x 5 / 5 x 3 / 3 x 1: a
    sharded dim of 1 and 3 leaves one process an empty shard."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.GELU(), nn.Linear(5, 3), nn.Linear(3, 1))
    twin = copy.deepcopy(model)
    for m in (model, twin):
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
    return model, twin


def _backward(rank, step, *models):
    torch.manual_seed(100 * step + rank)  # each process its own batch
    x = torch.randn(4, 7)
    for m in models:
        m(x).pow(2).sum().backward()


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _worker(rank, port):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    try:
        # clipping: the norm every process returns, and each gradient shard, torch's up to float rounding (the two
        # sum the squares in different orders; bit for bit on some CPUs, within 2 ulp on others)
        for max_norm in (0.05, 1.0, float("inf")):
            model, twin = _models(mesh)
            _backward(rank, 0, model, twin)
            expected = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
            accelerator = StubAccelerator()
            norm = clip_grad_norm_(accelerator, model.parameters(), max_norm)
            assert (accelerator.unscaled, accelerator.fallbacks) == (1, 0)
            assert not isinstance(norm, DTensor)
            torch.testing.assert_close(norm, expected.full_tensor(), rtol=3e-7, atol=0)
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a.grad.to_local(), b.grad.to_local(), rtol=3e-7, atol=0, msg=str(max_norm))
        # an infinite gradient on one process: the norm is infinite on both
        model, _ = _models(mesh)
        _backward(rank, 0, model)
        if rank == 0:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        assert clip_grad_norm_(StubAccelerator(), model.parameters(), 1.0).item() == float("inf")
        # a plain gradient among DTensor ones: accelerator.clip_grad_norm_
        model, _ = _models(mesh)
        _backward(rank, 0, model)
        extra = nn.Parameter(torch.ones(3))
        extra.grad = torch.ones(3)
        accelerator = StubAccelerator()
        clip_grad_norm_(accelerator, [*model.parameters(), extra], 1.0)
        assert accelerator.fallbacks == 1

        # AdamW: parameters and every state tensor bit for bit torch's, over 3 steps, one gradient missing in one
        for options in (dict(foreach=False), dict(foreach=True), dict(fused=True), dict(amsgrad=True)):
            model, twin = _models(mesh)
            ours = ShardLocalAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **options)
            theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1, **options)
            for step in range(3):
                _backward(rank, step, model, twin)
                if step == 1:
                    list(model.parameters())[1].grad = list(twin.parameters())[1].grad = None
                ours.step(), theirs.step(), ours.zero_grad(), theirs.zero_grad()
            for a, b in zip(model.parameters(), twin.parameters()):
                assert torch.equal(a.to_local(), b.to_local()), options
                assert ours.state[a].keys() == theirs.state[b].keys()
                for key in ours.state[a]:
                    assert torch.equal(_local(ours.state[a][key]), _local(theirs.state[b][key])), (options, key)
            assert isinstance(next(iter(ours.state.values()))["exp_avg"], DTensor)
        # a replicated parameter with a Partial gradient (not FSDP's layout): through DTensor, as torch's
        torch.manual_seed(0)
        weight = torch.randn(4)
        ours_p, theirs_p = (nn.Parameter(distribute_tensor(weight.clone(), mesh, [Replicate()])) for _ in range(2))
        ours, theirs = (ShardLocalAdamW([ours_p], lr=0.1, foreach=False),
                        torch.optim.AdamW([theirs_p], lr=0.1, foreach=False))
        for _ in range(2):
            for p in (ours_p, theirs_p):
                p.grad = DTensor.from_local(torch.full((4,), float(rank + 1)), mesh, [Partial()])
            ours.step(), theirs.step()
        assert torch.equal(ours_p.to_local(), theirs_p.to_local())
        assert torch.equal(ours.state[ours_p]["exp_avg"].to_local(), theirs.state[theirs_p]["exp_avg"].to_local())

        # the state as torch.distributed.checkpoint sees it: DTensors, and a round trip restores it exactly
        model, _ = _models(mesh)
        optimizer = ShardLocalAdamW(model.parameters(), lr=1e-2)
        _backward(rank, 0, model)
        optimizer.step()
        state = get_optimizer_state_dict(model, optimizer)
        assert {type(v) for s in state["state"].values() for k, v in s.items() if k != "step"} == {DTensor}
        fresh_model, _ = _models(mesh)
        fresh = ShardLocalAdamW(fresh_model.parameters(), lr=1e-2)
        set_optimizer_state_dict(fresh_model, fresh, state)
        for a, b in zip(fresh_model.parameters(), model.parameters()):
            assert torch.equal(fresh.state[a]["exp_avg"].to_local(), optimizer.state[b]["exp_avg"].to_local())
        # gloo's barrier waits for the group's work in flight: none is left when the group is destroyed. On the
        # success path only: after a failed assertion the other process may be inside a collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
@pytest.mark.slow
def test_shard_local_adamw_and_clipping_equal_torch_on_dtensors():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=2, join=True)
