"""One backward of flashtrain and of SDPA's cuDNN backend (bf16; CAUSAL=1: causal) for ncu to profile.

    HD=128 S=4096 [CAUSAL=1] ncu --kernel-name regex:'flash_bwd_sm90|cudnn' --launch-skip 2 --launch-count 2 --set full \
        -o bwd python benchmarks/probes/ncu_bwd_probe.py
"""
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import flash_attn_func

hd, s = int(os.environ.get("HD", 64)), int(os.environ.get("S", 4096))
causal = os.environ.get("CAUSAL", "0") == "1"
batch, nh = 16384 // s, 2048 // hd
q, k, v, do = (torch.randn(batch, s, nh, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qq, kk, vv = (x.requires_grad_() for x in (q, k, v))
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
for _ in range(2):
    torch.autograd.grad(flash_attn_func(qq, kk, vv, causal=causal, impl="cuda"), (qq, kk, vv), do)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), do.transpose(1, 2))
torch.cuda.synchronize()
