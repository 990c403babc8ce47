"""Probe helper: compile, in parallel, the mask-expression kernels that tests/test_cuda_kernels.py's
test_mask_mod_matches_reference (head dims 64, 128, 512) and benchmarks/attention_features.py's mask_mod row build
at first use (one forward and backward per expression, head dim, dtype and causal flag; one block-states kernel per
expression), so a GPU call does not spend minutes compiling them one by one inside the test process.

    PYTHONPATH=$PWD python benchmarks/probes/prebuild_mask_mod.py [ARCH] [--dry]
"""
import os
import sys

import torch

from flashtrain.kernels import build
from flashtrain.kernels.mask_mod import MaskMod

arch = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "sm_90a"
doc = torch.zeros(3, 700, dtype=torch.int32)
flags = torch.zeros(4, dtype=torch.bool)
doc1 = torch.zeros(16384, dtype=torch.int32)
tests = [MaskMod("doc[b][q_idx] == doc[b][kv_idx]", doc=doc), MaskMod("kv_idx < 150 || q_idx >= kv_idx"),
         MaskMod("flags[h] ? (q_idx - kv_idx) % 3 == 0 : 1", flags=flags),
         MaskMod("q_idx % 5 != 0 && (q_idx / 128 + kv_idx / 128) % 3 != 1")]
bench = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc1)
specs = []
for sm90 in ("1", "0"):  # both kernel families (FLASHTRAIN_SM90=0: the mma.sync ones)
    os.environ["FLASHTRAIN_SM90"] = sm90
    for m in tests + [bench]:
        d = m.kernel_defines()
        specs.append(build.mask_blocks_kernel(m))
        for hd in ((128,) if m is bench else (64, 128, 512)):
            for c in ((True,) if m is bench else (False, True)):
                for dt in (("bf16",) if m is bench else ("bf16", "fp16")):
                    specs.append(build.fwd_kernel(hd, dt, c, False, arch=arch, score_mods=True, mask_defines=d))
                    specs.append(build.bwd_kernel(hd, dt, c, False, arch=arch, score_mods=True, mask_defines=d))
os.environ.pop("FLASHTRAIN_SM90")
specs = list(dict.fromkeys(specs))
print(len(specs), "specs")
if "--dry" not in sys.argv:
    sys.exit(build._run_all(specs, 16, lambda s: build.compile_kernel(s, arch)))
