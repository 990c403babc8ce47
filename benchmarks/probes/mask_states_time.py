"""Probe: GPU time of a mask expression's block states (MaskMod.block_states, csrc/mask_blocks.cu) per call, against
the causal attention forward it serves, bf16, 16 heads of 128 (CUDA events, medians of 20).

    PYTHONPATH=$PWD python benchmarks/probes/mask_states_time.py
"""
import statistics

import torch

from flashtrain.kernels import flash_attn_func
from flashtrain.kernels.mask_mod import MaskMod


def median_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


for seqlen in (1024, 4096, 16384):
    doc = (torch.arange(seqlen, device="cuda") // (seqlen // 8)).to(torch.int32)
    mask = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    states = median_ms(lambda: mask.block_states(1, 16, seqlen, seqlen, device="cuda"))
    batch = max(1, 16384 // seqlen)
    q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fwd = median_ms(lambda: flash_attn_func(q, k, v, causal=True))
    mm = median_ms(lambda: flash_attn_func(q, k, v, causal=True, mask_mod=mask))
    print(f"seqlen {seqlen} batch {batch}: block_states {states:.3f} ms, mask_mod forward {mm:.3f} ms, "
          f"plain causal forward {fwd:.3f} ms", flush=True)
