"""GPU: GPT-2 trains under every trainer.compile_mode with our attention ops, reduce-overhead on CUDA graphs.

    pytest -m cuda tests/test_compile_modes_cuda.py
"""

import pytest
import torch
from torch._dynamo.utils import counters

from flashtrain.models.gpt2 import GPT2Config
from flashtrain.train.config import COMPILE_MODES

pytestmark = pytest.mark.cuda


def _losses(mode: str | None, attn_dropout: float, steps: int = 4) -> list[float]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=256, n_embd=128, n_layer=2, n_head=2, attn_dropout=attn_dropout)
    assert config.attention_backend(torch.device("cuda"), torch.bfloat16) == "flash -> kernel"  # our ops compile
    model = config.build().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step_model = model if mode is None else torch.compile(model, mode=mode)
    tokens = torch.randint(0, 512, (4, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for _ in range(steps):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(tokens[:, :-1], tokens[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_compiled_training_matches_eager(mode):
    torch._dynamo.reset()
    counters.clear()
    eager = _losses(None, 0.0)
    compiled = _losses(mode, 0.0)
    assert eager[-1] < eager[0]  # it trains
    for step, (a, b) in enumerate(zip(eager, compiled)):
        assert abs(a - b) <= 2e-2 * abs(a), f"step {step}: eager loss {a}, {mode} {b}"
    if mode == "reduce-overhead":  # the step ran as CUDA graphs: nothing in it (our ops included) made inductor skip
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_reduce_overhead_with_attention_dropout():
    """rng_state is drawn on the device inside the graph: each replay draws a new dropout mask."""
    torch._dynamo.reset()
    counters.clear()
    losses = _losses("reduce-overhead", 0.2, steps=5)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
