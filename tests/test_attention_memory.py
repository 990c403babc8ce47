"""The reference's memory is O(seqlen): forward + backward at 16K tokens never holds a seqlen x seqlen matrix.

Measured as the growth of the peak resident set size of a fresh process across the call, which counts every
allocation that is touched, including temporaries inside aten kernels. One (16K, 16K) float32 matrix alone is 1 GiB;
the O(seqlen) tensors of this call (out, grads and the per-head layouts of q, k, v, out, dout, dq, dk, dv, each
8 MiB) add up to about 110 MiB.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

SEQLEN = 16 * 1024
NHEADS = 2
HEAD_DIM = 64

SCRIPT = f"""
import json, math, resource
import torch
from flashtrain.kernels import flash_attn_func, naive_attention

# this is a fresh process: one thread, because tiles of one sequence and two heads are too small to gain from a second
# one, and waiting threads make the run several times slower when other jobs share the cores
torch.set_num_threads(1)

def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()

generator = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, {SEQLEN}, {NHEADS}, {HEAD_DIM}, generator=generator) for _ in range(4))
q, k, v = (x.requires_grad_() for x in (q, k, v))
flash_attn_func(q[:, :300], k[:, :300], v[:, :300], causal=True).sum().backward()  # warm up lazy initialisation
q.grad = k.grad = v.grad = None

rss_before = rss_bytes()
out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before

# correctness of the last 64 query rows: bottom-right causal keeps their view of the keys when the earlier queries are
# dropped, so the oracle needs only 64 x seqlen scores
last = slice({SEQLEN} - 64, {SEQLEN})
expected_out, expected_lse = naive_attention(q[:, last].detach(), k.detach(), v.detach(), causal=True)
print(json.dumps({{
    "peak_growth": peak_growth,
    "out_error": (out[:, last] - expected_out).abs().max().item(),
    "lse_error": (lse[..., last] - expected_lse).abs().max().item(),
    "grads_finite": all(bool(torch.isfinite(grad).all()) for grad in (dq, dk, dv)),
    "grads_nonzero": all(bool(grad.abs().sum() > 0) for grad in (dq, dk, dv)),
}}))
"""


def test_16k_tokens_forward_backward_needs_no_seqlen_squared_memory():
    repo_root = Path(__file__).resolve().parents[1]
    python_path = os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=repo_root, env=os.environ | {"PYTHONPATH": python_path},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    seqlen_squared_float32 = SEQLEN * SEQLEN * 4
    assert measured["peak_growth"] < seqlen_squared_float32 / 4, f"peak RSS grew by {measured['peak_growth'] / 2**20:.0f} MiB"
    assert measured["out_error"] < 1e-5 and measured["lse_error"] < 1e-4
    assert measured["grads_finite"] and measured["grads_nonzero"]
