"""benchmarks/probes/step_timeline_probe.py's CPU side: the step phases, the warpgroups' issue spread, the softmax
overlap and the warps' lag, computed from a synthetic set of marks whose answers are known."""

import numpy as np
import pytest

STEPS = 200


@pytest.fixture
def probe(import_probe):
    return import_probe("step_timeline_probe")


def marks(probe, period=3000, slow_warp=1, lag=100, extra_softmax=50) -> np.ndarray:
    """Three consumer warpgroups, a third of a period apart; each step: wait 200, issue 600, S wait 100, softmax 1500,
    P V wait 50, rescale + pack 250 (= 2700), then 300 idle. Warp `slow_warp` of every warpgroup reaches each mark
    `lag` cycles after the others and runs its softmax `extra_softmax` longer (its later marks shift by that too)."""
    data = np.zeros((probe.CTAS, probe.ROLES, probe.WARPS, probe.STEPS, probe.EVENTS), dtype=np.int64)
    phases = np.array([200, 600, 100, 1500, 50, 250])
    for c in range(probe.CTAS):
        for r in (1, 2, 3):
            for s in range(STEPS):
                start = 10_000 + s * period + (r - 1) * period // 3
                for w in range(probe.WARPS):
                    p = phases.copy()
                    if w == slow_warp:
                        p[3] += extra_softmax
                    ev = start + np.concatenate([[0], np.cumsum(p)]) + (lag if w == slow_warp else 0)
                    data[c, r, w, s, :7] = ev
            data[c, r, :, 0, 4:6] = 0  # a tile's first block: no P V product
    return data


def test_phases_and_spread(probe):
    out = probe.analyse(marks(probe), 3)
    first = out["phases_median_cycles"]["consumer 1"]
    assert [first[name] for name in probe.PHASES] == [200, 600, 100, 1500, 50, 250]
    assert first["step"] == 2700 and first["steps"] == probe.CTAS * (STEPS - 1)
    spread = out["s_issue_to_next_other_issue_cycles"]
    assert spread["median"] == 1000 and spread["even_spread"] == 900  # a third of the period; a third of the step
    # each softmax (1500 of every 3000 cycles, a third of a period apart) overlaps both other warpgroups' softmaxes,
    # but at the ends of the run, where a neighbour has not started or has stopped
    overlap = out["softmax_by_other_softmaxes_overlapping"]
    assert set(overlap) == {"1", "2"} and overlap["1"]["n"] <= 2 * probe.CTAS and overlap["2"]["median"] == 1500
    assert overlap["1"]["n"] + overlap["2"]["n"] == 3 * probe.CTAS * (STEPS - 1)


def test_warp_lag(probe):
    skew = probe.analyse(marks(probe, slow_warp=2, lag=120, extra_softmax=40), 3)["warps"]
    assert skew["last_warp_at_issue_share"] == [0.0, 0.0, 1.0, 0.0]
    assert skew["skew_cycles"]["step start"]["median"] == 120
    assert skew["skew_cycles"]["softmax done"]["median"] == 160  # the lag plus the longer softmax
    assert skew["softmax_median_by_warp"] == [1500, 1500, 1540, 1500]
    assert skew["issue_after_last_warp_cycles"] == 600 - 120  # the others' issue ends before the late warp's
