"""GPU: the fused cross-entropy kernels (flashtrain.kernels.cross_entropy) against F.cross_entropy in float64, for
float32 / float16 / bfloat16 logits, odd and padded vocabularies, ignored and out-of-range targets, -inf logits and
torch.compile; GPT-2's loss with and without them.

    pytest -m cuda tests/test_cross_entropy_cuda.py
"""

import math

import pytest
import torch
import torch.nn.functional as F

from flashtrain.kernels.cross_entropy import cross_entropy
from flashtrain.models.gpt2 import GPT2Config

pytestmark = pytest.mark.cuda


def _expected(logits, targets, vocab, ignore_index=-100):
    """Loss and logits' gradient (zeros past vocab) in float64."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x[:, :vocab], targets, ignore_index=ignore_index, reduction="sum")
    loss = loss / (targets != ignore_index).sum().clamp(min=1)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, width, vocab", [(37, 50304, 50257), (64, 512, 512), (5, 1003, 1003), (9, 40, 33)])
def test_loss_and_gradient_match_float64(dtype, rows, width, vocab):
    gen = torch.Generator("cuda").manual_seed(rows)
    logits = (3 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    if width > vocab:
        logits[:, vocab:] = 1e4 if dtype != torch.float16 else 6e4  # padding columns never count
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[::4] = -100
    want_loss, want_grad = _expected(logits, targets, vocab)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets, vocab)
    (2.5 * loss).backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype and x.grad.shape == (rows, width)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-5)
    eps = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # one rounding of the output
    assert torch.allclose(x.grad.double(), 2.5 * want_grad, rtol=eps, atol=eps * 2.5 / (rows * 0.75) + 1e-7)
    assert not x.grad[:, vocab:].any() and not x.grad[::4].any()  # padding columns and ignored rows: exactly 0


def test_strided_rows_unaligned_rows_and_int32_targets():
    gen = torch.Generator("cuda").manual_seed(0)
    base = torch.randn(16, 1001, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = base[:, 1:]  # rows start 2 bytes past 16-byte boundaries: the scalar path
    targets = torch.randint(0, 1000, (16,), device="cuda", dtype=torch.int32, generator=gen)
    want_loss, want_grad = _expected(logits, targets.long(), 1000)
    x = base.clone().requires_grad_()
    loss = cross_entropy(x[:, 1:], targets)
    loss.backward()
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert torch.allclose(x.grad[:, 1:].double(), want_grad, rtol=8e-3, atol=1e-6) and not x.grad[:, 0].any()


def test_minus_infinity_logits_all_ignored_and_out_of_range_targets():
    logits = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    logits[:, 32:] = -math.inf  # masked columns: probability 0, no NaN
    targets = torch.tensor([1, 2, 3, 4], device="cuda")
    want_loss, _ = _expected(logits, targets, 64)
    x = logits.clone().requires_grad_()
    loss = cross_entropy(x, targets)
    loss.backward()
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5) and torch.isfinite(x.grad).all()
    assert not x.grad[:, 32:].any()
    y = logits.clone().requires_grad_()
    none = cross_entropy(y, torch.full((4,), -100, device="cuda"))
    none.backward()
    assert float(none) == 0.0 and not y.grad.any()
    assert math.isnan(float(cross_entropy(logits, torch.tensor([1, 2, 64, 3], device="cuda"))))
    with pytest.raises(ValueError, match="vocab"):
        cross_entropy(logits, targets, vocab=65)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(logits, targets[:3])


def test_under_torch_compile_fullgraph():
    torch._dynamo.reset()
    logits = torch.randn(64, 50304, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50257, (64,), device="cuda")

    def step(x, t):
        return cross_entropy(x * 1.0, t, 50257)

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(logits, targets)
    loss.backward()
    grad, logits.grad = logits.grad, None
    eager = step(logits, targets)
    eager.backward()
    assert float(loss) == pytest.approx(float(eager), rel=1e-6) and torch.equal(grad, logits.grad)


def test_gpt2_loss_and_gradients_with_and_without_the_fused_kernels():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1001, n_positions=128, n_embd=128, n_layer=2, n_head=2)
    model = config.build().cuda()
    tokens = torch.randint(0, 1001, (4, 129), device="cuda")
    results = []
    for fused in (True, False):
        model.config.fused_loss = fused
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, loss = model(tokens[:, :-1], tokens[:, 1:])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((logits, loss, grads))
    (l1, a, g1), (l2, b, g2) = results
    assert logits.shape == (4, 128, 1001) and torch.equal(l1, l2)
    assert float(a) == pytest.approx(float(b), rel=1e-5)
    for x, y in zip(g1, g2):  # bf16 gradients of the logits: rounded once either way
        assert torch.allclose(x, y, rtol=2e-2, atol=2e-4)
