"""Probe: where the Hopper kernels' time goes, per tile. Builds the kernels with FT_TIMELINE=1 (csrc/tma.cuh: each
MMA / consumer warpgroup writes the SM clock at a few marks of every tile it works on into a module global), runs one
call, and prints per configuration: the kernel's span, the SMs' idle tail, and the mean time of each phase of a tile,
grouped by the tile's number of blocks.

    PYTHONPATH=$PWD python3 benchmarks/probes/timeline_probe.py [--configs fwd:128:512:causal bwd:128:4096:full ...]
    ... --configs bwd:128:16384:window1024 bwd:128:16384:window16384   (a window; the mods kernel on plain's work)

Forward marks (flash_fwd_sm90.cuh): 0 ready for a tile, 1 Q landed, 2 first S done, 3 key-block loop done, 4 last
P V done, 5 epilogue done; slots 6 / 7: the stage counter before / after (blocks = difference).
Backward marks (flash_bwd_sm90.cuh, head dims 64 / 128): 0 tile read, 1 K / V landed, 2 query-block steps done,
5 both warpgroups' GEMMs done (barrier), 3 dQ staging free (dV staged next), 4 epilogue done; slots 6 / 7: the step
counter before / after; the producer (role 0): 2 tile published, 3 K / V copy issued.
Batch x seqlen = 16K tokens, 2048 / head_dim heads, bf16 (the benchmark grid's setting).
"""
import argparse
import os
import statistics
from collections import defaultdict

