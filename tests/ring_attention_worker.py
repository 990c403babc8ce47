"""The processes of tests/test_ring_attention.py: `world` processes (torch.multiprocessing.spawn; gloo on the CPU,
NCCL with one GPU each) run every case of CASES through ring_attention on their shards, gather out, lse and the
gradients with unshard_sequence, and rank 0 saves them (torch.save) for the test process to compare with
single-process attention. One process group serves all cases, so a test session starts the processes once per
world size and backend.

By hand: python tests/ring_attention_worker.py 2 gloo /tmp/ring  (writes /tmp/ring/results.pt; PYTHONPATH=.:tests)
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flashtrain.parallel.ring_attention import ring_attention, shard_sequence, unshard_sequence

BATCH, SEQLEN = 2, 40  # zigzag over 4 ranks: chunks of 5 tokens
# document lengths per batch row: an empty and a one-token document, documents across chunk and rank boundaries,
# an empty document at a row's start
DOCUMENTS = [[3, 0, 1, 22, 14], [0, 1, 17, 5, 17]]
# name -> (nheads, nheads_kv, head_dim, causal, layout, documents, lse in the loss, softmax_scale)
CASES = {
    "causal-zigzag": (4, 4, 16, True, "zigzag", False, False, None),
    "causal-contiguous": (4, 4, 16, True, "contiguous", False, False, None),
    "full-zigzag-scale": (4, 4, 16, False, "zigzag", False, False, 0.3),
    "full-contiguous-gqa": (4, 2, 16, False, "contiguous", False, False, None),
    "causal-zigzag-mqa-lse": (4, 1, 24, True, "zigzag", False, True, None),
    "documents-causal-zigzag-gqa-lse": (4, 2, 16, True, "zigzag", True, True, None),
    "documents-causal-contiguous": (2, 2, 8, True, "contiguous", True, False, None),
    "documents-full-zigzag": (2, 1, 16, False, "zigzag", True, True, None),
}
DTYPES = {"gloo": (torch.float64, torch.float32), "nccl": (torch.bfloat16,)}
DETERMINISTIC_CASE = "documents-causal-zigzag-gqa-lse"


def document_offsets() -> torch.Tensor:
    """cu_seqlens (int32, host) of DOCUMENTS over the flattened BATCH * SEQLEN rows."""
    lengths = torch.tensor([n for row in DOCUMENTS for n in row])
    assert all(sum(row) == SEQLEN for row in DOCUMENTS) and len(DOCUMENTS) == BATCH
    return torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])


def case_inputs(name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Full-sequence q, k, v (batch, seqlen, heads, dim) and dout like q in `dtype`, dlse (batch, nheads, seqlen) in
    lse's dtype (float64 for float64, else float32): the same in every process and in the test."""
    nheads, nheads_kv, head_dim = CASES[name][:3]
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    shapes = [(BATCH, SEQLEN, nheads, head_dim), (BATCH, SEQLEN, nheads_kv, head_dim),
              (BATCH, SEQLEN, nheads_kv, head_dim), (BATCH, SEQLEN, nheads, head_dim), (BATCH, nheads, SEQLEN)]
    tensors = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return [x.to(device, dtype if i < 4 else lse_dtype) for i, x in enumerate(tensors)]


def loss_of(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor, with_lse: bool):
    """(out * dout).sum(), plus (lse * dlse).sum() where the case puts lse in the loss."""
    loss = (out * dout).sum()
    return loss + (lse * dlse).sum() if with_lse else loss


