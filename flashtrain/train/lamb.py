"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), as MLPerf BERT trains with it.

Per parameter w with gradient g, at step t (from 1):
    m = beta1 m + (1 - beta1) g            v = beta2 v + (1 - beta2) g^2
    update = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
    trust_ratio = ||w|| / ||update||, or 1 when either norm is 0
    w = w - lr * trust_ratio * update
Adam moments with bias correction, weight decay decoupled from the moments but inside the update (so it is scaled
by the trust ratio too), norms per parameter tensor. This is apex's FusedLAMB (used by NVIDIA's MLPerf BERT) with
use_nvlamb=True; with a group's "trust_ratio": False the ratio is 1 for that group, which is FusedLAMB's default
(use_nvlamb=False) for groups with weight_decay 0 (biases and LayerNorm in MLPerf). FusedLAMB also clips the
gradients to a global norm (max_grad_norm=1.0) inside the step; here that is left to the caller
(torch.nn.utils.clip_grad_norm_ / accelerator.clip_grad_norm_ before step()).
"""

from collections.abc import Callable, Iterable

import torch
from torch import Tensor


class LAMB(torch.optim.Optimizer):
    """Param groups as in torch.optim.AdamW; each group may set lr, betas, eps, weight_decay and trust_ratio
    (bool, default True: apply the layer-wise ratio ||w|| / ||update||)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, trust_ratio: bool = True):
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {beta}")
        if eps < 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, trust_ratio=trust_ratio))

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(param.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1.0 - beta2)
                bias_correction1 = 1.0 - beta1 ** state["step"]
                bias_correction2 = 1.0 - beta2 ** state["step"]
                denom = (exp_avg_sq / bias_correction2).sqrt_().add_(group["eps"])
                update = (exp_avg / bias_correction1).div_(denom)
                if group["weight_decay"] != 0.0:
                    update.add_(param, alpha=group["weight_decay"])
                if group["trust_ratio"]:
                    # Norms in float32 at least; stays on the device (no host sync).
                    param_norm = torch.linalg.vector_norm(param, dtype=torch.promote_types(param.dtype, torch.float32))
                    update_norm = torch.linalg.vector_norm(update, dtype=param_norm.dtype)
                    ratio = torch.where((param_norm > 0) & (update_norm > 0), param_norm / update_norm, 1.0)
                    update.mul_(ratio.to(update.dtype))
                param.add_(update, alpha=-group["lr"])
        return loss
