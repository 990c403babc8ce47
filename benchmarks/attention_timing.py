"""The timing that benchmarks/attention.py and benchmarks/attention_features.py share: each pass's FLOPs (PASSES),
forward / backward / forward+backward times of implementations measured interleaved (time_passes_interleaved), and
the best of rounds as TFLOP/s (keep_best). Imports neither benchmark (both import it; this folder is on sys.path)."""

import contextlib
import statistics
import time

import torch

from train_gpt2 import calls_per_name, time_interleaved  # the sibling benchmark's timers

PASSES = (("fwd", 1.0), ("bwd", 2.5), ("fb", 3.5))  # each pass's FLOPs in units of the forward's


HOLD_MAX_S = 0.25  # the longest hold of the GPU while the host queues a pass's calls


def hold_seconds(host_s: dict, calls_each: int) -> float:
    """How long the GPU waits for the host to queue a pass's calls: 1.5x the host time of `calls_each` calls of every
    implementation (host_s: {impl: host seconds per call}) plus 2 ms, at most HOLD_MAX_S (a backend that syncs the
    host inside its call ends the hold early whatever its length; the calls after it are timed as without one)."""
    return min(HOLD_MAX_S, 1.5 * calls_each * sum(host_s.values()) + 0.002)


def time_passes_interleaved(cases: dict, repeats: int, label: str, warmup: int = 3, passes=PASSES) -> dict:
    """{impl: times as time_passes} for cases {impl: (fn, inputs, dout)}, the implementations' calls interleaved:
    per pass, at least r calls of each implementation, taking turns (each preceded equally often by every other), each
    call between CUDA events, no host sync in between (train_gpt2.time_interleaved), the GPU held while the host queues
    them (hold_seconds from the warm-up calls' host times): the GPU times of the calls run back to back, median per
    implementation. Each implementation's host time per call (the least of its warm-up calls, perf_counter) is kept
    as times[impl]["{pass}_host_us"]: host time is measured, not mixed into the GPU's. passes: the (kind, factor) pairs
    of PASSES to run (all by default)."""
    times = {impl: {} for impl in cases}
    outs = {}

    def calls(kind):
        for impl, (fn, inputs, dout) in cases.items():
            if kind == "fwd":
                yield impl, lambda fn=fn, inputs=inputs: fn(*inputs)
            elif kind == "bwd":
                yield impl, lambda impl=impl, inputs=inputs, dout=dout: torch.autograd.grad(
                    outs[impl], inputs, dout, retain_graph=True)
            else:
                yield impl, lambda fn=fn, inputs=inputs, dout=dout: torch.autograd.grad(fn(*inputs), inputs, dout)

    for kind, _ in passes:
        ready, host_s = {}, {}
        for impl, call in calls(kind):
            try:  # a backend that refuses the shape (or runs out of memory) misses this pass
                if kind == "bwd":
                    fn, inputs, _ = cases[impl]
                    outs[impl] = fn(*inputs)
                with torch.no_grad() if kind == "fwd" else contextlib.nullcontext():
                    host_s[impl] = min(host_seconds(call) for _ in range(max(warmup, 2)))
                ready[impl] = call
            except (RuntimeError, ValueError, NotImplementedError) as error:
                print(f"  {impl} {label} {kind}: {type(error).__name__}: {str(error)[:120]}")
                outs.pop(impl, None)
                host_s.pop(impl, None)
        hold_s = hold_seconds(host_s, calls_per_name(len(ready), repeats))
        with torch.no_grad() if kind == "fwd" else contextlib.nullcontext():
            seconds = time_interleaved(ready, repeats, hold_s=hold_s)
        for impl, values in seconds.items():
            times[impl][kind] = 1000 * statistics.median(values)
            times[impl][f"{kind}_host_us"] = 1e6 * host_s[impl]
        outs.clear()
    torch.cuda.empty_cache()
    return times


def host_seconds(call) -> float:
    """Host seconds of one call (perf_counter, no sync: the host's path through the call, its launches queued). The
    first warm-up call also compiles and allocates; time_passes_interleaved keeps the least of its warm-up calls."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def rounds_over_cells(cells: list, rounds: int, measure) -> None:
    """measure(cell, round_index) for each of `rounds` rounds over every cell, rounds outer: a round visits all cells
    before the next one starts, so that a disturbance lasting seconds (a host hiccup under short, host-bound calls)
    reaches one round of a cell, which keep_best's best round leaves out, and not every round of it, as back-to-back
    rounds of one cell let it (the hd128 causal 512 forward of attention_fa4_r15-h200.json: flashtrain and FA4 both
    slow in both rounds, cuDNN not)."""
    for round_index in range(rounds):
        for cell in cells:
            measure(cell, round_index)


def keep_best(row: dict, impl: str, times: dict, fwd_flops: float) -> None:
    """Fold one round's times into row: {impl}_{pass} = best TFLOP/s so far, {impl}_{pass}_ms = best ms (None: the
    pass never ran), {impl}_{pass}_host_us = least host time per call (where times has it)."""
    for kind, factor in PASSES:
        ms = min((x for x in (times.get(kind), row.get(f"{impl}_{kind}_ms")) if x is not None), default=None)
        row[f"{impl}_{kind}_ms"] = None if ms is None else round(ms, 4)
        row[f"{impl}_{kind}"] = None if ms is None else round(factor * fwd_flops / ms / 1e9, 1)
        host = [x for x in (times.get(f"{kind}_host_us"), row.get(f"{impl}_{kind}_host_us")) if x is not None]
        if host:
            row[f"{impl}_{kind}_host_us"] = round(min(host), 1)
