"""model=hf (flashtrain.models.hf_model): a transformers causal LM in the trainer's model protocol. Its loss against
transformers' own loss and against attn_implementation="sdpa" (float32, CPU); position ids that reset; the start-up
refusals; and (slow) a run through launch.py that trains, checkpoints and resumes exactly, and a run that starts from
a save_pretrained directory with its weights."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from flashtrain.data.task import DataSpec
from flashtrain.models.hf_model import HFCausalLMConfig

# a tiny Llama: 4 query heads of 16 on 2 key/value heads, an awkward vocabulary, untied head
TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, tie_word_embeddings=False)


def tiny(attn_implementation: str = "ft_attention", **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    return HFCausalLMConfig(config={**TINY, **fields}, vocab_size=97, n_positions=64,
                            attn_implementation=attn_implementation).build().eval()


def test_loss_is_transformers_own_and_sdpas():
    """The wrapper's loss on 2 x 47 tokens (targets shifted, two ignored) equals LlamaForCausalLM's own loss
    (labels = the unshifted tokens, -100 where ignored) within 1e-6, and the same weights under sdpa give it within
    1e-5 (float32: only the order of the attention sums differs)."""
    model, sdpa = tiny(), tiny("sdpa")
    sdpa.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    input_ids, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, 3] = targets[1, 40] = -100
    labels = tokens.clone()
    labels[0, 4] = labels[1, 41] = -100  # the same two targets, before transformers' shift
    with torch.no_grad():
        logits, loss = model(input_ids, targets)
        # transformers' own: the T + 1 tokens, the shift inside its loss; the first T positions' logits are causal
        theirs = model.hf(input_ids=tokens, labels=labels).loss
        sdpa_loss = sdpa(input_ids, targets)[1]
    assert logits.shape == (2, 47, 97) and loss.dtype == torch.float32
    assert abs(loss.item() - theirs.item()) <= 1e-6, (loss.item(), theirs.item())
    assert abs(loss.item() - sdpa_loss.item()) <= 1e-5, (loss.item(), sdpa_loss.item())
    assert model._no_split_modules == ["LlamaDecoderLayer"]
    # 6 per matmul parameter (the untied token table is a lookup) + 12 L T d
    matmul = sum(p.numel() for p in model.parameters()) - 97 * 64
    assert model.flops_per_token(47) == 6 * matmul + 12 * 2 * 64 * 47


def test_position_ids_place_tokens_and_mask_nothing():
    """Position ids 0..T-1 give the default's logits exactly; ids that restart mid-row (data.reset_positions) change
    RoPE's rotations but not the attention pattern, alike under ft_attention and sdpa within 1e-5 relative to the
    largest logit (float32 sums in another order; transformers alone
    would read the restart as packed documents and mask at it under sdpa). Weights of std 0.5, so that positions
    matter: the three differences are O(0.1)."""
    model, sdpa = tiny(initializer_range=0.5), tiny("sdpa", initializer_range=0.5)
    sdpa.load_state_dict(model.state_dict())
    input_ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    plain = torch.arange(40).expand(2, -1)
    reset = torch.cat([torch.arange(17), torch.arange(23)]).expand(2, -1)
    with torch.no_grad():
        default = model(input_ids)[0]
        ours, theirs = model(input_ids, position_ids=reset)[0], sdpa(input_ids, position_ids=reset)[0]
        assert torch.equal(model(input_ids, position_ids=plain)[0], default)
        # transformers' packed-documents guess (no cache, no mask), for contrast
        masked = sdpa.hf(input_ids=input_ids, position_ids=reset, use_cache=False).logits
    tolerance = 1e-5 * max(1.0, ours.abs().max().item())
    assert (ours - theirs).abs().max().item() <= tolerance
    assert (ours - default).abs().max().item() > 1e-2  # the rotations moved
    assert (ours - masked)[:, 17:].abs().max().item() > 1e-2  # the second segment sees the first
    assert (ours - masked)[:, :17].abs().max().item() <= tolerance  # the first segment is the same either way


def test_the_start_refuses_what_it_cannot_run():
    """Each refusal names the key to change."""
    config = HFCausalLMConfig(config=dict(TINY), vocab_size=97, n_positions=64)
    with pytest.raises(ValueError, match="data.document_mask"):
        config.check_data(DataSpec("causal_lm", 97, 64, "data.seq_len", document_mask=True))
    with pytest.raises(ValueError, match=r"data.seq_len=65 is longer than .*max_position_embeddings=64"):
        config.check_data(DataSpec("causal_lm", 97, 65, "data.seq_len"))
    with pytest.raises(ValueError, match="tokenizer has 98 tokens"):
        config.check_data(DataSpec("causal_lm", 98, 64, "data.seq_len"))
    with pytest.raises(ValueError, match="model.config=null"):
        HFCausalLMConfig(pretrained="some/dir", config=dict(TINY))
    with pytest.raises(ValueError, match="model_type"):
        HFCausalLMConfig(config={"hidden_size": 64})
    with pytest.raises(ValueError, match="model.attn_implementation"):
        HFCausalLMConfig(config=dict(TINY), attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="cu_seqlens"):
        tiny()(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


# ---- runs through the trainer -------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
RUN_STEPS = 40
# conf/model/hf.yaml (the tiny Llama, ft_attention) on 300 KB of the standard library, a 512-token BPE, 8 x 128 tokens
SHRUNK = ["model=hf", "data=stdlib", "logger=none", "model.n_positions=128", "data.max_bytes=300000",
          "data.val_fraction=0.1", "data.vocab_size=512", "data.num_proc=1", "data.val_samples=32",
          "trainer.micro_batch_size=8", "trainer.log_interval=5", "trainer.eval_interval=20",
          "trainer.save_interval=20", "optim.lr=3e-3", "optim.warmup_steps=5"]


def launch(*overrides: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "launch.py", *SHRUNK, *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(next(o for o in overrides if o.startswith("hydra.run.dir=")).split("=", 1)[1])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_launch_trains_checkpoints_and_resumes(tmp_path):
    """python launch.py model=hf data=stdlib, 40 steps: validation loss falls from near uniform over the 512 tokens
    by more than 0.6 nat (the bound of the GPT-2 and Llama runs of this size) at both passes; resuming the step-20
    checkpoint repeats steps 25-40's losses exactly (same weights, optimizer, data order). About 25 s."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    records = launch(cache, f"trainer.max_steps={RUN_STEPS}", f"hydra.run.dir={tmp_path / 'run'}")
    val = [r["val_loss"] for r in records if "val_loss" in r]
    train_losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert len(val) == 3 and val[0] > math.log(512) - 0.3, val
    assert val[0] > val[1] > val[2] and val[2] < val[0] - 0.6, val
    assert train_losses[-1] < train_losses[0] - 0.6, train_losses
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000020"
    assert (checkpoint / "model.safetensors").is_file()
    resumed = launch(cache, f"trainer.max_steps={RUN_STEPS}", f"resume={checkpoint}",
                     f"hydra.run.dir={tmp_path / 'resumed'}")
    after = [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in records if r["step"] > 20]
    assert [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in resumed] == after


