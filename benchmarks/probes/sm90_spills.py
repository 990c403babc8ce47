"""Probe without a GPU: what ptxas does with the Hopper kernels' registers. For each kernel: the registers and spill
bytes ptxas reports, the SASS instruction count, and the spill instructions (LDL / STL) that lie between the
kernel's first and last warpgroup MMA (HGMMA), i.e. inside the key-block / query-block loops, where they cost time;
those outside are the producer warpgroup's roles (24-40 registers) and set-up / epilogue code.

    PYTHONPATH=$PWD python benchmarks/probes/sm90_spills.py [--kernels bwd:128:causal bwd:64 fwd:64:causal ...]
        [--defines FT_BWD_PRODUCER_REGS=40,...]

A kernel is kind:head_dim[:causal][:dropout][:det][:mods|:window][:sN] (kind fwd or bwd; det: the deterministic
backward; mods: the score-modification variant; window: the backward's window-only variant, as a sliding window of
1024 keys runs it; sN: the kernel a call of N query and key tokens runs, its tiles by length;
head dims 80 / 96: the hd128 kernels narrowed to that many columns, which head dims 65-96 run). --defines adds
macros to every compilation (as FLASHTRAIN_EXTRA_DEFINES does). Needs nvcc and cuobjdump (CUOBJDUMP=path, or on
PATH; pip's nvidia-cuda-cuobjdump wheel carries one). The Hopper backward's speed moved with its spills' placement by
up to 10% either way in 2026-11-25's measurements: compare a change's table with the default's
before spending device time on it.

Backward kernels also get their unmasked step (unmasked_step): the SASS of one query-block step that needs no mask,
as compiled, with its HGMMAs and add-with-carry descriptor moves (UIADD3.X).

Forward kernels also get their unmasked step (forward_step_path: the SASS a key block without a mask runs, as Nsight
Compute counts it) and their P V wait windows: for each wait on a key block's S GEMM that leaves the previous block's
P V GEMM running (WARPGROUP.DEPBAR.LE gsb0, 0x1), the exponentials (MUFU.EX2) and instructions before the P V wait
(0x0) that follows. Those run beside the warpgroup's own P V GEMM; a window without exponentials means ptxas moved the
P V wait above the softmax (flash_fwd_sm90.cuh FT_FWD_ARRIVE_PRED). Disassembles with cuobjdump -sass or, where that
is missing, nvdisasm -c (NVDISASM=path, on PATH, or the nvidia-cuda-nvdisasm wheel of `.[dev]`).
"""
import argparse
import heapq
import importlib.metadata
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from flashtrain.kernels import build

DEFAULT_KERNELS = ["bwd:64", "bwd:64:causal", "bwd:128", "bwd:128:causal", "bwd:64:causal:dropout", "bwd:64:det",
                   "bwd:128:causal:det", "fwd:64:causal", "fwd:128"]


def kernel_spec(item: str) -> build.KernelSpec:
    kind, head_dim, *flags = item.split(":")
    seqlens = [int(f[1:]) for f in flags if re.fullmatch(r"s\d+", f)]  # sN: the kernel a call of N tokens runs
    flags = [f for f in flags if not re.fullmatch(r"s\d+", f)]
    seqlen = seqlens[-1] if seqlens else 0
    unknown = set(flags) - {"causal", "dropout", "det", "mods", "window"}
    if (kind not in ("fwd", "bwd") or unknown or (kind == "fwd" and {"det", "window"} & set(flags))
            or (seqlen and {"mods", "window"} & set(flags))):
        raise SystemExit(f"--kernels: {item!r} is not kind:head_dim[:causal][:dropout][:det][:mods|:window][:sN] "
                         "(det, window: bwd only; sN: not with mods / window)")
    causal, dropout = "causal" in flags, "dropout" in flags
    if "window" in flags:  # the window-only backward a causal sliding window of 1024 keys runs
        return build.bwd_sm90_mods_kernel(int(head_dim), "bf16", causal, window_left=1024, window_only=True)
    if "mods" in flags:
        if kind == "fwd":
            return build._fwd_sm90_spec(int(head_dim), "bf16", causal, False, False,
                                        build.FWD_SM90_TILES[int(head_dim)], True)
        return build.bwd_sm90_mods_kernel(int(head_dim), "bf16", causal,
                                          softcap=build.BWD_SM90_MODS_SOFTCAP[int(head_dim)])
    # head dims 80 / 96: the hd128 kernels with the MMA work of that many columns (head dims 65-96 on Hopper)
    narrow = int(head_dim) if int(head_dim) in build.SM90_NARROW_HEAD_DIMS else None
    head_dim = 128 if narrow else int(head_dim)
    if kind == "fwd":
        if seqlen:
            return build.fwd_kernel(head_dim, "bf16", causal, dropout, arch=build.SM90_ARCH, seqlen_q=seqlen,
                                    seqlen_k=seqlen, effective_head_dim=narrow)
        return build.fwd_sm90_kernel(head_dim, "bf16", causal, dropout=dropout, head_dim_eff=narrow)
    return build.bwd_sm90_kernel(head_dim, "bf16", causal, dropout=dropout, deterministic="det" in flags,
                                 head_dim_eff=narrow, seqlen_q=seqlen or None)


