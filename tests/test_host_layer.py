"""CPU tests of the C++ host layer (flashtrain/kernels/host/flash_host.cpp): it compiles against this torch, and its
executor issues exactly the launches of the Python executor (ops._execute), byte for byte, for the plans of both
kernel families (mma.sync, sm_80; TMA / wgmma, sm_90a): batch, varlen, GQA, causal, dropout, block-sparse,
deterministic, unaligned inputs, forward and backward through the C++ autograd node.

Without a GPU the executor runs in record mode (flashtrain::_record_launches): CPU tensors, the driver replaced by a
record of each launch (kernel, grid, block, shared memory, parameter bytes) and tensor maps by their encoder's
arguments. The plan builders run for real, with the device queries (arch, shared memory, SMs) and the kernel loader
stubbed.
"""

import ctypes
import struct
import subprocess
import zlib
from collections import OrderedDict

import pytest
import torch

from flashtrain.kernels import build

pytest.importorskip("cuda.bindings.driver", reason="the plan builders' parameter structs live in launch.py")


@pytest.mark.slow  # (a compile of the whole host layer: ~30 s on 2 cores)
def test_host_source_compiles(tmp_path):
    if build.cxx_path() is None:
        pytest.skip("no C++ compiler (g++ or $CXX)")
    command = build.host_command(tmp_path / "flash_host.o", object_only=True)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "warning" not in result.stderr, result.stderr[-4000:]


_SYMBOLS = {}  # _FakeKernel handle -> kernel symbol


class _FakeKernel:
    """launch.Kernel without the driver: launch_on records what flash_host.cpp's record mode does (function, grid,
    block, shared memory, the addresses and sizes of the plan's inputs and outputs, the parameter bytes)."""

    def __init__(self, symbol: str, threads: int, smem_bytes: int, persistent: bool, records: list, tensors: list):
        self.handle = ctypes.c_void_p(zlib.crc32(symbol.encode()) << 4)
        _SYMBOLS[self.handle.value] = symbol
        self.threads, self.smem_bytes, self.records, self.tensors = threads, smem_bytes, records, tensors
        self.tile_counters = (zlib.crc32(symbol.encode()) << 8) if persistent else 0

    def launch_on(self, grid, params, stream, pdl=False):
        tensors = self.tensors[-1]
        spans = [(0, 0) if x is None else (x.data_ptr(), x.numel() * x.element_size()) for x in tensors]
        header = struct.pack(f"<{8 + 2 * len(spans)}q", self.handle.value, *grid, self.threads, self.smem_bytes,
                             int(pdl), len(spans), *(value for span in spans for value in span))
        self.records.append(header + bytes(params))


def _fake_encoder(desc, dtype, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob):
    """tma's encoder in record mode: the address and the encoder's arguments, as flash_host.cpp writes them."""
    values = [address.value, dtype, *dims[:4], *strides[:3], box[0], box[1], swizzle, l2, oob]
    ctypes.memmove(ctypes.addressof(desc._obj), struct.pack("<14q", *values), 112)
    return 0


@pytest.fixture(params=["sm_80", "sm_90a"])
def recording(request, monkeypatch):
    """(arch, python records): the device queries answer as a GPU of `arch`, kernels record their launches, and
    the C++ executor is in record mode with fresh plans."""
    from flashtrain.kernels import launch, ops, tma

    arch = request.param
    records, tensors, kernels = [], [], {}
    issue = ops._issue

    def get_kernel(spec, symbol, device):
        if symbol not in kernels:
            kernels[symbol] = _FakeKernel(symbol, spec.threads, spec.smem_bytes, spec.persistent, records, tensors)
        return kernels[symbol]

    def recording_issue(plan, inputs, outputs):  # the tensors of the plan whose kernels launch now
        tensors.append([*inputs, *outputs])
        issue(plan, inputs, outputs)

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(ops, "_issue", recording_issue)
    monkeypatch.setattr(launch, "device_arch", lambda device: arch)
    monkeypatch.setattr(launch, "device_smem_limit", lambda device: build.ARCH_SMEM_OPTIN[arch])
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "l2_bytes", lambda device: 60 << 20)  # (an H200's: build.SMALL_L2_BYTES' rules off)
    monkeypatch.setattr(launch, "stream_of", lambda device: 0)
    monkeypatch.setattr(launch, "tile_counter", lambda kernel, device, stream=None: kernel.tile_counters)
    monkeypatch.setattr(tma, "_encoder", lambda: _fake_encoder)
    monkeypatch.setattr(tma, "_CACHE", OrderedDict())
    monkeypatch.setattr(ops, "_fwd_plans", {})
    monkeypatch.setattr(ops, "_bwd_plans", {})
    ops.load_host()
    torch.ops.flashtrain._clear_plans()
    torch.ops.flashtrain._record_launches(True)
    yield arch, records
    torch.ops.flashtrain._record_launches(False)
    torch.ops.flashtrain._clear_plans()