@pytest.mark.slow
def test_pretrained_directory_starts_with_its_weights(tmp_path):
    """model.pretrained=DIR of a tiny random LlamaForCausalLM (save_pretrained, 512 tokens, 128 positions): the
    first step's training loss (before its update) is the saved model's own loss on that batch, within 1e-5."""
    from flashtrain.train import train
    from hydra_config import compose_config

    torch.manual_seed(5)
    saved = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, max_position_embeddings=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96)).eval()
    saved.save_pretrained(tmp_path / "llama")
    cfg = compose_config(["name=hf-pretrained", *SHRUNK, f"data.cache_dir={tmp_path / 'cache'}",
                          f"model.pretrained={tmp_path / 'llama'}", "model.config=null", "trainer.max_steps=1",
                          "trainer.log_interval=1", "trainer.eval_interval=1", "data.sample_tokens=0"])
    result = train(cfg, tmp_path / "run")
    first = next(r["train_loss"] for r in result.history if "train_loss" in r)
    task = cfg.data.build()
    input_ids, targets = next(iter(task.train_loader(8, 0, 1, start_batch=0)))
    with torch.no_grad():
        tokens = torch.cat([input_ids, targets[:, -1:]], dim=1)  # targets are input_ids shifted by one
        own = saved(input_ids=tokens, labels=tokens).loss.item()
    assert abs(first - own) <= 1e-5, (first, own)


@pytest.mark.slow
def test_fsdp_two_processes_train_as_one(tmp_path):
    """model=hf under FSDP2 (conf/accelerate/fsdp.yaml, 2 CPU processes over gloo, each transformers decoder layer a
    unit through the model's _no_split_modules): 6 steps of 16 sequences give the one-process run's training and
    validation losses within 1e-5 (the DDP / FSDP tests' tolerance, tests/test_processes.py). The validation set here
    (22 sequences, 3 micro-batches of 8) does not split evenly over the 2 processes: the one with fewer batches
    replays its last one for the other's all-gathers (it hung before)."""
    import shutil
    import socket

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    steps = ["trainer.max_steps=6", "trainer.global_batch_size=16", "trainer.eval_interval=3", "trainer.log_interval=1",
             "trainer.save_interval=6", "trainer.precision=no"]
    one = launch(cache, *steps, f"hydra.run.dir={tmp_path / 'one'}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    accelerate = str(Path(sys.executable).parent / "accelerate")
    accelerate = accelerate if Path(accelerate).is_file() else shutil.which("accelerate")
    proc = subprocess.run([accelerate, "launch", "--config_file", str(ROOT / "conf/accelerate/fsdp.yaml"),
                           "--num_processes", "2", "--main_process_port", port, "launch.py", *SHRUNK, cache, *steps,
                           f"hydra.run.dir={tmp_path / 'fsdp'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "processes: 2 (FSDP2 full shard" in proc.stdout
    fsdp = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    for key in ("train_loss", "val_loss"):
        expected = {r["step"]: r[key] for r in one if key in r}
        got = {r["step"]: r[key] for r in fsdp if key in r}
        assert sorted(got) == sorted(expected) and len(expected) >= 2, key
        for step, loss in expected.items():
            assert got[step] == pytest.approx(loss, abs=1e-5, rel=1e-5), (key, step)
