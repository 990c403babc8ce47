"""LAMB against its update formula written out by hand; param groups, zero norms, state_dict round trip."""

import io
import math

import pytest
import torch

from flashtrain.train.lamb import LAMB

BETAS, EPS, LR = (0.9, 0.99), 1e-6, 0.05


def make_params(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, 3, generator=generator, dtype=dtype),  # decayed
        torch.zeros(4, dtype=dtype),  # decayed, ||w|| = 0 -> ratio 1
        torch.randn(6, generator=generator, dtype=dtype),  # not decayed
        torch.randn(3, generator=generator, dtype=dtype),  # not decayed, zero gradient: ||update|| = 0 -> ratio 1
        torch.randn(2, 2, generator=generator, dtype=dtype),  # not decayed, trust_ratio off
    ]


def gradients(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=generator, dtype=p.dtype) for p in params]
    grads[3].zero_()
    return grads


def optimizer_for(params: list[torch.Tensor]) -> LAMB:
    return LAMB([{"params": params[:2], "weight_decay": 0.1},
                 {"params": params[2:4], "weight_decay": 0.0},
                 {"params": params[4:], "weight_decay": 0.0, "trust_ratio": False}], lr=LR, betas=BETAS, eps=EPS)


def lamb_by_hand(params: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Float64, element by element where it matters: m, v, bias correction, decoupled decay, per-tensor trust ratio."""
    weight_decays, use_ratio = [0.1, 0.1, 0.0, 0.0, 0.0], [True, True, True, True, False]
    weights = [p.double().clone() for p in params]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    for t in range(1, steps + 1):
        for i, g in enumerate(gradients(t, params)):
            g = g.double()
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            m_hat, v_hat = m[i] / (1 - BETAS[0] ** t), v[i] / (1 - BETAS[1] ** t)
            update = m_hat / (v_hat.sqrt() + EPS) + weight_decays[i] * weights[i]
            w_norm = math.sqrt(sum(x * x for x in weights[i].flatten().tolist()))
            u_norm = math.sqrt(sum(x * x for x in update.flatten().tolist()))
            ratio = w_norm / u_norm if use_ratio[i] and w_norm > 0 and u_norm > 0 else 1.0
            weights[i] = weights[i] - LR * ratio * update
    return weights


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_three_steps_match_the_formula(dtype, atol):
    params = [p.requires_grad_() for p in make_params(dtype)]
    initial = [p.detach().clone() for p in params]
    optimizer = optimizer_for(params)
    for step in (1, 2, 3):
        for param, grad in zip(params, gradients(step, params)):
            param.grad = grad
        optimizer.step()
    expected = lamb_by_hand(initial, steps=3)
    for i, (param, want) in enumerate(zip(params, expected)):
        assert (param.detach().double() - want).abs().max().item() <= atol, i
    assert not torch.equal(params[1].detach(), initial[1])  # the zero tensor moved (ratio 1, not 0 or nan)
    assert torch.equal(params[3].detach(), initial[3])  # zero grad, no decay: zero update
    assert optimizer.state[params[0]]["step"] == 3


def test_trust_ratio_makes_the_step_scale_free():
    """With the ratio, the first step moves w by lr * ||w|| in norm, whatever the gradient's scale."""
    generator = torch.Generator().manual_seed(1)
    for grad_scale in (1e-3, 1e3):
        param = torch.randn(10, 10, generator=generator, dtype=torch.float64, requires_grad=True)
        before = param.detach().clone()
        param.grad = grad_scale * torch.randn(10, 10, generator=generator, dtype=torch.float64)
        LAMB([param], lr=0.01, weight_decay=0.0).step()
        assert abs((param.detach() - before).norm().item() - 0.01 * before.norm().item()) <= 1e-12


def test_state_dict_round_trip_continues_identically():
    params = [p.requires_grad_() for p in make_params(torch.float32)]
    copies = [p.detach().clone().requires_grad_() for p in params]
    optimizer = optimizer_for(params)
    for step in (1, 2):
        for param, grad in zip(params, gradients(step, params)):
            param.grad = grad
        optimizer.step()
    with torch.no_grad():
        for copy, param in zip(copies, params):
            copy.copy_(param)
    checkpoint = io.BytesIO()  # through bytes, as a checkpoint goes: no tensor shared between the two
    torch.save(optimizer.state_dict(), checkpoint)
    checkpoint.seek(0)
    resumed = optimizer_for(copies)
    resumed.load_state_dict(torch.load(checkpoint))
    for param, copy, grad in zip(params, copies, gradients(3, params)):
        param.grad, copy.grad = grad, grad.clone()
    optimizer.step()
    resumed.step()
    for param, copy in zip(params, copies):
        assert torch.equal(param, copy)
    assert resumed.state[copies[0]]["step"] == 3
    assert resumed.param_groups[2]["trust_ratio"] is False


def test_closure_loss_is_returned_and_params_without_grad_are_skipped():
    param = torch.ones(3, requires_grad=True)
    idle = torch.ones(2, requires_grad=True)
    optimizer = LAMB([param, idle], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (param ** 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 3.0
    assert torch.equal(idle.detach(), torch.ones(2)) and idle not in optimizer.state


@pytest.mark.parametrize("kwargs, name", [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
                                          (dict(eps=-1e-8), "eps"), (dict(weight_decay=-0.1), "weight_decay")])
def test_bad_hyperparameters_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LAMB([torch.zeros(1, requires_grad=True)], **kwargs)


def test_optim_lamb_group_selects_lamb():
    """`optim=lamb` (a config group choice) works as well as `optim.name=lamb`, with MLPerf BERT's values."""
    from hydra_config import compose_config

    cfg = compose_config(["name=x", "optim=lamb"])  # the default recipe keeps its own lr and warmup
    assert (cfg.optim.name, cfg.optim.beta2, cfg.optim.eps, cfg.optim.weight_decay) == ("lamb", 0.999, 1e-6, 0.01)