def _canonical(record: bytes) -> list:
    """A record's launch (function, grid, block, shared memory, programmatic launch) and parameter words, each address
    inside one of the plan's tensors replaced by (tensor index, byte offset): the two executors allocate at different
    addresses."""
    n = struct.unpack_from("<q", record, 56)[0]
    spans = struct.unpack_from(f"<{2 * n}q", record, 64)
    params = record[64 + 16 * n:]
    words = list(struct.unpack_from("<7q", record))
    for (word,) in struct.iter_unpack("<Q", params[: len(params) // 8 * 8]):
        inside = (index for index in range(n) if spans[2 * index] <= word < spans[2 * index] + spans[2 * index + 1])
        index = next(inside, None)
        words.append(word if index is None else (index, word - spans[2 * index]))
    return words


CASES = {
    "batch": dict(shape_q=(2, 97, 4, 64), shape_k=(2, 130, 2, 64), causal=True),
    "batch-hd128-full": dict(shape_q=(1, 300, 2, 128), shape_k=(1, 300, 2, 128), causal=False),
    # (Hopper: the forward in 2-CTA clusters, build.FWD_SM90_CLUSTER_SEQLEN keys and more)
    "hd128-full-long-keys": dict(shape_q=(1, 8192, 2, 128), shape_k=(1, 8192, 2, 128), causal=False),
    "hd40-dropout": dict(shape_q=(2, 65, 2, 40), shape_k=(2, 65, 1, 40), causal=True, dropout_p=0.1),
    "varlen": dict(shape_q=(300, 4, 64), shape_k=(260, 1, 64), causal=True,
                   lengths=([0, 1, 170, 129], [0, 64, 96, 100])),
    "deterministic": dict(shape_q=(2, 200, 4, 64), shape_k=(2, 200, 2, 64), causal=False, deterministic=True),
    "block-sparse": dict(shape_q=(1, 300, 4, 64), shape_k=(1, 260, 4, 64), causal=True, block_mask=(4, 3, 3)),
    "unaligned": dict(shape_q=(2, 50, 2, 64), shape_k=(2, 50, 2, 64), causal=False, strided=True),
    # the score-modification kernels: window, softcap, ALiBi (per head, then per sequence and head)
    "score-mods": dict(shape_q=(2, 97, 4, 64), shape_k=(2, 130, 2, 64), causal=False,
                       mods=dict(window=(20, 5), softcap=30.0, alibi=(4,))),
    "score-mods-varlen": dict(shape_q=(300, 4, 128), shape_k=(260, 1, 128), causal=True,
                              lengths=([0, 1, 170, 129], [0, 64, 96, 100]), mods=dict(window=(50, -1), alibi=(3, 4))),
    # a mask expression (mask_mod): document ids per sequence, the states of its 128-tiles
    "mask-mod": dict(shape_q=(2, 300, 4, 64), shape_k=(2, 300, 2, 64), causal=True, mask_mod=True),
    # the Hopper kernels' tail split (build.FWD_TAIL_SPLIT, BWD_TAIL_SPLIT; ops._tail_split forced: the last 5 tiles
    # in 2 pieces), their zero-filled counters and fp32 partial results as workspaces
    "tail-split": dict(shape_q=(1, 300, 4, 64), shape_k=(1, 300, 4, 64), causal=False, tail_split=(5, 2)),
    # (Hopper, build.FWD_SM90_CLUSTER_HD64: the hd64 forward in 2-CTA clusters, K / V maps of half a key block's rows)
    "hd64-full-clusters": dict(shape_q=(1, 16384, 1, 64), shape_k=(1, 16384, 1, 64), causal=False,
                               switches=dict(FWD_SM90_CLUSTER=1, FWD_SM90_CLUSTER_HD64=1, FWD_TAIL_SPLIT=0)),
}


@pytest.mark.parametrize("case", CASES)
def test_cpp_executor_issues_the_python_executors_launches(recording, case, monkeypatch):
    from flashtrain.kernels import ops

    arch, records = recording
    spec = CASES[case]
    for name, value in spec.get("switches", {}).items():
        monkeypatch.setattr(ops.build, name, value)
    if "tail_split" in spec:
        tail, pieces = spec["tail_split"]
        monkeypatch.setattr(ops.build, "BWD_TAIL_SPLIT", 1)
        monkeypatch.setattr(ops.build, "FWD_TAIL_SPLIT", 1)
        monkeypatch.setattr(ops, "_tail_split", lambda n_tiles, sm_count, steps: (n_tiles - tail, pieces))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(spec["shape_q"], generator=gen).to(torch.bfloat16)
    k = torch.randn(spec["shape_k"], generator=gen).to(torch.bfloat16)
    v = torch.randn(spec["shape_k"], generator=gen).to(torch.bfloat16)
    if spec.get("strided"):  # q, k, v views of one qkv tensor whose head dim is padded: strides not multiples of 8
        qkv = torch.randn(*spec["shape_q"][:2], 3, spec["shape_q"][2], 68, generator=gen).to(torch.bfloat16)
        q, k, v = (x[..., :64] for x in qkv.unbind(2))
    cu_q = cu_k = None
    max_q, max_k = spec["shape_q"][1], spec["shape_k"][1]
    if "lengths" in spec:
        lengths_q, lengths_k = spec["lengths"]
        cu_q = torch.tensor(lengths_q, dtype=torch.int32).cumsum(0).to(torch.int32)
        cu_k = torch.tensor(lengths_k, dtype=torch.int32).cumsum(0).to(torch.int32)
        max_q, max_k = max(lengths_q), max(lengths_k)
    dropout_p = spec.get("dropout_p", 0.0)
    rng_state = torch.tensor([1234, 5678], dtype=torch.int64) if dropout_p else None
    bs_rows = bs_cols = None
    if "block_mask" in spec:
        mask = torch.rand(spec["block_mask"], generator=gen) < 0.6
        bs_rows, bs_cols = ops.block_sparse_lists(mask)
    deterministic = spec.get("deterministic", False)
    mods = spec.get("mods", {})
    window, softcap = mods.get("window", (-1, -1)), mods.get("softcap", 0.0)
    alibi = torch.rand(mods["alibi"], generator=gen) if "alibi" in mods else None
    if alibi is not None and alibi.dim() == 1:  # (nheads,) -> (batch, nheads), batch stride 0
        alibi = alibi.expand(len(spec["lengths"][0]) - 1 if "lengths" in spec else spec["shape_q"][0], -1)
    args = (cu_q, cu_k, max_q, max_k, dropout_p, 0.125, spec["causal"], rng_state, deterministic, bs_rows, bs_cols,
            *window, softcap, alibi)
    mask_args, mask_kw = (), {}
    if spec.get("mask_mod"):
        from flashtrain.kernels.mask_mod import MaskMod, pack_states

        doc = (torch.arange(300).repeat(2, 1) // torch.tensor([[70], [150]])).to(torch.int32)
        mask = MaskMod("doc[b][q_idx] == doc[b][kv_idx]", doc=doc)
        states, error = mask.block_states(2, 4, 300, 300, device="cpu")
        assert states.shape == (2, 1, 3, 3) and {0, 1, 2} == set(states.unique().tolist())
        states = pack_states(states)  # (the kernels' layout, as ops.flash_attn_cuda passes it)
        mask_args = (states, error, doc, None, None, None, ops.mask_mod_text(mask))
        mask_kw = dict(mask_mod=ops.mask_mod_text(mask), mm_states=states, mm_error=error, mm_tensors=[doc])
    args += mask_args

    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ops.flash_attn_fwd(q, k, v, *args)
    dout = torch.randn(out.shape, generator=gen).to(out.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    cpp = torch.ops.flashtrain._recorded_launches()
    # forward; preprocess, backward, dq conversion (+ dk, dv conversions when the Hopper backward splits a GQA group;
    # no dq conversion where the Hopper backward converts dq itself: build.bwd_fused_dq)
    fused_dq = arch == "sm_90a" and _SYMBOLS[_canonical(bytes(cpp[2].numpy()))[0]].endswith("_fdq")
    assert len(cpp) in ((3, 5) if fused_dq else (4, 6))
    if case == "hd64-full-clusters" and arch == "sm_90a":  # (the cluster kernel on an even grid: 86 query tiles)
        assert _SYMBOLS[_canonical(bytes(cpp[0].numpy()))[0]] == "flash_fwd_sm90_hdim64_bf16_c2"
        assert _canonical(bytes(cpp[0].numpy()))[1:4] == [86, 1, 1]
    # the Hopper backward and the conversions after it are programmatic dependent launches, nothing else is
    hopper_main = _SYMBOLS[_canonical(bytes(cpp[2].numpy()))[0]].startswith("flash_bwd_sm90")
    assert hopper_main == (arch == "sm_90a") or case in ("score-mods", "block-sparse", "mask-mod")
    assert [_canonical(bytes(record.numpy()))[6] for record in cpp] == [0, 0] + [int(hopper_main)] * (len(cpp) - 2)

    q, k, v = (x.detach() for x in (q, k, v))
    py_out, py_lse = ops._fwd_impl(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, 0.125, spec["causal"], rng_state,
                                   bs_rows, window, softcap, alibi, **mask_kw)
    py_grads = ops._bwd_impl(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, 0.125, spec["causal"],
                             rng_state, deterministic, bs_cols, window, softcap, alibi, **mask_kw)
    if mods:  # the score-modification kernels ran (also on Hopper: the mma.sync ones), with their parameters
        from flashtrain.kernels import build, launch

        specs = [build.fwd_kernel(spec["shape_q"][-1], "bf16", spec["causal"], False, score_mods=True, arch=arch,
                                  softcap=bool(softcap)),
                 build.bwd_kernel(spec["shape_q"][-1], "bf16", spec["causal"], False, score_mods=True, arch=arch,
                                  softcap=bool(softcap))]
        assert specs[0].source == ("flash_fwd_sm90.cu" if arch == "sm_90a" else "flash_fwd.cu")
        # the Hopper backward has them at head dims 64 / 128, softcap at 128 only (build.BWD_SM90_MODS_SOFTCAP)
        hopper_bwd = arch == "sm_90a" and (spec["shape_q"][-1] == 128 or not softcap)
        assert specs[1].source == ("flash_bwd_sm90.cu" if hopper_bwd else "flash_bwd.cu")
        handles = {zlib.crc32(s.symbols[0].encode()) << 4 for s in specs}
        assert handles <= {struct.unpack_from("<q", record)[0] for record in records}
        param_bytes = records[0][64 + 16 * struct.unpack_from("<q", records[0], 56)[0]:]
        fwd = (launch.FwdSm90Params.from_buffer_copy(param_bytes).fwd if arch == "sm_90a"
               else launch.FwdParams.from_buffer_copy(param_bytes))
        assert (fwd.window_left, fwd.window_right) == (window[0], -1 if spec["causal"] else window[1])
        assert fwd.softcap_scale == pytest.approx(0.125 / softcap if softcap else 0.0)
        assert fwd.alibi_batch_stride == (0 if mods["alibi"] == (4,) else 4) and fwd.alibi_slopes != 0
    if mask_kw:  # the mods kernels with the expression compiled in (Hopper: the warpgroup-MMA ones), its tensor,
        # states and error word
        from flashtrain.kernels import build, launch

        defines = mask.kernel_defines()
        specs = [kernel(64, "bf16", True, False, arch=arch, score_mods=True, mask_defines=defines)
                 for kernel in (build.fwd_kernel, build.bwd_kernel)]
        hopper = arch == "sm_90a"
        assert [spec.source for spec in specs] == (["flash_fwd_sm90.cu", "flash_bwd_sm90.cu"] if hopper
                                                   else ["flash_fwd.cu", "flash_bwd.cu"])
        handles = {zlib.crc32(s.symbols[0].encode()) << 4 for s in specs}
        assert handles <= {struct.unpack_from("<q", record)[0] for record in records}
        param_bytes = records[0][64 + 16 * struct.unpack_from("<q", records[0], 56)[0]:]
        fwd = (launch.FwdSm90Params.from_buffer_copy(param_bytes).fwd if hopper
               else launch.FwdParams.from_buffer_copy(param_bytes))
        # packed states (mask_mod.pack_states): 3 rows of 4 bytes, 3 row ranges, 3 column ranges per sequence
        assert (fwd.mm_n_kblocks, fwd.mm_n_qblocks, fwd.mm_states_b_stride, fwd.mm_states_h_stride) == (4, 3, 60, 0)
        assert (list(fwd.mm.size[0][:2]), list(fwd.mm.stride[0][:2])) == ([2, 300], [300, 1])
        assert fwd.mm_states != 0 and fwd.mm.error != 0 and fwd.mm.ptr[0] != 0 and fwd.mm.ptr[1] is None
    assert len(records) == len(cpp)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), (py_out, py_lse, *py_grads)):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
    assert [_canonical(bytes(record.numpy())) for record in cpp] == [_canonical(record) for record in records]


@pytest.mark.parametrize("causal, frag", [(False, 1), (True, 1), (True, 0)])
def test_hopper_backward_plan_dq_layout_and_programmatic_launches(recording, causal, frag, monkeypatch):
    """The Hopper hd128 backward at 4160 queries (80-query blocks): the main kernel and the dq conversion are programmatic
    dependent launches (FLASHTRAIN_PDL=0: plain launches); dq_accum in fragment order, converted by one CTA per 80-row
    block without the plain-row tensor map; with build.BWD_DQ_FRAG = 0, plain rows (tma_dq, 32-row conversion CTAs)."""
    from flashtrain.kernels import launch, ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")
    b, s, h, d = 2, 4160, 4, 128  # (52 blocks of 80 rows, 130 conversion CTAs of 32)
    monkeypatch.setattr(build, "BWD_SM90_Q80_CAUSAL_SEQLEN", 4096)  # (causal: 80-query blocks from 4K here)
    monkeypatch.setattr(build, "BWD_DQ_FRAG", frag)
    q, k, v, out, dout = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(b, h, s)

    def plan():
        return ops._bwd_plan(dout, q, k, v, out, lse, None, None, s, s, 0.0, 0.088, causal, False, None)

    preprocess, main, convert = plan().launches
    assert (preprocess.pdl, main.pdl, convert.pdl) == (False, True, True)
    assert main.kernel.threads == 384
    tma_dq = ops._offset(launch.BwdSm90Params, "tma_dq")
    if not frag:
        assert convert.params.dq_frag == 0 and convert.grid == (130, b, h)
        assert tma_dq in [offset for offset, _, _ in main.tensor_maps]
    else:
        assert convert.params.dq_frag == 1 and convert.grid == (52, b, h)
        assert tma_dq not in [offset for offset, _, _ in main.tensor_maps]
    assert main.params.bwd.fwd.seqlen_q == s and preprocess.grid == (130, b, h)
    monkeypatch.setenv("FLASHTRAIN_PDL", "0")
    assert [item.pdl for item in plan().launches] == [False, False, False]


@pytest.mark.parametrize("head_dim, block_m", [(64, 128), (128, 64)])
def test_hopper_causal_backward_plan_converts_dq_in_the_kernel(recording, head_dim, block_m, monkeypatch):
    """The causal Hopper backward converts dq itself (build.BWD_FUSED_DQ 1: head dim 64, 2: 64 and 128): two
    launches, the preprocess zeroing one count per (query head, query block of the padded rows) after dq_accum and the
    rows no key sees (fused_dq 2: causal), the kernel holding dq's address and strides and the same counts;
    BWD_FUSED_DQ = 0, a non-causal call or one past build.BWD_FUSED_DQ_MAX_SEQLEN (hd128:
    BWD_FUSED_DQ_HD128_MAX_SEQLEN) queries adds the conversion kernel (its counts unused)."""
    from flashtrain.kernels import launch, ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")
    monkeypatch.setattr(build, "BWD_FUSED_DQ", 2)
    b, s, h, d = 3, 1000, 4, head_dim
    q, k, v, out, dout = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(b, h, s)

    def plan(causal):
        return ops._bwd_plan(dout, q, k, v, out, lse, None, None, s, s, 0.0, 0.088, causal, False, None)

    result = plan(True)
    preprocess, main = result.launches
    assert _SYMBOLS[main.kernel.handle.value].endswith("_fdq")
    rows_pad = b * -(-s // block_m) * block_m
    aux, bwd = preprocess.params, main.params.bwd
    assert (aux.fused_dq, aux.dq_counts_head_stride, bwd.dq_counts_head_stride) == (2, rows_pad // block_m,
                                                                                    rows_pad // block_m)
    assert (bwd.dq_batch_stride, bwd.dq_row_stride, bwd.dq_head_stride) == (s * h * d, h * d, d)
    # the counts after dq_accum in the workspace (output 3), as both launches address them
    workspace = result.outputs[3][0][0]
    counts = [source for offset, *source in main.addresses if offset == ops._offset(launch.BwdSm90Params,
                                                                                      "bwd.dq_counts")]
    dq_accum = [source for offset, *source in main.addresses if offset == ops._offset(launch.BwdSm90Params,
                                                                                        "bwd.dq_accum")]
    assert counts and counts[0][:2] == [ops._OUTPUT, 3] and dq_accum[0][:2] == [ops._OUTPUT, 3]
    assert counts[0][2] == dq_accum[0][2] + 4 * h * rows_pad * d
    assert workspace * 4 == counts[0][2] + 4 * h * rows_pad // block_m
    assert [source for offset, *source in preprocess.addresses
            if offset == ops._offset(launch.AuxParams, "dq_counts")] == counts
    assert len(plan(False).launches) == 3 and plan(False).launches[0].params.fused_dq == 0
    limit = "BWD_FUSED_DQ_HD128_MAX_SEQLEN" if head_dim == 128 else "BWD_FUSED_DQ_MAX_SEQLEN"
    monkeypatch.setattr(build, limit, s - 1)
    assert len(plan(True).launches) == 3 and plan(True).launches[0].params.fused_dq == 0
    monkeypatch.setattr(build, limit, s)
    monkeypatch.setattr(build, "BWD_FUSED_DQ", 1)
    assert len(plan(True).launches) == (2 if head_dim == 64 else 3)
    monkeypatch.setattr(build, "BWD_FUSED_DQ", 0)
    preprocess, main, convert = plan(True).launches
    assert not _SYMBOLS[main.kernel.handle.value].endswith("_fdq") and preprocess.params.fused_dq == 0


def test_hopper_backward_plan_sliding_window_blocks(recording):
    """A causal hd128 call at 4160 queries runs the score-modification backward on 80-query blocks with ALiBi alone or
    a window longer than build.BWD_SM90_WINDOW_Q64_MAX_LEFT, on 64-query blocks with a shorter sliding window
    (build.BWD_SM90_WINDOW_Q64): the launch's kernel and the window bounds it reads."""
    from flashtrain.kernels import ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")
    b, s, h, d = 1, 4160, 2, 128
    q, k, v, out, dout = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(5))
    lse, slopes = torch.zeros(b, h, s), torch.ones(b, h)
    for window, alibi, block_m in (((-1, -1), slopes, 80), ((512, -1), None, 64), ((512, -1), slopes, 64),
                                   ((3000, -1), None, 80)):
        _, main, _ = ops._bwd_plan(dout, q, k, v, out, lse, None, None, s, s, 0.0, 0.088, True, False, None,
                                   window=window, alibi_slopes=alibi).launches
        name = _SYMBOLS[main.kernel.handle.value]
        # (a window alone: the variant without ALiBi's code; on 64-query blocks with S^T onto the lse term)
        assert name.endswith("_mods_nocap" if alibi is not None else "_mods_window_lsebias" if block_m == 64
                             else "_mods_window"), name
        assert ("_q80" in name) == (block_m == 80), name
        assert (main.params.bwd.fwd.window_left, main.params.bwd.fwd.window_right) == window


def test_hopper_deterministic_plan_tile_groups(recording, monkeypatch):
    """The deterministic hd128 backward at 16K non-causal queries, 2 heads: each head's Q, dO and dq_accum rows (16
    MiB) exceed half the L2 bound (ops.DET_GROUP_L2_BYTES), but a group of one head would be 128 tiles on 132 SMs, so
    the plan groups both heads (ops.DET_GROUP_FULL_WAVE; 0: the L2 bound alone, one head)."""
    from flashtrain.kernels import ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")
    b, s, h, d = 1, 16384, 2, 128
    q, k, v, out, dout = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(b, h, s)

    def group():
        main = ops._bwd_plan(dout, q, k, v, out, lse, None, None, s, s, 0.0, 0.088, False, True, None).launches[1]
        return main.params.bwd.fwd.causal_tile_group

    assert group() == 2
    monkeypatch.setattr(ops, "DET_GROUP_FULL_WAVE", 0)
    assert group() == 1


def test_hopper_deterministic_causal_plan_tile_groups(recording, monkeypatch):
    """Deterministic causal calls at head dims 64 / 128 take their group's waves of steps from
    ops.DET_CAUSAL_GROUP_STEPS: hd128 key blocks fastest (group 0) up to 1K queries, one wave up to 2K queries (hd64
    from the start), half a wave at 4K; longer calls, non-causal ones and head dim 96 on the hd128 kernels keep
    ops.DET_GROUP_STEPS (two), as every call does with DET_CAUSAL_GROUP_RULE = 0."""
    from flashtrain.kernels import ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")

    def group(b, s, h, d, causal):
        q, k, v, out, dout = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(5))
        lse = torch.zeros(b, h, s)
        main = ops._bwd_plan(dout, q, k, v, out, lse, None, None, s, s, 0.0, 0.088, causal, True, None).launches[1]
        return main.params.bwd.fwd.causal_tile_group

    # (b, s, h, d, causal), group by the rule, group with two waves. 512 / 1K queries (64-query blocks at hd128, 128
    # at hd64), units of 0.5 MiB: (8 + 1) / 2 steps per tile, one wave 30 units (hd128 512: key blocks fastest, 0),
    # two waves 59, the L2 bound 48 (hd128 1K: 1 MiB units, the L2 bound 24); hd128 2K, units of 2 MiB: 16.5 steps,
    # one wave 9, two 16, the L2 bound 12; 4K, 4 MiB: half a wave 3 but a full wave of tiles 5, two waves 9, the L2
    # bound 6
    cases = [((16, 512, 16, 128, True), 0, 48), ((8, 1024, 16, 128, True), 0, 24), ((4, 1024, 16, 64, True), 30, 48),
             ((4, 2048, 16, 128, True), 9, 12), ((1, 4096, 8, 128, True), 5, 6), ((1, 16384, 2, 128, True), 2, 2),
             ((16, 512, 16, 96, True), 48, 48), ((16, 512, 16, 128, False), 33, 33)]
    assert [group(*shape) for shape, _, _ in cases] == [rule for _, rule, _ in cases]
    monkeypatch.setattr(ops, "DET_CAUSAL_GROUP_RULE", 0)
    ops.clear_plans()
    assert [group(*shape) for shape, _, _ in cases] == [two_waves for _, _, two_waves in cases]


def test_hopper_wide_head_dim_causal_plan_tile_groups(recording, monkeypatch):
    """Causal calls at head dims above 128 group their units in fewer waves of tiles when short: the backward one wave
    up to ops.BWD_WIDE_SHORT_BLOCKS key blocks (hd192's 96-key blocks: 1K keys, 11 blocks, 12 units per group on 132
    SMs; 2K, 22 blocks, two waves: 12; hd256's 64-key blocks: 1K, 16 blocks, 9 units), the forward 1.5 waves up to
    ops.FWD_WIDE_SHORT_BLOCKS query blocks of 128 rows (1K: 8 blocks, 25 units; 2K: two waves, 17); the A/B switches
    (blocks 0) give two waves everywhere. The hd128 kernels keep their own rule (1K: one wave, 17 units)."""
    from flashtrain.kernels import ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper kernels")

    def inputs(s, d, b=2, h=16):
        return (*(torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(5)), torch.zeros(b, h, s))

    def bwd_group(s, d):
        q, k, v, out, dout, lse = inputs(s, d)
        main = ops._bwd_plan(dout, q, k, v, out, lse, None, None, s, s, 0.0, d ** -0.5, True, False, None).launches[1]
        name = _SYMBOLS[main.kernel.handle.value]
        assert name.startswith(f"flash_bwd_sm90_hdim{d}_bf16_causal") and ("_n96" in name) == (d == 192), name
        return main.params.bwd.fwd.causal_tile_group

    def fwd_group(s, d):
        q, k, v, _, _, _ = inputs(s, d)
        main = ops._fwd_plan(q, k, v, None, None, s, s, 0.0, d ** -0.5, True, None).launches[0]
        assert _SYMBOLS[main.kernel.handle.value].startswith(f"flash_fwd_sm90_hdim{d}_bf16_causal")
        return main.params.fwd.causal_tile_group

    assert (ops.BWD_WIDE_SHORT_WAVES, ops.BWD_WIDE_SHORT_BLOCKS) == (1.0, 16)
    assert (ops.FWD_WIDE_SHORT_WAVES, ops.FWD_WIDE_SHORT_BLOCKS) == (1.5, 8)
    assert (bwd_group(1024, 192), bwd_group(1536, 192), bwd_group(2048, 192)) == (12, 9, 12)
    assert (bwd_group(1024, 256), bwd_group(2048, 256)) == (9, 9)  # (2K: 32 blocks, two waves)
    assert (fwd_group(1024, 192), fwd_group(1024, 256), fwd_group(2048, 256)) == (25, 25, 17)
    assert bwd_group(1024, 128) == fwd_group(1024, 128) == 17
    monkeypatch.setattr(ops, "BWD_WIDE_SHORT_BLOCKS", 0)
    monkeypatch.setattr(ops, "FWD_WIDE_SHORT_BLOCKS", 0)
    ops.clear_plans()
    assert (bwd_group(1024, 192), bwd_group(1024, 256), fwd_group(1024, 256)) == (24, 17, 32)


def test_hopper_small_l2_short_causal_forward_plan(recording, monkeypatch):
    """On a GPU with at most build.SMALL_L2_BYTES of L2 (an H100's 50 MB) the hd64 causal forward on 192-row tiles
    takes two Q buffers (`_q2`) up to build.SMALL_L2_Q_BUFFERS_SEQLEN query rows, and the short hd128 causal forward
    without GQA, and the hd64 one up to ops.FWD_TALL_SHORT_BLOCKS_SMALL_L2 tiles (768 rows), group their tiles by
    ops.FWD_SHORT_WAVES_SMALL_L2 waves; with 60 MB, GQA, longer calls, or the backward, the tiles and groups stay as
    they are."""
    from flashtrain.kernels import launch, ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper forward")
    monkeypatch.setattr(ops, "CAUSAL_GROUP_WAVES_SHORT", 1.0)  # (the defaults, whatever they become)
    monkeypatch.setattr(ops, "FWD_SHORT_WAVES_SMALL_L2", 0.5)
    monkeypatch.setattr(ops, "FWD_TALL_SHORT_BLOCKS_SMALL_L2", 4)

    def plan(l2_mb, seqlen, head_dim, nheads_kv=16, batch=8):
        monkeypatch.setattr(launch, "l2_bytes", lambda device: l2_mb << 20)
        ops.clear_plans()
        q = torch.zeros(batch, seqlen, 16, head_dim, dtype=torch.bfloat16)
        k = torch.zeros(batch, seqlen, nheads_kv, head_dim, dtype=torch.bfloat16)
        item = ops._fwd_plan(q, k, k, None, None, seqlen, seqlen, 0.0, 0.1, True, None).launches[0]
        return _SYMBOLS[item.kernel.handle.value], item.params.fwd.causal_tile_group

    assert plan(50, 512, 64) == ("flash_fwd_sm90_hdim64_bf16_causal_192x128_q2", 22)  # (half a wave of 3 tiles)
    assert plan(50, 768, 64) == ("flash_fwd_sm90_hdim64_bf16_causal_192x128_q2", 17)  # (4 tiles)
    assert plan(50, 1024, 64) == ("flash_fwd_sm90_hdim64_bf16_causal_192x128_q2", 44)  # (2 waves of 6 tiles)
    assert plan(50, 512, 64, nheads_kv=4) == ("flash_fwd_sm90_hdim64_bf16_causal_192x128_q2", 88)  # GQA
    assert plan(60, 512, 64) == ("flash_fwd_sm90_hdim64_bf16_causal_192x128", 88)
    assert plan(50, 1536, 64)[0] == "flash_fwd_sm90_hdim64_bf16_causal_192x128"
    assert plan(50, 512, 128) == ("flash_fwd_sm90_hdim128_bf16_causal_q2", 17)  # half a wave of 4 tiles
    assert plan(60, 512, 128) == ("flash_fwd_sm90_hdim128_bf16_causal_q2", 33)  # one wave
    assert plan(50, 512, 128, nheads_kv=4) == ("flash_fwd_sm90_hdim128_bf16_causal_q2", 33)  # GQA
    assert plan(50, 1024, 128) == ("flash_fwd_sm90_hdim128_bf16_causal", 9)  # (8 tiles; one Q buffer from 1K)
    monkeypatch.setattr(build, "SMALL_L2_BYTES", 0)  # the switch off
    assert plan(50, 512, 64) == ("flash_fwd_sm90_hdim64_bf16_causal_192x128", 88)
    assert plan(50, 512, 128)[1] == 33


def test_hopper_cluster_forward_plan(recording, monkeypatch):
    """The dense non-causal hd128 forward from build.FWD_SM90_CLUSTER_SEQLEN keys runs in 2-CTA clusters: its kernel
    (`_c2`) on an even grid, also when the GPU's SM count is odd; an odd number of query tiles per head, fewer keys or
    the switch off (FWD_SM90_CLUSTER = 0) take the one-CTA kernel on one CTA per SM."""
    from flashtrain.kernels import launch, ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper forward")
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)  # (the default, whatever the environment says)
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)  # (likewise)
    long = build.FWD_SM90_CLUSTER_SEQLEN

    def plan(seqlen, sms=132):
        monkeypatch.setattr(launch, "sm_count", lambda device: sms)
        q = torch.zeros(1, seqlen, 16, 128, dtype=torch.bfloat16)
        item = ops._fwd_plan(q, q, q, None, None, seqlen, seqlen, 0.0, 0.088, False, None).launches[0]
        return _SYMBOLS[item.kernel.handle.value], item.grid

    assert plan(long) == ("flash_fwd_sm90_hdim128_bf16_128x192_c2", (132, 1, 1))
    assert plan(long, sms=131) == ("flash_fwd_sm90_hdim128_bf16_128x192_c2", (130, 1, 1))
    assert plan(long + 128) == ("flash_fwd_sm90_hdim128_bf16_128x192", (132, 1, 1))  # 65 query tiles per head
    assert plan(long - 256) == ("flash_fwd_sm90_hdim128_bf16", (132, 1, 1))
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 0)
    assert plan(long) == ("flash_fwd_sm90_hdim128_bf16_128x192", (132, 1, 1))


