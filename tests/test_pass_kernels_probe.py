"""benchmarks/probes/pass_kernels_probe.py's CPU side: a profiler trace of replays run in turn split back into the
replays of each (implementation, pass), and the per-kernel medians, idle gaps and spans of one of them."""

import pytest


@pytest.fixture
def probe(import_probe):
    return import_probe("pass_kernels_probe")


def trace(replays: int) -> list:
    """Kernels (name, start us, end us) of `replays` rounds over two graphs: "fwd" (one kernel of 100 us) and "fb"
    (the forward, a preprocess 2 us later, a main kernel that starts 1 us before the preprocess ends); replays 20 ms
    apart, the fb replay's main kernel 10 us longer in the last round; listed out of order, as a profiler may."""
    kernels, t = [], 0.0
    for r in range(replays):
        kernels.append(("fwd_kernel", t, t + 100.0))
        t += 20_100.0
        main = 400.0 + (10.0 if r == replays - 1 else 0.0)
        kernels += [("fwd_kernel", t, t + 100.0), ("preprocess", t + 102.0, t + 112.0),
                    ("main", t + 111.0, t + 111.0 + main)]
        t += 20_600.0
    return kernels[::-1]


def test_split_replays_and_summarize(probe):
    per = probe.split_replays(trace(3), ["fwd", "fb"], expected=3)
    assert [len(per["fwd"]), len(per["fb"])] == [3, 3]
    assert all([k[0] for k in replay] == ["fwd_kernel", "preprocess", "main"] for replay in per["fb"])
    fwd, fb = probe.summarize(per["fwd"]), probe.summarize(per["fb"])
    assert (fwd["span_us"], fwd["sum_us"], fwd["replays"], fwd["same_sequence"]) == (100.0, 100.0, 3, 3)
    assert [(r["kernel"], r["us"], r["gap_before_us"]) for r in fb["kernels"]] == [
        ("fwd_kernel", 100.0, 0.0), ("preprocess", 10.0, 2.0), ("main", 400.0, -1.0)]
    assert fb["span_us"] == pytest.approx(511.0) and fb["sum_us"] == pytest.approx(510.0)


def test_split_replays_keeps_gaps_below_the_threshold_inside_one_replay(probe):
    kernels = [("a", 0.0, 10.0), ("b", 900.0, 910.0), ("a", 30_000.0, 30_010.0)]
    per = probe.split_replays(kernels, ["x"], gap_us=1000.0)
    assert [[k[0] for k in replay] for replay in per["x"]] == [["a", "b"], ["a"]]


def test_split_replays_refuses_a_call_split_by_a_long_idle_gap(probe):
    kernels = trace(3)
    kernels.append(("late", 30_000_000.0, 30_000_010.0))  # an extra piece: a gap above the threshold inside a call
    with pytest.raises(RuntimeError, match="7 pieces of the trace for 3 replays of 2 calls"):
        probe.split_replays(kernels, ["fwd", "fb"], expected=3)


def test_summarize_takes_the_most_common_kernel_sequence(probe):
    usual = [("k1", 0.0, 10.0), ("k2", 12.0, 20.0)]
    odd = [("k0", 0.0, 5.0), ("k1", 6.0, 16.0), ("k2", 18.0, 30.0)]
    summary = probe.summarize([odd, usual, usual])
    assert [(r["kernel"], r["us"], r["gap_before_us"]) for r in summary["kernels"]] == [("k1", 10.0, 0.0),
                                                                                       ("k2", 8.0, 2.0)]
    assert (summary["replays"], summary["same_sequence"], summary["span_us"]) == (3, 2, 20.0)
