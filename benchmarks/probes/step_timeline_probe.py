"""Probe: how the Hopper forward's consumer warps share the SM, key block by key block. Builds the kernels with
FT_STEPS=1 (csrc/tma.cuh: the first lane of every consumer warp of the first four CTAs writes the SM clock at the marks
of each key-block step into a module global; FT_STEPS=2 adds the loader's marks), runs one forward call, and reports
per configuration:

- each phase of a step, per consumer warpgroup (its first warp; median cycles): waiting for K / V and the turn,
  issuing the S and P V GEMMs, waiting for S (`S wait`), masking + softmax, waiting for the P V GEMM, rescale + pack,
  and the whole step;
- how the warpgroups' S GEMMs line up: the cycles between one warpgroup's S issue and the next issue by any other
  (an even spread is a third of the step with three consumers), and the S wait against the number of the other
  warpgroups' GEMM issues in the 512 cycles before it;
- how many other warpgroups were inside their softmax (the MUFU pipe's users) during each softmax, and the softmax
  phase's length by that count;
- the four warps of a warpgroup: how far apart they reach each mark, which one reaches the GEMM issue last, and each
  one's softmax phase (a warp sharing its sub-partition with the loader runs slower);
- with FT_STEPS=2, the loader's lead: cycles between the K copy's issue and the consumers' first wait for it.

With --json the numbers go to a file; with --png a Gantt chart of a few steps of CTA 0 (S wait, softmax, P V wait);
with --raw the marks themselves.

    PYTHONPATH=$PWD python3 benchmarks/probes/step_timeline_probe.py --configs 64:16384:full 128:16384:full \
        --json out.json --png out.png --raw marks/

Marks (flash_fwd_sm90.cuh): consumer 0 step start, 1 K / V landed and turn taken, 2 GEMMs issued, 3 S done,
4 softmax done, 5 P V done, 6 step end (a tile's first block has no P V: marks 4 / 5 absent); loader (role 0,
FT_STEPS=2): 0 / 2 before the K / V stage's empty wait, 1 / 3 after it (the copy is issued next). The marks slow
the kernel (their clock reads and stores sit in the step). Batch x seqlen = 16K tokens, 2048 / head_dim heads, bf16
(the benchmark grid's setting).
"""
import argparse
import json
import os

