"""Probe: backward TFLOP/s of the Hopper backward (flash_bwd_sm90.cuh) against SDPA's cuDNN and FA2 backends, bf16,
in one process (backward = torch.autograd.grad of one call's output, as benchmarks/attention.py times it); first a
check of the gradients against fp32 attention (dense, causal, GQA, head dim 96 padded to 128).

    PYTHONPATH=$PWD python3 benchmarks/probes/sm90_bwd_probe.py [--seqlens 1024 4096 16384] [--head-dims 64 128]

Implementations: flashtrain, flashtrain-det (deterministic=True), flashtrain-grid (one CTA per tile), cudnn, fa2;
"flashtrain@waves=W" runs the causal backward with ops.CAUSAL_GROUP_WAVES = W (W = 0: key blocks fastest),
"flashtrain@splits=N" GQA with N tiles per group and key block (ops._gqa_splits), "flashtrain-det@detsteps=X" the
deterministic backward's tile groups with ops.DET_GROUP_STEPS = X (0: key blocks fastest; "@detl2=MiB" their L2
bound, "@detgroup=G" G units per group), "flashtrain@q80=0" the dense hd128 backward at 64-query blocks
(build.BWD_SM90_DENSE128_TILES off); and
compile-time variants of the kernels in the same process: "flashtrain+FT_MACRO=1[+FT_OTHER=2]" builds and runs the
kernels with those macros (FLASHTRAIN_EXTRA_DEFINES; its own cubins and launch plans), e.g.
"flashtrain+FT_PHILOX_ROUNDS=7" with --dropout 0.1.
"""
import os
import argparse
import contextlib
import dataclasses
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain.kernels import build, flash_attn_func, launch, ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train_gpt2 import time_calls  # noqa: E402


def check(head_dim: int, causal: bool, nheads_kv: int = 4, seqlen: int = 1000) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, seqlen, 4, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, seqlen, nheads_kv, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=causal, impl="cuda")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=nheads_kv != 4)
    refs = torch.autograd.grad(ref, (qf, kf, vf), dout.float().transpose(1, 2))
    errs = [((g.float() - r.transpose(1, 2)).abs().max() / r.abs().max()).item() for g, r in zip(grads, refs)]
    print(f"check hd{head_dim} causal={causal} kv_heads={nheads_kv} S={seqlen}: rel max err dq {errs[0]:.2e} "
          f"dk {errs[1]:.2e} dv {errs[2]:.2e}", flush=True)


def drop_plans() -> None:
    """Forget the launch plans (Python and C++ executors): the next call rebuilds them with the current tables."""
    ops._fwd_plans.clear()
    ops._bwd_plans.clear()
    ops.clear_host_plans()


@contextlib.contextmanager
def one_cta_per_tile(enabled: bool):
    """flashtrain-grid: the backward with one CTA per (key block, batch, kv head) tile instead of the persistent grid
    (build.BwdSm90Tiles.persistent), for A/B runs in one process."""
    saved = dict(build.BWD_SM90_TILES)
    if enabled:
        for head_dim, tiles in saved.items():
            build.BWD_SM90_TILES[head_dim] = dataclasses.replace(tiles, persistent=False)
    drop_plans()
    try:
        yield
    finally:
        build.BWD_SM90_TILES.update(saved)
        drop_plans()


@contextlib.contextmanager
def kernel_variant(name: str):
    """Kernels compiled with the macros after '+' in `name` (none: the default build)."""
    defines = ",".join(name.split("+")[1:])
    saved_env = os.environ.get("FLASHTRAIN_EXTRA_DEFINES")
    saved_kernels = dict(launch._kernels)
    saved_modules = dict(launch._modules)

    def reset():
        launch._kernels.clear()
        launch._modules.clear()
        drop_plans()

    if defines:
        os.environ["FLASHTRAIN_EXTRA_DEFINES"] = defines
        reset()
    try:
        yield
    finally:
        if defines:
            if saved_env is None:
                os.environ.pop("FLASHTRAIN_EXTRA_DEFINES", None)
            else:
                os.environ["FLASHTRAIN_EXTRA_DEFINES"] = saved_env
            reset()
            launch._kernels.update(saved_kernels)
            launch._modules.update(saved_modules)