def test_hopper_hd64_cluster_forward_plan(recording, monkeypatch):
    """With build.FWD_SM90_CLUSTER_HD64, the dense non-causal hd64 forward at 16K (86 query tiles of 192 rows per
    head) runs in 2-CTA clusters on an even grid, its K and V maps in boxes of half a key block's rows (64: each CTA
    copies one half into both), Q's and O's unchanged; at 8K (43 tiles per head) or with the switch off, the one-CTA
    kernel with whole 128-row K / V boxes."""
    from flashtrain.kernels import launch, ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper forward")
    monkeypatch.setattr(build, "FWD_SM90_CLUSTER", 1)
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)  # (whole tiles in the one-CTA kernel, whatever the environment)
    monkeypatch.setattr(launch, "sm_count", lambda device: 131)
    offsets = {ops._offset(launch.FwdSm90Params, name): name for name in ("tma_q", "tma_k", "tma_v", "tma_o")}

    def plan(seqlen, on):
        monkeypatch.setattr(build, "FWD_SM90_CLUSTER_HD64", on)
        ops.clear_plans()
        q = torch.zeros(1, seqlen, 32, 64, dtype=torch.bfloat16)
        item = ops._fwd_plan(q, q, q, None, None, seqlen, seqlen, 0.0, 0.125, False, None).launches[0]
        rows = {offsets[offset]: layout[4] for offset, _, layout in item.tensor_maps}
        return _SYMBOLS[item.kernel.handle.value], item.grid, rows

    whole = {"tma_q": 192, "tma_k": 128, "tma_v": 128, "tma_o": 64}
    assert plan(16384, 1) == ("flash_fwd_sm90_hdim64_bf16_c2", (130, 1, 1), {**whole, "tma_k": 64, "tma_v": 64})
    assert plan(8192, 1) == ("flash_fwd_sm90_hdim64_bf16", (131, 1, 1), whole)
    assert plan(16384, 0) == ("flash_fwd_sm90_hdim64_bf16", (131, 1, 1), whole)
    ops.clear_plans()


