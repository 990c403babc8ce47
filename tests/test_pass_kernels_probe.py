"""benchmarks/probes/pass_kernels_probe.py's CPU side: a profiler trace of replays run in turn split back into the
replays of each (implementation, pass), and the per-kernel medians, idle gaps and spans of one of them."""

import pathlib

import pytest

PROBES = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "probes"


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(PROBES.parent))
    monkeypatch.syspath_prepend(str(PROBES))
    import pass_kernels_probe

    return pass_kernels_probe


def trace(replays: int) -> list:
    """Kernels (name, start us, end us) of `replays` rounds over two graphs: "fwd" (one kernel of 100 us) and "fb"
    (the forward, a preprocess 2 us later, a main kernel that starts 1 us before the preprocess ends); rounds 2 ms
    apart, the fb replay's main kernel 10 us longer in the last round; listed out of order, as a profiler may."""
    kernels, t = [], 0.0
    for r in range(replays):
        kernels.append(("fwd_kernel", t, t + 100.0))
        t += 2100.0
        main = 400.0 + (10.0 if r == replays - 1 else 0.0)
        kernels += [("fwd_kernel", t, t + 100.0), ("preprocess", t + 102.0, t + 112.0),
                    ("main", t + 111.0, t + 111.0 + main)]
        t += 2600.0
    return kernels[::-1]


def test_split_replays_and_summarize(probe):
    per = probe.split_replays(trace(3), ["fwd", "fb"])
    assert [len(per["fwd"]), len(per["fb"])] == [3, 3]
    assert all([k[0] for k in replay] == ["fwd_kernel", "preprocess", "main"] for replay in per["fb"])
    fwd, fb = probe.summarize(per["fwd"]), probe.summarize(per["fb"])
    assert (fwd["span_us"], fwd["sum_us"], fwd["replays"]) == (100.0, 100.0, 3)
    assert [(r["kernel"], r["us"], r["gap_before_us"]) for r in fb["kernels"]] == [
        ("fwd_kernel", 100.0, 0.0), ("preprocess", 10.0, 2.0), ("main", 400.0, -1.0)]
    assert fb["span_us"] == pytest.approx(511.0) and fb["sum_us"] == pytest.approx(510.0)


def test_split_replays_keeps_gaps_below_the_threshold_inside_one_replay(probe):
    kernels = [("a", 0.0, 10.0), ("b", 900.0, 910.0), ("a", 3000.0, 3010.0)]
    per = probe.split_replays(kernels, ["x"], gap_us=1000.0)
    assert [[k[0] for k in replay] for replay in per["x"]] == [["a", "b"], ["a"]]