@contextlib.contextmanager
def group_waves(name: str):
    """flashtrain@waves=W: the causal tile order with ops.CAUSAL_GROUP_WAVES = W; flashtrain@splits=N: GQA backward
    tiles split the group's query heads N ways (ops._gqa_splits forced to N); flashtrain-det@detsteps=X: the
    deterministic tile groups with ops.DET_GROUP_STEPS = X (0: key blocks fastest), @detl2=MiB: DET_GROUP_L2_BYTES,
    @detgroup=G: G units per group (at most all); @q80=0: FLASHTRAIN_BWD_SM90_Q80=0."""
    saved = ops.CAUSAL_GROUP_WAVES, ops._gqa_splits, ops.DET_GROUP_STEPS, ops.DET_GROUP_L2_BYTES
    options = dict(item.split("=") for item in name.split("@")[1:])
    if "waves" in options:
        ops.CAUSAL_GROUP_WAVES = float(options["waves"])
    if "splits" in options:
        ops._gqa_splits = lambda *args, **kwargs: int(options["splits"])
    if "detsteps" in options:
        ops.DET_GROUP_STEPS = float(options["detsteps"])
    if "detl2" in options:
        ops.DET_GROUP_L2_BYTES = int(float(options["detl2"]) * 2**20)
    saved_q80 = os.environ.get("FLASHTRAIN_BWD_SM90_Q80")
    if "q80" in options:
        os.environ["FLASHTRAIN_BWD_SM90_Q80"] = options["q80"]
    saved_group = ops._det_tile_group
    if "detgroup" in options:
        ops._det_tile_group = lambda steps, n_units, unit_bytes, sms: min(n_units, int(options["detgroup"]))
    drop_plans()
    try:
        yield
    finally:
        ops.CAUSAL_GROUP_WAVES, ops._gqa_splits, ops.DET_GROUP_STEPS, ops.DET_GROUP_L2_BYTES = saved
        ops._det_tile_group = saved_group
        if saved_q80 is None:
            os.environ.pop("FLASHTRAIN_BWD_SM90_Q80", None)
        else:
            os.environ["FLASHTRAIN_BWD_SM90_Q80"] = saved_q80
        drop_plans()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--impls", nargs="+", default=["flashtrain", "cudnn", "fa2"])
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every call (e.g. 0.1)")
    parser.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
    parser.add_argument("--heads", default=None, help="H/HKV query / key-value heads (GQA), e.g. 32/8; default "
                        "2048 // head_dim heads, no GQA")
    parser.add_argument("--batch", type=int, default=None, help="default 16384 // seqlen")
    parser.add_argument("--all-rounds", action="store_true",
                        help="also print every round's TFLOP/s (each round allocates fresh inputs: a result that "
                        "depends on where they land shows as a spread)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not args.no_check:
        for head_dim in (64, 128, 96):
            for causal in (False, True):
                check(head_dim, causal)
        check(128, True, nheads_kv=1, seqlen=777)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
    for head_dim in args.head_dims:
        nheads, nheads_kv = (map(int, args.heads.split("/")) if args.heads else (2048 // head_dim,) * 2)
        for seqlen in args.seqlens:
            batch = args.batch or 16384 // seqlen
            for causal in [m == "causal" for m in args.masks]:
                flops = 2.5 * 4 * batch * nheads * seqlen**2 * head_dim / (2 if causal else 1)
                best, rounds = {}, {}
                for round_index in range(args.rounds):  # odd rounds in reverse order: the first
                    # implementation of a round measured up to 5% faster than the same kernel later (H200, 2026-11-25)
                    for name in args.impls[::-1] if round_index % 2 else args.impls:
                        q, k, v = (torch.randn((batch, seqlen, h, head_dim), device="cuda", dtype=torch.bfloat16,
                                               requires_grad=True) for h in (nheads, nheads_kv, nheads_kv))
                        if name.startswith("flashtrain"):  # -det: deterministic=True; -grid: one CTA per tile
                            with (one_cta_per_tile(name.endswith("-grid")), kernel_variant(name.split("@")[0]),
                                  group_waves(name)):
                                out = flash_attn_func(q, k, v, args.dropout, causal=causal, impl="cuda",
                                                      deterministic="-det" in name)
                        else:
                            q, k, v = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
                            with sdpa_kernel(backends[name]):
                                out = F.scaled_dot_product_attention(q, k, v, dropout_p=args.dropout, is_causal=causal,
                                                                     **({"enable_gqa": True} if nheads_kv != nheads
                                                                        else {}))
                        dout = torch.randn_like(out)
                        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                        with (one_cta_per_tile(name.endswith("-grid")), kernel_variant(name.split("@")[0]),
                              group_waves(name)):
                            ms = 1000 * statistics.median(time_calls(fn, torch.device("cuda"), 3, args.repeats))
                        best[name] = max(best.get(name, 0), flops / ms / 1e9)
                        rounds.setdefault(name, []).append(flops / ms / 1e9)
                line = "  ".join(f"{n} {best[n]:6.1f}" for n in args.impls)
                ratio = f"  ft/cudnn {best['flashtrain'] / best['cudnn']:.2f}" if "cudnn" in best else ""
                if "flashtrain-grid" in best:
                    ratio += f"  persistent/grid {best['flashtrain'] / best['flashtrain-grid']:.2f}"
                if "flashtrain-det" in best:
                    ratio += f"  det/default {best['flashtrain-det'] / best['flashtrain']:.2f}"
                for n in best:
                    if "-det" in n and ("@" in n or "+" in n):
                        ratio += f"  {n[11:]}/default {best[n] / best['flashtrain']:.2f}"
                for n in best:
                    if ("+" in n or "@" in n) and "-det" not in n:
                        ratio += f"  {n}/default {best[n] / best['flashtrain']:.3f}"
                mask = "causal" if causal else "full  "
                print(f"hd{head_dim} {nheads}/{nheads_kv} B{batch} S{seqlen:<6} {mask} bwd TFLOP/s {line}{ratio}",
                      flush=True)
                if args.all_rounds:
                    for n, values in rounds.items():
                        print(f"    {n} rounds: {' '.join(f'{v:.1f}' for v in values)}", flush=True)


if __name__ == "__main__":
    main()
