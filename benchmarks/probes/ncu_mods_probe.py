"""One forward + backward of flashtrain with a score modification (FEATURE=plain|softcap|alibi|window|full_window;
full_window = window_size=(S, 0): the mods kernels doing plain causal's work), bf16, causal, for ncu to profile.

    FEATURE=softcap HD=128 S=4096 ncu --kernel-name regex:'flash_(fwd|bwd)' --launch-skip 2 --launch-count 2 \
        --metrics gpu__time_duration.sum,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
        python benchmarks/probes/ncu_mods_probe.py
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_features import alibi_slopes  # noqa: E402

from flashtrain.kernels import flash_attn_func  # noqa: E402

hd, s = int(os.environ.get("HD", 128)), int(os.environ.get("S", 4096))
feature = os.environ.get("FEATURE", "softcap")
batch, nh = 16384 // s, 2048 // hd
options = {"plain": {}, "softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": alibi_slopes(nh, "cuda")},
           "window": {"window_size": (1024, 0)}, "full_window": {"window_size": (s, 0)}}[feature]
q, k, v, do = (torch.randn(batch, s, nh, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (x.requires_grad_() for x in (q, k, v))
for _ in range(2):
    torch.autograd.grad(flash_attn_func(q, k, v, causal=True, impl="cuda", **options), (q, k, v), do)
torch.cuda.synchronize()
