"""trainer.activation_checkpointing (flashtrain/train/activation_checkpoint.py): the same loss and gradients as without
it, dropout included, with fewer activations kept between the forward and the backward pass; through the trainer,
the same losses and checkpoints that load into a model without it."""

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flashtrain.models.bert import BertConfig, BertForMaskedLM
from flashtrain.models.gpt2 import GPT2Config
from flashtrain.train import activation_checkpoint, train
from hydra_config import compose_config
from test_train import tiny_overrides
from toy_model import ToyConfig


class HeldActivations(TorchDispatchMode):
    """Bytes of the tensors made under this mode that are still alive when `held_bytes` is called (after the forward
    pass: what the autograd graph and the checkpoint wrappers keep for the backward pass), counted per storage."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outputs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out

    def held_bytes(self) -> int:
        gc.collect()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (ref() for ref in self.outputs) if t is not None}
        return sum(storages.values())


def gpt2_step(mode: str, attn_impl: str):
    """(loss, gradients by parameter name, activation bytes held after the forward, block forward calls) of one
    training step of a 3-layer GPT-2 with dropout everywhere, on one CPU thread: the runs are compared bit for bit,
    and a reduction split over a varying number of threads need not add in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gpt2_step(mode, attn_impl)
    finally:
        torch.set_num_threads(threads)


def _gpt2_step(mode: str, attn_impl: str):
    torch.manual_seed(0)
    model = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=3, n_head=2, dropout=0.1, attn_dropout=0.1,
                       attn_impl=attn_impl).build()
    calls = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda *args: calls.append(1))  # the recomputation stops once it has all
    assert activation_checkpoint.apply(model, mode) == (0 if mode == "none" else 3)
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the dropout masks
    tracker = HeldActivations()
    with tracker:
        loss = model(x, x)[1]
    held = tracker.held_bytes()
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads, held, len(calls)


@pytest.mark.parametrize("attn_impl", ["flash", "sdpa"])  # flash on the CPU: flashtrain's reference attention
def test_same_gradients_with_fewer_activations_kept(attn_impl):
    loss, grads, held, calls = gpt2_step("none", attn_impl)
    kept = {}
    for mode in ("selective", "full"):
        mode_loss, mode_grads, kept[mode], mode_calls = gpt2_step(mode, attn_impl)
        assert mode_loss == loss and mode_grads.keys() == grads.keys()
        # the recomputation repeats the forward exactly, dropout masks included (a failure names every parameter
        # whose gradient differs, with its largest difference)
        differ = {name: (mode_grads[name] - grads[name]).abs().max().item() for name in grads
                  if not torch.equal(mode_grads[name], grads[name])}
        assert not differ, (mode, differ)
        assert (calls, mode_calls) == (3, 6)  # each block's forward runs again in the backward pass
    # measured (4 x 64 tokens, 64 wide): none ~4.7-5.8 MB, selective ~2.5-3.1 MB, full ~0.7 MB
    assert kept["full"] < 0.2 * held and 0.3 * held < kept["selective"] < 0.65 * held, (held, kept)


def test_bert_layers_checkpoint_with_packed_inputs():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40, attn_impl="flash")
    plain, checkpointed = BertForMaskedLM(config), BertForMaskedLM(config)
    checkpointed.load_state_dict(plain.state_dict())
    assert activation_checkpoint.apply(checkpointed, "full") == 2
    ids = torch.randint(5, 100, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 10:] = 0  # padding: the layers run packed (cu_seqlens, max_seqlen)
    labels = torch.where((torch.rand(3, 16) < 0.3) & mask.bool(), ids, -100)  # (3, 16): the masked-LM targets
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(5)  # the same dropout masks (hidden and attention dropout 0.1)
        loss = model(ids, mask, labels=labels)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match=r"trainer.activation_checkpointing=full: ToyLM names no blocks to checkpoint "
                                         r"\(a class attribute _no_split_modules"):
        activation_checkpoint.apply(ToyConfig().build(), "full")
    with pytest.raises(ValueError, match="trainer.activation_checkpointing must be one of"):
        compose_config(["name=x", "trainer.activation_checkpointing=some"])


def test_trainer_checkpointing_repeats_the_losses_and_saves_plain_weights(tmp_path, capsys):
    cache = tmp_path / "cache"
    runs = {}
    for mode in ("none", "selective"):
        runs[mode] = train(compose_config(tiny_overrides(cache, "model.dropout=0.1", "trainer.max_steps=3",
                                                         "trainer.log_interval=1", "trainer.eval_interval=3",
                                                         "trainer.save_interval=3", "data.sample_tokens=0",
                                                         f"trainer.activation_checkpointing={mode}")),
                           tmp_path / mode)
    assert "activation checkpointing: selective, 2 blocks" in capsys.readouterr().out
    assert [r.get("train_loss") for r in runs["none"].history] == [r.get("train_loss") for r in runs["selective"].history]
    plain, checkpointed = (load_file(runs[mode].checkpoint / "model.safetensors") for mode in ("none", "selective"))
    assert plain.keys() == checkpointed.keys()  # no wrapper in the names: either loads into the other
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=0)