os.environ["FLASHTRAIN_EXTRA_DEFINES"] = ",".join(
    filter(None, [os.environ.get("FLASHTRAIN_EXTRA_DEFINES", ""), "FT_TIMELINE=1"]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from cuda.bindings import driver  # noqa: E402

from flashtrain.kernels import flash_attn_func, launch  # noqa: E402

CTAS, ROLES, TILES, EVENTS = 160, 4, 96, 8  # = csrc/tma.cuh kTimeline*


def timeline_ptr(kind: str, head_dim: int, causal: bool, mods: bool = False):
    """(device pointer, bytes) of flashtrain_timeline in the loaded module of the `kind` kernel (fwd / bwd); mods: the
    score-modification kernel's."""
    found = [(name, module) for (_, name), module in launch._modules.items()
             if f"_{kind}_sm90_hdim{head_dim}_" in name and ("_causal" in name) == causal and ("_mods" in name) == mods]
    if not found:
        raise RuntimeError(f"no Hopper {kind} module loaded: {[name for _, name in launch._modules]}")
    err, ptr, size = driver.cuModuleGetGlobal(found[-1][1], b"flashtrain_timeline")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{found[-1][0]}: no flashtrain_timeline (built without FT_TIMELINE?)")
    return ptr, size


def read(ptr, size) -> np.ndarray:
    host = np.zeros(size // 8, dtype=np.uint64)
    (err,) = driver.cuMemcpyDtoH(host.ctypes.data, ptr, size)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return host.reshape(CTAS, ROLES, TILES, EVENTS).astype(np.int64)


def clear(ptr, size) -> None:
    (err,) = driver.cuMemsetD8(ptr, 0, size)
    assert err == driver.CUresult.CUDA_SUCCESS, err


def analyse(kind: str, data: np.ndarray, elapsed_ms: float) -> None:
    names = (["ready->Q", "Q->S0", "loop", "lastPV", "epilogue"] if kind == "fwd"
             else ["read->KV", "steps", "WG sync", "dQ wait", "epilogue"])
    order = [0, 1, 2, 3, 4, 5] if kind == "fwd" else [0, 1, 2, 5, 3, 4]  # the marks in time order
    last_mark = order[-1]
    ctas = [c for c in range(CTAS) if data[c, 0, 0, 0] != 0]
    starts_ns = {c: data[c, 0, 0, 0] for c in ctas}
    start_clk = {c: data[c, 0, 0, 1] for c in ctas}
    ends, spans_clk = {}, []
    for c in ctas:
        tiles = [t for t in range(TILES) if data[c, 1, t, last_mark] != 0]
        if tiles:
            end_clk = max(data[c, r, t, last_mark] for r in (1, 2) for t in tiles if data[c, r, t, last_mark])
            spans_clk.append(end_clk - start_clk[c])
            ends[c] = end_clk
    # SM clock: clock64 against the global timer between a CTA's start and its warpgroups' ends
    rates = []
    for c in ctas:
        for r in (1, 2):
            g_end, clk_end = data[c, 3, r, 0], data[c, 3, r, 1]
            if g_end > starts_ns[c]:
                rates.append((clk_end - start_clk[c]) / (g_end - starts_ns[c]))
    ghz = statistics.median(rates) if rates else max(spans_clk) / (elapsed_ms * 1e6)
    end_ns = {c: starts_ns[c] + (ends[c] - start_clk[c]) / ghz for c in ends}
    t0 = min(starts_ns.values())
    last = max(end_ns.values())
    idle = [(last - e) for e in end_ns.values()]
    print(f"  {kind}: {len(ctas)} CTAs, span {(last - t0) / 1e3:.0f} us (launch window {elapsed_ms * 1e3:.0f} us), "
          f"SM clock ~{ghz:.2f} GHz; CTA start skew "
          f"{(max(starts_ns.values()) - t0) / 1e3:.1f} us; tail idle per SM mean {statistics.mean(idle) / 1e3:.1f} us "
          f"({100 * statistics.mean(idle) / (last - t0):.1f}% of the span), max {max(idle) / 1e3:.1f} us")
    by_blocks = defaultdict(list)
    gaps = []
    for c in ctas:
        for r in (1, 2):
            row = [t for t in range(TILES) if data[c, r, t, last_mark] != 0]
            for t in row:
                ev = data[c, r, t]
                blocks = int(ev[7] - ev[6])
                marks = ev[order]
                phases = [marks[i + 1] - marks[i] for i in range(len(order) - 1)]
                by_blocks[blocks].append(phases + [marks[-1] - marks[0]])
                if t + 1 in row:
                    gaps.append(data[c, r, t + 1, 0] - marks[last_mark])
    us = lambda cyc: cyc / ghz / 1e3  # noqa: E731
    print(f"  {'blocks':>6} {'tiles':>6} " + " ".join(f"{n:>9}" for n in names) + f" {'tile':>9} {'per blk':>8}")
    for blocks in sorted(by_blocks):
        rows = np.array(by_blocks[blocks], dtype=np.float64)
        mean = rows.mean(axis=0)
        print(f"  {blocks:>6} {len(rows):>6} " + " ".join(f"{us(m):9.2f}" for m in mean) +
              f" {us(mean[-1] / max(blocks, 1)):8.2f}")
    if gaps:
        print(f"  gap between a tile's end and the next tile's first mark: mean {us(statistics.mean(gaps)):.2f} us")
    if kind == "bwd":  # the producer's marks (role 0): 2 tile published, 3 K / V copy issued
        leads, kv = [], []
        for c in ctas:
            for t in range(1, TILES):
                published, issued, read, landed = (data[c, 0, t, 2], data[c, 0, t, 3], data[c, 1, t, 0],
                                                   data[c, 1, t, 1])
                if published and read:
                    leads.append(read - published)
                if issued and landed:
                    kv.append(landed - issued)
        if leads:
            print(f"  tile published -> read by warpgroup 1: mean {us(statistics.mean(leads)):.2f} us, min "
                  f"{us(min(leads)):.2f}; K / V issued -> landed (seen): mean {us(statistics.mean(kv)):.2f} us")


def run(config: str) -> None:
    """config = kind:head_dim:seqlen:mask, mask full, causal, or windowN (causal, window_size=(N, 0): the mods kernels;
    window_size=(seqlen, 0) runs them on plain causal's work)."""
    kind, head_dim, seqlen, mask = config.split(":")
    head_dim, seqlen = int(head_dim), int(seqlen)
    causal, window = mask != "full", int(mask.removeprefix("window")) if mask.startswith("window") else None
    options = {"window_size": (window, 0)} if window is not None else {}
    batch, nheads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal, impl="cuda", **options)
    dout = torch.randn_like(out)
    for _ in range(3):  # build, load, warm up
        out = flash_attn_func(q, k, v, causal=causal, impl="cuda", **options)
        torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    ptr, size = timeline_ptr(kind, head_dim, causal, mods=window is not None)
    clear(ptr, size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if kind == "fwd":
        start.record()
        flash_attn_func(q, k, v, causal=causal, impl="cuda", **options)
        end.record()
    else:
        out = flash_attn_func(q, k, v, causal=causal, impl="cuda", **options)
        torch.cuda.synchronize()
        clear(ptr, size)
        start.record()
        torch.autograd.grad(out, (q, k, v), dout)  # preprocess + kernel + convert: the span below is the kernel's
        end.record()
    torch.cuda.synchronize()
    print(f"{config}: batch {batch}, heads {nheads}", flush=True)
    analyse(kind, read(ptr, size), start.elapsed_time(end))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=[
        "fwd:128:512:causal", "fwd:128:512:full", "fwd:128:2048:causal", "fwd:64:1024:causal",
        "bwd:128:1024:causal", "bwd:128:1024:full", "bwd:128:4096:causal", "bwd:128:4096:full", "bwd:128:8192:causal"])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for config in args.configs:
        run(config)


if __name__ == "__main__":
    main()
