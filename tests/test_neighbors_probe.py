"""benchmarks/probes/neighbors_probe.py's CPU side: a profiler timeline of implementations taking turns split back into
calls by kernel name, the activities of no implementation handed to the call they sit in, and the per-implementation
medians by predecessor."""

import pytest

FWD_OURS, PRE, MAIN = "flash_fwd_sm90_hdim64_bf16_causal_192x128", "flash_aux_bf16_preprocess", "flash_bwd_sm90_hdim64"
FA4 = "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_obje"
FA2 = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>"
CUDNN = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7"


@pytest.fixture
def probe(import_probe):
    return import_probe("neighbors_probe")


def test_owner_by_kernel_name(probe):
    # FA2's and FA4's kernels contain "flash_fwd" as well: flashtrain's are the ones that start with it
    assert [probe.owner(n) for n in (FWD_OURS, PRE, FA4, FA2, CUDNN, "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
                                     "at::cuda::(anonymous namespace)::spin_kernel(long)", "Memset (Device)")] == [
        "flashtrain", "flashtrain", "fa4", "fa2", "cudnn", "efficient", "hold", None]


def timeline() -> list:
    """A hold, then three rounds of: flashtrain (a memset 3 us before its forward, forward 100 us, preprocess, main
    kernel), cuDNN (one kernel, 120 us), FA4 (one kernel, 90 us); 5 us between calls; flashtrain's call after FA4 (the
    second and third rounds) has a main kernel 20 us longer. Listed in reverse, as a profiler may order them."""
    acts, t = [("at::cuda::(anonymous namespace)::spin_kernel(long)", 0.0, 1000.0)], 1000.0
    for r in range(3):
        t += 5.0
        acts.append(("Memset (Device)", t, t + 1.0))
        t += 4.0
        main = 300.0 + (20.0 if r else 0.0)
        acts += [(FWD_OURS, t, t + 100.0), (PRE, t + 101.0, t + 111.0), (MAIN, t + 110.0, t + 110.0 + main)]
        t += 110.0 + main + 5.0
        acts.append((CUDNN, t, t + 120.0))
        t += 125.0
        acts.append((FA4, t, t + 90.0))
        t += 90.0
    return acts[::-1]


def test_split_calls_by_owner_and_predecessor(probe):
    calls = probe.split_calls(timeline())
    assert [c["impl"] for c in calls] == ["hold"] + ["flashtrain", "cudnn", "fa4"] * 3
    assert [c["prev"] for c in calls[1:4]] == ["hold", "flashtrain", "cudnn"]
    first = calls[1]
    assert [k[0] for k in first["kernels"]] == ["Memset (Device)", FWD_OURS, PRE, MAIN]  # the memset joins the call
    assert first["lead_us"] == pytest.approx(5.0)


def test_per_impl_medians_and_spans_by_predecessor(probe):
    ours = probe.per_impl(probe.split_calls(timeline()), "flashtrain")
    # spans: 4 + 110 + main (300 after the hold, 320 twice after FA4); busy: 1 + 100 + 10 + main
    assert (ours["calls"], ours["span_us"], ours["busy_us"], ours["lead_us"]) == (3, 434.0, 431.0, 5.0)
    assert ours["span_us_by_predecessor"] == {"fa4": 434.0}  # (the call after the GPU hold is left out)
    assert [(k["kernel"], k["us"], k["gap_before_us"]) for k in ours["kernels"]] == [
        ("Memset (Device)", 1.0, 0.0), (FWD_OURS, 100.0, 3.0), (PRE, 10.0, 1.0), (MAIN, 320.0, -1.0)]
    fa4 = probe.per_impl(probe.split_calls(timeline()), "fa4")
    assert (fa4["span_us"], fa4["span_us_by_predecessor"]) == (90.0, {"cudnn": 90.0})


def test_unnamed_activity_far_from_the_next_call_stays_with_the_previous_one(probe):
    acts = [(CUDNN, 0.0, 100.0), ("Memset (Device)", 101.0, 102.0), (FWD_OURS, 1000.0, 1100.0)]
    calls = probe.split_calls(acts)
    assert [(c["impl"], len(c["kernels"])) for c in calls] == [("cudnn", 2), ("flashtrain", 1)]