def run_case(name: str, dtype: torch.dtype, rank: int, world: int, device: torch.device,
             deterministic: bool = False):
    """ring_attention on this rank's shard of the case; (out, lse, dq, dk, dv) of the full sequences (on the CPU)."""
    _, _, _, causal, layout, documents, with_lse, scale = CASES[name]
    q, k, v, dout, dlse = (shard_sequence(x, 2 if i == 4 else 1, rank, world, layout)
                           for i, x in enumerate(case_inputs(name, dtype, device)))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, group=None, causal=causal, softmax_scale=scale, layout=layout,
                              cu_seqlens=document_offsets() if documents else None, deterministic=deterministic,
                              return_lse=True, impl="cuda" if device.type == "cuda" else "auto")
    loss_of(out, lse, dout, dlse, with_lse).backward()
    return [unshard_sequence(x.detach(), 2 if i == 1 else 1, None, layout).cpu()
            for i, x in enumerate((out, lse, q.grad, k.grad, v.grad))]


def errors(world: int, device: torch.device) -> dict[str, str]:
    """The messages of calls ring_attention refuses (before any communication, the same on every rank)."""
    # (bfloat16 on the GPU: the kernels' dtype, so that the refusal tested is the one named)
    q = torch.randn(BATCH, SEQLEN // world, 2, 8, device=device,
                    dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    found = {}
    calls = {
        "row-crossing": dict(cu_seqlens=torch.tensor([0, SEQLEN + 3, BATCH * SEQLEN], dtype=torch.int32)),
        "int64-offsets": dict(cu_seqlens=document_offsets().long()),
        "short-offsets": dict(cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)),
        "layout": dict(layout="striped"),
        "impl": dict(impl="triton"),
        "uneven": dict(q=q[:, :3], k=q[:, :3], v=q[:, :3]),
        "cuda-on-cpu": dict(impl="cuda"),
    } if device.type == "cpu" else {
        "head-dim": dict(q=q[..., :4], k=q[..., :4], v=q[..., :4], impl="cuda"),
        "host-offsets": dict(cu_seqlens=document_offsets().to(device)),
    }
    for label, options in calls.items():
        arguments = {"q": q, "k": q, "v": q, "causal": True, **options}
        try:
            ring_attention(arguments.pop("q"), arguments.pop("k"), arguments.pop("v"), **arguments)
        except (ValueError, TypeError, RuntimeError) as error:
            found[label] = f"{type(error).__name__}: {error}"
    return found


def round_trips(rank: int, world: int, device: torch.device) -> dict[tuple[str, int], torch.Tensor]:
    """unshard_sequence(shard_sequence(x)) of a (3, 8 world, 5) tensor along dims 1 and -1, per layout."""
    x = torch.arange(3 * 8 * world * 5, dtype=torch.float32, device=device).view(3, 8 * world, 5)
    found = {}
    for layout in ("zigzag", "contiguous"):
        found[layout, 1] = unshard_sequence(shard_sequence(x, 1, rank, world, layout), 1, None, layout).cpu()
        y = x.transpose(1, 2)
        found[layout, -1] = unshard_sequence(shard_sequence(y, -1, rank, world, layout), -1, None, layout).cpu()
    return found


def worker(rank: int, world: int, backend: str, directory: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # `world` processes share the machine's cores
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world)
    try:
        results = {"cases": {}, "deterministic": [], "errors": errors(world, device),
                   "round_trips": round_trips(rank, world, device)}
        for name in CASES:
            for dtype in DTYPES[backend]:
                results["cases"][name, str(dtype)] = run_case(name, dtype, rank, world, device)
        for _ in range(2):
            results["deterministic"].append(run_case(DETERMINISTIC_CASE, DTYPES[backend][-1], rank, world, device,
                                                     deterministic=True))
        if rank == 0:
            torch.save(results, Path(directory) / "results.pt")
    finally:
        dist.destroy_process_group()


def run(world: int, backend: str, directory: Path) -> dict:
    """Start `world` processes of `backend` (gloo: CPU; nccl: one GPU each), wait for them, return rank 0's
    results."""
    torch.multiprocessing.spawn(worker, args=(world, backend, str(directory)), nprocs=world, join=True)
    return torch.load(directory / "results.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    print({key: len(value) for key, value in run(int(sys.argv[1]), sys.argv[2], out_dir).items()})