def disassembler() -> str | None:
    """cuobjdump (CUOBJDUMP or PATH), else nvdisasm (NVDISASM, PATH, or the nvidia-cuda-nvdisasm wheel); None if
    neither is there."""
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or os.environ.get("NVDISASM") or \
        shutil.which("nvdisasm")
    if found:
        return found
    try:
        files = importlib.metadata.distribution("nvidia-cuda-nvdisasm").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    tool = next((f for f in files if f.name == "nvdisasm"), None)
    return str(tool.locate()) if tool is not None else None


def disassemble(tool: str, cubin: Path) -> str:
    """The SASS text of `cubin` (tool: cuobjdump or nvdisasm)."""
    command = [tool, "-c", str(cubin)] if Path(tool).name.startswith("nvdisasm") else [tool, "-sass", str(cubin)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def sass_instructions(tool: str, cubin: Path) -> list[str]:
    """The SASS instructions of every kernel in `cubin`, in order (tool: cuobjdump or nvdisasm)."""
    return sass_listing(disassemble(tool, cubin))[0]


def sass_listing(text: str) -> tuple[list[str], list[int], dict[str, int]]:
    """(instructions, their addresses, label -> address) of a disassembly: nvdisasm -c (labels `.L_x_N:` before the
    instruction they name) or cuobjdump -sass (branches to hex addresses)."""
    code, addresses, labels, pending = [], [], {}, []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if found:
            address = int(found.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            code.append(found.group(2).strip())
            addresses.append(address)
    return code, addresses, labels


def branch_target(ins: str, labels: dict[str, int]) -> int | None:
    """The address a branch instruction jumps to (a label of nvdisasm -c or a hex address of cuobjdump), else None."""
    target = re.search(r"\bBRA\b.*?(?:`?\((\.L_x_\d+)\)|\b(0x[0-9a-f]+)\b)", ins)
    if not target:
        return None
    return labels.get(target.group(1)) if target.group(1) else int(target.group(2), 16)


def loops(code: list[str], addresses: list[int], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction index of each loop: a branch back to an address at or before its own, with no EXIT
    in between (ptxas places a wait's retry block after the kernel's EXIT: its branch back into the main code is not a
    loop). One kernel per listing (addresses restart per function)."""
    index = {address: i for i, address in enumerate(addresses)}
    spans = []
    for i, ins in enumerate(code):
        address = branch_target(ins, labels)
        if address is not None and address <= addresses[i] and address in index:
            first = index[address]
            if not any(unpredicated(x).startswith("EXIT") for x in code[first:i + 1]):
                spans.append((first, i))
    return spans


def unmasked_step(code: list[str], addresses: list[int], labels: dict[str, int]) -> list[str] | None:
    """The backward's unmasked query-block step as compiled: in the innermost loops that issue warpgroup MMAs, the
    pieces between unconditional branches that select no masked score (no FSEL); the one with the most HGMMAs (the
    shortest of those). A causal kernel keeps its masked, hidden and unmasked steps in one loop (the mask test
    varies per block); a non-causal one's test is the tile's, and its unmasked step is a piece of its own too."""
    spans = [(a, b) for a, b in loops(code, addresses, labels) if any("HGMMA" in x for x in code[a:b + 1])]
    innermost = [(a, b) for a, b in spans if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    best = None
    for a, b in innermost:
        start = a
        for i in range(a, b + 1):
            if re.match(r"BRA\s", code[i]) or i == b:  # (unpredicated, not BRA.DIV: the piece ends here)
                piece, start = code[start:i + 1], i + 1
                mmas = sum("HGMMA" in x for x in piece)
                if mmas and not any(unpredicated(x).startswith("FSEL") for x in piece):
                    key = (-mmas, len(piece))
                    best = min(best, (key, piece)) if best else (key, piece)
    return best[1] if best else None


def forward_step_path(code: list[str], addresses: list[int], labels: dict[str, int]) -> list[str] | None:
    """The forward's key-block step as a block without a mask runs it: in the innermost loop that issues at least 8
    HGMMAs and waits with one wgmma group left (S done, P V running), the path from the loop's head to the branch back
    to it (conditional branches taken or not, unconditional ones followed) with the fewest selects (FSEL: the masked
    copy selects masked scores), then the fewest instructions (no wait's retry). Nsight Compute's executed counts per
    SASS line give the same count (hd64 192-row non-causal forward: 423, an H100 profile of 2026-12)."""
    index = {address: i for i, address in enumerate(addresses)}
    spans = [(a, b) for a, b in loops(code, addresses, labels) if sum("HGMMA" in x for x in code[a:b + 1]) >= 8
             and any("DEPBAR.LE gsb0, 0x1" in x for x in code[a:b + 1])]
    if not spans:
        return None
    a = min(spans, key=lambda span: span[1] - span[0])[0]
    # Dijkstra over instructions, each costing (is a select, 1) in lexicographic order
    heap, done = [(0, a, (a,))], set()
    while heap:
        cost, i, path = heapq.heappop(heap)
        if i in done:
            continue
        done.add(i)
        target = branch_target(code[i], labels)
        if target is not None and index.get(target) == a:
            return [code[j] for j in path]
        nexts = [] if target is None else [index.get(target)]
        if target is None or code[i].startswith("@"):
            nexts.append(i + 1)
        for j in nexts:
            if j is not None and j < len(code) and j not in done:
                weight = 100000 * unpredicated(code[j]).startswith("FSEL") + 1
                heapq.heappush(heap, (cost + weight, j, path + (j,)))
    return None


def between_hgmma(code: list[str], max_gap: int = 12) -> int:
    """Instructions between consecutive HGMMAs at most max_gap apart (a GEMM's k-steps, issued back to back): their
    operands' descriptor work (flash_bwd_sm90.cuh bdesc)."""
    at = [i for i, ins in enumerate(code) if "HGMMA" in ins]
    return sum(b - a - 1 for a, b in zip(at, at[1:]) if b - a - 1 <= max_gap)


def unpredicated(ins: str) -> str:
    """The instruction without its guard predicate (@P0, @!UP1, ...)."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins)


def loop_instructions(code: list[str]) -> list[str]:
    """The instructions from the first HGMMA to the last, unpredicated: the kernels' main loops (where spills cost
    time), with the code between their GEMMs."""
    mma = [i for i, ins in enumerate(code) if "HGMMA" in ins]
    return [unpredicated(ins) for ins in code[mma[0]:mma[-1] + 1]] if mma else []


def pv_wait_windows(code: list[str]) -> list[tuple[int, int]]:
    """(exponentials, instructions) between each wgmma wait that leaves one group running (DEPBAR.LE gsb0, 0x1) and
    the full wait (0x0) right after it: in the forward's key-block loop, the softmax that runs beside the P V GEMM."""
    windows, current = [], None
    for ins in code:
        op = unpredicated(ins)
        if op.startswith("WARPGROUP.DEPBAR"):
            if op.endswith("0x1"):
                current = [0, 0]
            else:
                if current is not None:
                    windows.append((current[0], current[1]))
                current = None
        elif current is not None:
            current[0] += op.startswith("MUFU.EX2")
            current[1] += 1
    return windows


def report(item: str, tool: str, workdir: Path) -> str:
    spec = kernel_spec(item)
    cubin = workdir / f"{spec.name}.cubin"
    resources = build._compile_nvcc(spec, build.SM90_ARCH, cubin, ptxas_verbose=True)
    code, addresses, labels = sass_listing(disassemble(tool, cubin))
    spills = [ins for ins in code if re.search(r"\b(LDL|STL)\b", ins)]
    in_loop = [ins for ins in loop_instructions(code) if re.search(r"\b(LDL|STL)\b", ins)]
    extra = ""
    if item.startswith("fwd"):
        step = forward_step_path(code, addresses, labels)
        extra = (f", unmasked step {len(step)} instr ({sum(unpredicated(x).startswith('U') for x in step)} uniform)"
                 if step else "")
        extra += ", P V wait after " + " / ".join(f"{e} exp2 ({n} instr)" for e, n in pv_wait_windows(code))
    if item.startswith("bwd"):
        step = unmasked_step(code, addresses, labels)
        extra = (f", unmasked step {len(step)} instr ({sum('HGMMA' in x for x in step)} HGMMA, "
                   f"{sum(unpredicated(x).startswith('UIADD3.X') for x in step)} UIADD3.X)" if step else "")
    return f"{item:<24} {spec.name:<48} {len(code):>6} instr  {resources}  spill instr {len(spills)} ({len(in_loop)} " \
           f"between the first and last HGMMA){extra}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS)
    parser.add_argument("--defines", default="", help="comma-separated macros, e.g. FT_BWD_PRODUCER_REGS=40")
    args = parser.parse_args()
    if args.defines:
        os.environ["FLASHTRAIN_EXTRA_DEFINES"] = args.defines
    tool = disassembler()
    if build.nvcc_path() is None or tool is None:
        raise SystemExit("needs nvcc and cuobjdump or nvdisasm (CUOBJDUMP=path or NVDISASM=path)")
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.kernels:
            print(report(item, tool, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