if "FT_STEPS" not in os.environ.get("FLASHTRAIN_EXTRA_DEFINES", ""):  # (FT_STEPS=2: the loader's marks too)
    os.environ["FLASHTRAIN_EXTRA_DEFINES"] = ",".join(
        filter(None, [os.environ.get("FLASHTRAIN_EXTRA_DEFINES", ""), "FT_STEPS=1"]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CTAS, ROLES, WARPS, STEPS, EVENTS = 4, 4, 4, 1024, 8  # = csrc/tma.cuh kStepCtas, kStepRoles, kStepWarps, kSteps,
#                                                       kStepEvents
PHASES = ("wait K/V+turn", "issue", "S wait", "softmax", "PV wait", "rescale+pack")


def steps_buffer(head_dim: int, causal: bool):
    """(device pointer, bytes) of flashtrain_steps in the loaded Hopper forward module."""
    from cuda.bindings import driver  # (the GPU side's imports: the statistics run anywhere)

    from flashtrain.kernels import launch
    found = [(name, module) for (_, name), module in launch._modules.items()
             if f"_fwd_sm90_hdim{head_dim}_" in name and ("_causal" in name) == causal]
    if not found:
        raise RuntimeError(f"no Hopper forward module loaded: {[name for _, name in launch._modules]}")
    err, ptr, size = driver.cuModuleGetGlobal(found[-1][1], b"flashtrain_steps")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{found[-1][0]}: no flashtrain_steps (built without FT_STEPS?)")
    return found[-1][0], ptr, size


def read(ptr, size) -> np.ndarray:
    from cuda.bindings import driver
    host = np.zeros(size // 8, dtype=np.uint64)
    (err,) = driver.cuMemcpyDtoH(host.ctypes.data, ptr, size)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    return host.reshape(CTAS, ROLES, WARPS, STEPS, EVENTS).astype(np.int64)


def clear(ptr, size) -> None:
    from cuda.bindings import driver
    (err,) = driver.cuMemsetD8(ptr, 0, size)
    assert err == driver.CUresult.CUDA_SUCCESS, err


def warp_skew(data: np.ndarray, consumers: int) -> dict:
    """How far apart the four warps of a consumer warpgroup reach each mark of a steady step (max - min, cycles;
    median and 90th percentile), which warp reaches the GEMM issue (mark 1) last, how long the issue takes after the
    last warp's arrival, and each warp's median softmax phase."""
    skew = {m: [] for m in range(7)}
    last = np.zeros(WARPS, dtype=np.int64)
    after_last, softmax = [], [[] for _ in range(WARPS)]
    for c in range(CTAS):
        for r in range(1, consumers + 1):
            ev = data[c, r]  # (warp, step, event)
            full = np.all(ev[:, :, :7] != 0, axis=(0, 2))
            ev = ev[:, full]
            if not ev.shape[1]:
                continue
            for m in range(7):
                skew[m].append(ev[:, :, m].max(0) - ev[:, :, m].min(0))
            np.add.at(last, ev[:, :, 1].argmax(0), 1)
            after_last.append(ev[:, :, 2].min(0) - ev[:, :, 1].max(0))
            for w in range(WARPS):
                softmax[w].append(ev[w, :, 4] - ev[w, :, 3])
    names = ("step start", "turn taken", "GEMMs issued", "S done", "softmax done", "P V done", "step end")
    return {
        "skew_cycles": {names[m]: {"median": float(np.median(np.concatenate(v))),
                                   "p90": float(np.percentile(np.concatenate(v), 90))} for m, v in skew.items() if v},
        "last_warp_at_issue_share": [float(x) for x in last / max(1, last.sum())],
        "issue_after_last_warp_cycles": float(np.median(np.concatenate(after_last))) if after_last else None,
        "softmax_median_by_warp": [float(np.median(np.concatenate(v))) if v else None for v in softmax],
    }


def analyse(data: np.ndarray, consumers: int) -> dict:
    """The step statistics over the CTAs' steady steps (those with a P V product: marks 0-6 all set); warp 0 of each
    warpgroup (the warps' spread: warp_skew)."""
    skew = warp_skew(data, consumers)
    data = data[:, :, 0]
    roles = range(1, consumers + 1)
    phases = {r: [] for r in roles}
    issue_gap, s_wait_by_busy, sm_by_overlap, lead = [], {}, {}, []
    for c in range(CTAS):
        full = {r: np.all(data[c, r, :, :7] != 0, axis=1) for r in roles}
        for r in roles:
            ev = data[c, r][full[r]]
            if len(ev):
                phases[r].append(np.stack([ev[:, i + 1] - ev[:, i] for i in range(6)] + [ev[:, 6] - ev[:, 0]], 1))
        # S issues of every warpgroup (the end of the issue, mark 2): for each, the next issue by another warpgroup,
        # and the other warpgroups' issues in the 512 cycles before it
        times = np.concatenate([data[c, r, full[r], 2] for r in roles])
        owner = np.concatenate([np.full(int(full[r].sum()), r) for r in roles])
        s_wait = np.concatenate([data[c, r, full[r], 3] - data[c, r, full[r], 2] for r in roles])
        for r in roles:
            mine, others = times[owner == r], np.sort(times[owner != r])
            nxt = np.searchsorted(others, mine, side="right")
            issue_gap.extend((others[nxt[nxt < len(others)]] - mine[nxt < len(others)]).tolist())
            busy = np.searchsorted(others, mine, side="left") - np.searchsorted(others, mine - 512, side="left")
            for n, w in zip(busy, s_wait[owner == r]):
                s_wait_by_busy.setdefault(int(n), []).append(int(w))
        # softmax intervals and how many other warpgroups' softmax intervals overlap each (a warpgroup's own
        # intervals are disjoint and in order: the last one starting before this one's end decides)
        spans = {r: (data[c, r, full[r], 3], data[c, r, full[r], 4]) for r in roles}
        for r in roles:
            a, b = spans[r]
            overlap = np.zeros(len(a), dtype=np.int64)
            for r2 in roles:
                if r2 == r or not len(spans[r2][0]):
                    continue
                a2, b2 = spans[r2]
                j = np.searchsorted(a2, b) - 1
                overlap += (j >= 0) & (b2[np.maximum(j, 0)] > a)
            for n, d in zip(overlap, b - a):
                sm_by_overlap.setdefault(int(n), []).append(int(d))
        for s in range(STEPS):  # the K copy issued (producer mark 1) before the first consumer waits for it
            if data[c, 0, s, 1] and all(data[c, r, s, 0] for r in roles):
                lead.append(min(data[c, r, s, 0] for r in roles) - data[c, 0, s, 1])
    per_role = {}
    for r in roles:
        if phases[r]:
            rows = np.concatenate(phases[r])
            per_role[f"consumer {r}"] = {name: float(np.median(rows[:, i])) for i, name in
                                         enumerate(PHASES + ("step",))}
            per_role[f"consumer {r}"]["steps"] = int(len(rows))
    gaps = np.array(issue_gap, dtype=np.float64)
    step = np.median([v["step"] for v in per_role.values()])
    return {
        "phases_median_cycles": per_role,
        "s_issue_to_next_other_issue_cycles": {
            "median": float(np.median(gaps)), "p10": float(np.percentile(gaps, 10)),
            "p90": float(np.percentile(gaps, 90)), "even_spread": float(step / consumers),
            "share_below_quarter_step": float(np.mean(gaps < step / 4))},
        "s_wait_by_other_issues_in_512_cycles": {
            str(k): {"n": len(v), "median": float(np.median(v))} for k, v in sorted(s_wait_by_busy.items())},
        "softmax_by_other_softmaxes_overlapping": {
            str(k): {"n": len(v), "median": float(np.median(v))} for k, v in sorted(sm_by_overlap.items())},
        "producer_k_lead_cycles": {"median": float(np.median(lead)) if lead else None,
                                   "min": float(np.min(lead)) if lead else None},
        "warps": skew,
    }


def gantt(data: np.ndarray, consumers: int, first: int, count: int, title: str, ax) -> None:
    colors = {2: ("tab:red", "S wait"), 3: ("tab:blue", "softmax"), 4: ("tab:orange", "P V wait"),
              5: ("tab:green", "rescale + pack")}
    t0 = min(data[0, r, first, 0] for r in range(1, consumers + 1))
    for r in range(1, consumers + 1):
        for s in range(first, first + count):
            ev = data[0, r, s]
            if not np.all(ev[:7] != 0):
                continue
            for i, (color, _) in colors.items():
                ax.barh(r, ev[i + 1] - ev[i], left=ev[i] - t0, color=color, height=0.6)
            ax.plot([ev[1] - t0], [r + 0.35], "kv", markersize=3)
    ax.set_yticks(range(1, consumers + 1), [f"WG {r}" for r in range(1, consumers + 1)])
    ax.set_xlabel("SM cycles (v: GEMMs issued)")
    ax.set_title(title, fontsize=9)
    for i, (color, name) in colors.items():
        ax.barh(0, 0, color=color, label=name)
    ax.legend(fontsize=7, ncol=4, loc="upper right")


def run(config: str):
    from flashtrain.kernels import flash_attn_func
    head_dim, seqlen, mask = config.split(":")
    head_dim, seqlen, causal = int(head_dim), int(seqlen), mask == "causal"
    batch, nheads = 16384 // seqlen, 2048 // head_dim
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):  # build, load, warm up
        flash_attn_func(q, k, v, causal=causal, impl="cuda")
    torch.cuda.synchronize()
    name, ptr, size = steps_buffer(head_dim, causal)
    clear(ptr, size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    flash_attn_func(q, k, v, causal=causal, impl="cuda")
    end.record()
    torch.cuda.synchronize()
    data = read(ptr, size)
    consumers = max(r for r in range(1, ROLES) if np.any(data[:, r] != 0))
    result = {"config": config, "batch": batch, "heads": nheads, "kernel": name, "consumers": consumers,
              "elapsed_ms": start.elapsed_time(end), **analyse(data, consumers)}
    print(json.dumps(result, indent=1), flush=True)
    return result, data, consumers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["64:16384:full"], help="head_dim:seqlen:full|causal")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--png", help="a Gantt chart of steps 40-51 of CTA 0 per configuration")
    parser.add_argument("--raw", help="also save each configuration's marks of CTAs 0-1 (CTA, role, warp, step, "
                                      "event) as compressed .npz files in this directory")
    args = parser.parse_args()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "defines": os.environ["FLASHTRAIN_EXTRA_DEFINES"]}
    print(json.dumps(env), flush=True)
    results = [run(c) for c in args.configs]
    if args.raw:
        os.makedirs(args.raw, exist_ok=True)
        for r, data, _ in results:
            np.savez_compressed(os.path.join(args.raw, r["config"].replace(":", "_") + ".npz"), marks=data[:2])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "runs": [r for r, _, _ in results]}, f, indent=1)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.2 * len(results)), squeeze=False)
        for ax, (r, data, consumers) in zip(axes[:, 0], results):
            gantt(data[:, :, 0], consumers, 40, 12, f"{r['config']} ({env['defines']}), CTA 0, steps 40-51", ax)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