def test_tail_split_choice():
    """ops._tail_split on 132 SMs: the hd64 non-causal 16K backward (4096 tiles of 128 query blocks) leaves 4 tiles for
    a last wave, which runs in pieces whose modelled time is at most a fifth of a tile's; hd128 at 16K (2048 tiles of
    205 80-query blocks, 68 in the last wave) in a few pieces; no split without a partial wave, for short tiles (BERT's
    512 tokens: 4 blocks) or where the last wave nearly fills the GPU."""
    from flashtrain.kernels import ops

    def model(n_tiles, steps, pieces):
        waves = -(-(n_tiles % 132) * pieces // 132)
        return waves * (-(-steps // pieces) + ops.TAIL_PIECE_STEPS + ops.TAIL_MERGE_STEPS * pieces)

    first, pieces = ops._tail_split(4096, 132, 128)
    assert first == 4092 and 2 <= pieces <= ops.TAIL_MAX_PIECES and model(4096, 128, pieces) <= 128 / 5
    first, pieces = ops._tail_split(2048, 132, 205)
    assert first == 1980 and 3 <= pieces <= 8 and model(2048, 205, pieces) <= 0.75 * 205
    assert all(model(2048, 205, pieces) <= model(2048, 205, other) for other in range(2, 33))
    assert ops._tail_split(31 * 132, 132, 128) == (0, 1)  # whole waves
    assert ops._tail_split(2048, 132, 4) == (0, 1)  # 32 x 512 tokens, 16 heads
    assert ops._tail_split(512, 132, 205) == (0, 1)  # 116 of 132 SMs busy in the last wave
    assert ops._tail_split(0, 132, 0) == (0, 1)


def test_hopper_backward_plan_tail_split(recording, monkeypatch):
    """With build.BWD_TAIL_SPLIT = 1 the dense hd64 backward at 2K tokens, 9 heads (144 tiles on 132 SMs) runs its 12
    tail tiles in pieces: the `_tail` kernel, BwdParams' tail fields from ops._tail_split, one CTA per SM, a zero-filled
    int per tail tile and the pieces' fp32 sums (2 warpgroups x 128 threads x 64 floats each) as workspaces of the
    plan; the causal call (its own kernel) and 8 heads (128 tiles: one wave): no tail fields; the switch off: the
    plain kernel."""
    from flashtrain.kernels import ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")
    b, s, h, d = 1, 2048, 9, 64
    q, lse = torch.zeros(b, s, h, d, dtype=torch.bfloat16), torch.zeros(b, h, s)

    def plan(causal=False, heads=h):
        x = q[:, :, :heads]
        result = ops._bwd_plan(x, x, x, x, x, lse[:, :heads], None, None, s, s, 0.0, 0.125, causal, False, None)
        main = result.launches[1]
        return _SYMBOLS[main.kernel.handle.value], main, result.outputs

    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 1)
    first, pieces = ops._tail_split(144, 132, 16)
    assert (first, pieces) != (0, 1)
    name, main, outputs = plan()
    assert name == "flash_bwd_sm90_hdim64_bf16_tail" and main.grid == (132, 1, 1)
    assert (main.params.bwd.tail_first, main.params.bwd.tail_pieces) == (first, pieces) == (132, pieces)
    assert outputs[-2:] == [((12,), torch.int32, ops._FILL_ZERO), ((12 * pieces * 2 * 128 * 64,), torch.float32,
                                                                   ops._FILL_NONE)]
    offsets = {offset for offset, *_ in main.addresses}
    assert {ops._offset(type(main.params), f"bwd.tail_{name}") for name in ("counters", "partials")} <= offsets
    for name, main, outputs in (plan(causal=True), plan(heads=8)):
        assert main.params.bwd.tail_pieces in (0, 1) and len(outputs) == 4, name
    # (causal: dq converted in the kernel where build.BWD_FUSED_DQ says so)
    assert plan(causal=True)[0] == "flash_bwd_sm90_hdim64_bf16_causal" + ("_fdq" if build.BWD_FUSED_DQ else "")
    monkeypatch.setattr(build, "BWD_TAIL_SPLIT", 0)
    name, main, outputs = plan()
    assert name == "flash_bwd_sm90_hdim64_bf16" and main.params.bwd.tail_pieces == 0 and len(outputs) == 4


def test_hopper_backward_plan_two_kv_buffers(recording, monkeypatch):
    """The dense non-causal hd64 backward of up to build.BWD_SM90_HD64_KV2_FULL_SEQLEN queries runs the `_kv2` kernel
    (two K / V buffers: 231,680 bytes of shared memory) followed by the dq conversion; longer calls and causal ones
    keep their kernels (causal: dq converted in the kernel where build.BWD_FUSED_DQ says so); the switch at 0: none."""
    from flashtrain.kernels import ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper backward")

    def plan(s, causal=False):
        x, lse = torch.zeros(2, s, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 4, s)
        result = ops._bwd_plan(x, x, x, x, x, lse, None, None, s, s, 0.0, 0.125, causal, False, None)
        return [(_SYMBOLS[launch.kernel.handle.value], launch.kernel.smem_bytes) for launch in result.launches]

    limit = build.BWD_SM90_HD64_KV2_FULL_SEQLEN
    assert limit == 1024
    for s in (1, 512, limit):
        launches = plan(s)
        assert launches[1] == ("flash_bwd_sm90_hdim64_bf16_tail_kv2", 231680), (s, launches)
        assert [name for name, _ in launches] == ["flash_aux_bf16_preprocess", "flash_bwd_sm90_hdim64_bf16_tail_kv2",
                                                  "flash_aux_bf16_convert_dq"]
    assert plan(limit + 1)[1][0] == "flash_bwd_sm90_hdim64_bf16_tail"
    assert plan(512, causal=True)[1][0] == "flash_bwd_sm90_hdim64_bf16_causal" + ("_fdq" if build.BWD_FUSED_DQ else "")
    monkeypatch.setattr(build, "BWD_SM90_HD64_KV2_FULL_SEQLEN", 0)
    monkeypatch.setattr(ops, "_bwd_plans", {})
    assert plan(512)[1][0] == "flash_bwd_sm90_hdim64_bf16_tail"


def test_hopper_forward_plan_tail_split(recording, monkeypatch):
    """With build.FWD_TAIL_SPLIT = 1 the dense hd128 forward at 2K tokens, 9 heads (144 tiles of 128 rows on 132 SMs)
    runs its 12 tail tiles in pieces over their 16 key blocks: the `_tail` kernel, FwdSm90Params' tail fields from
    ops._tail_split, one CTA per SM, a zero-filled int per tail tile and consumer warpgroup and the pieces' fp32 rows
    (O and lse: 64 + 2 floats per thread) as workspaces after out and lse; the causal call, dropout (whose bits are
    addressed by key), the 192-key tiles of 8K keys or the switch off: no tail fields."""
    from flashtrain.kernels import launch, ops

    arch, _ = recording
    if arch != "sm_90a":
        pytest.skip("the Hopper forward")
    b, s, h, d = 1, 2048, 9, 128
    q = torch.zeros(b, s, h, d, dtype=torch.bfloat16)

    def plan(causal=False, dropout_p=0.0):
        result = ops._fwd_plan(q, q, q, None, None, s, s, dropout_p, 0.088, causal, None)
        return _SYMBOLS[result.launches[0].kernel.handle.value], result.launches[0], result.outputs

    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 1)
    first, pieces = ops._tail_split(144, 132, 16)
    assert first == 132 and pieces > 1
    name, item, outputs = plan()
    assert name == "flash_fwd_sm90_hdim128_bf16_tail" and item.grid == (132, 1, 1)
    assert (item.params.tail_first, item.params.tail_pieces) == (first, pieces)
    assert outputs[2:] == [((12 * 2,), torch.int32, ops._FILL_ZERO),
                           ((12 * pieces * 2 * 128 * (64 + 2),), torch.float32, ops._FILL_NONE)]
    assert {(ops._offset(launch.FwdSm90Params, f"tail_{name}"), ops._OUTPUT, index, 0)
            for name, index in (("counters", 2), ("partials", 3))} <= set(item.addresses)
    for name, item, outputs in (plan(causal=True), plan(dropout_p=0.1)):
        assert item.params.tail_pieces == 0 and len(outputs) == 2 and not name.endswith("_tail"), name
    # the 192-key hd128 tiles from 8K keys (2-CTA clusters, or one CTA at an odd count of query tiles): no split
    n = build.FWD_SM90_CLUSTER_SEQLEN
    for seqlen_q in (n, n + 128):
        k = torch.zeros(1, seqlen_q, 3, d, dtype=torch.bfloat16)
        item = ops._fwd_plan(k, k, k, None, None, seqlen_q, n, 0.0, 0.088, False, None).launches[0]
        assert "128x192" in _SYMBOLS[item.kernel.handle.value] and item.params.tail_pieces == 0
    monkeypatch.setattr(build, "FWD_TAIL_SPLIT", 0)
    name, item, outputs = plan()
    assert name == "flash_fwd_sm90_hdim128_bf16" and item.params.tail_pieces == 0 and len(outputs) == 2
