"""Training through launch.py's code path: Hydra composition + typed schemas + the Accelerate trainer."""

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from flashtrain.train import train
from flashtrain.train.checkpoint import TrainState, resolve_resume, run_checkpoints, write_manifest
from flashtrain.train.optim import lr_factor, param_groups
from flashtrain.train.processes import accumulation_steps
from flashtrain.train.trainer import read_metrics
from hydra_config import compose_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache")


def tiny_overrides(cache_dir, *extra):
    """A GPT-2 of 2 layers x 64 wide on ~300 KB of the stdlib corpus: a few seconds per run on 2 CPU cores."""
    return [
        "name=test",
        "logger=none",
        "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.n_positions=128",
        "data.max_bytes=300000", "data.val_fraction=0.1", "data.vocab_size=512", "data.num_proc=1", f"data.cache_dir={cache_dir}",
        "trainer.micro_batch_size=8", "trainer.max_steps=40", "trainer.log_interval=5",
        "trainer.eval_interval=20", "data.val_samples=32", "trainer.save_interval=20",
        "data.sample_tokens=16",
        "optim.lr=3e-3", "optim.warmup_steps=5",
        *extra,
    ]


def test_default_recipe_composes_to_typed_config():
    cfg = compose_config(["name=x"])
    assert type(cfg.model).__name__ == "GPT2Config"
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.n_positions) == (4, 192, 3, 256)
    assert cfg.data.seq_len == 256 and cfg.model.vocab_size == cfg.data.vocab_size == 1024
    assert cfg.logger.kind == ["wandb"] and cfg.logger.mode == "offline"


@pytest.mark.parametrize("override, key", [
    ("optim.lr_typo=1", "lr_typo"),
    ("trainer.max_step=3", "max_step"),
    ("model.n_layers=3", "n_layers"),
])
def test_misspelled_key_is_rejected(override, key):
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{override.split('=')[0]}'"):
        compose_config(["name=x", override])


@pytest.mark.parametrize("override, field", [
    ("trainer.precision=fp8", "trainer.precision"),
    ("optim.lr=-1", "optim.lr"),
    ("model.attn_impl=flsh", "attn_impl"),
    ("trainer.compile_mode=fast", "trainer.compile_mode"),
    ("trainer.gc_interval=-1", "trainer.gc_interval"),
    ("trainer.profile_steps=5-2", "trainer.profile_steps"),
    ("trainer.profile_steps=abc", "trainer.profile_steps"),
    ("logger.kind=[wandb,mlflow]", "logger.kind lists trackers among .* got 'mlflow'"),
    ("logger.kind=[tensorboard,tensorboard]", "logger.kind names a tracker twice"),
])
def test_bad_value_names_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        compose_config(["name=x", override])


def test_compile_mode_reaches_torch_compile(cache_dir, tmp_path, monkeypatch):
    """trainer.compile_mode (default | reduce-overhead | max-autotune) is the mode the trainer compiles with."""
    modes = []

    def fake_compile(model, mode=None):  # the compiled model would train the same; record the call only
        modes.append(mode)
        return model

    monkeypatch.setattr("flashtrain.train.trainer.torch.compile", fake_compile)
    cfg = compose_config(tiny_overrides(cache_dir, "trainer.max_steps=1", "data.sample_tokens=0",
                                        "trainer.compile=true", "trainer.compile_mode=reduce-overhead"))
    assert cfg.trainer.compile_mode == "reduce-overhead"
    assert train(cfg, tmp_path / "run").final_step == 1
    assert modes == ["reduce-overhead"]
    assert compose_config(["name=x"]).trainer.compile_mode == "default"


def test_launch_rejects_typo_fast():
    proc = subprocess.run([sys.executable, "launch.py", "optim.lr_typo=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "lr_typo" in proc.stderr and "OptimConfig" in proc.stderr
    assert "model:" not in proc.stdout  # it stopped before building anything


def test_launch_help_lists_choices_not_schemas():
    proc = subprocess.run([sys.executable, "launch.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    lines = {line.split(": ")[0]: line.split(": ")[1].split(", ") for line in groups.splitlines() if ": " in line}
    assert sorted(lines) == ["data", "logger", "model", "model/attention", "optim", "recipe", "recipe/base", "trainer"]
    assert lines["model/attention"] == ["bigbird", "butterfly", "dense", "linformer", "local", "longformer", "lsh",
                                        "performer"]  # the LRA encoder's attention variants
    assert lines["optim"] == ["adamw", "lamb"] and lines["logger"] == ["none", "tensorboard", "wandb"]
    assert "gpt2-tiny" in lines["model"] and "gpt2-tiny-stdlib" in lines["recipe"]
    assert "_schema" not in proc.stdout
    assert "name: ${hydra:runtime.choices.recipe}" in proc.stdout  # the composed config follows, as in Hydra's


def test_training_loss_falls(cache_dir, tmp_path, caplog):
    cfg = compose_config(tiny_overrides(cache_dir))
    caplog.set_level(logging.INFO)
    result = train(cfg, tmp_path / "run")
    val = [r["val_loss"] for r in result.history if "val_loss" in r]
    train_losses = [r["train_loss"] for r in result.history if "train_loss" in r]
    assert len(val) == 3  # before training, step 20, step 40
    assert val[0] > math.log(512) - 0.3  # an untrained model is close to uniform over the vocabulary
    assert val[0] > val[1] > val[2] and val[-1] < val[0] - 0.6, val  # 40K tokens: a clear fall, not convergence
    assert train_losses[-1] < train_losses[0] - 0.4, train_losses
    assert result.final_step == 40 and result.checkpoint == run_checkpoints(tmp_path / "run")[-1]
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == result.history
    assert (tmp_path / "run" / "curves.png").stat().st_size > 10_000
    assert len(result.sample) > len("def ")
    # the logged lr is the rate of the step's own update: step t ran with lr_factor(t - 1)
    logged_lr = {r["step"]: r["lr"] for r in result.history if "lr" in r}
    assert list(logged_lr) == [5, 10, 15, 20, 25, 30, 35, 40]
    for step, lr in logged_lr.items():
        assert lr == pytest.approx(3e-3 * lr_factor(step - 1, 5, 40, 0.1, "cosine"), rel=1e-12), step
    # throughput of all processes and per process (one here); MFU only on a GPU (its peak rate): not on this CPU run
    logged = [r for r in result.history if "train_loss" in r]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_s_per_process"] == r["tokens_per_s"] for r in logged)
    assert not any("mfu" in r for r in result.history)
    # checkpoints (steps 20 and 40) are saved without Accelerate's INFO lines or a shared-tensor warning
    accelerate_records = [r for r in caplog.records if r.name.startswith("accelerate")]
    assert accelerate_records == [], [r.getMessage() for r in accelerate_records]


@pytest.mark.slow
def test_chunked_loss_trains_the_same_model(cache_dir, tmp_path):
    # model.chunked_loss: the LM loss without the logits (flashtrain.models.losses); the same losses step by step
    runs = {}
    for chunked in (False, True):
        cfg = compose_config(tiny_overrides(cache_dir, "trainer.max_steps=10", "trainer.eval_interval=10",
                                            "trainer.save_interval=10", f"model.chunked_loss={str(chunked).lower()}",
                                            "data.sample_tokens=0"))
        runs[chunked] = train(cfg, tmp_path / f"run{int(chunked)}").history
    losses = {k: [r["train_loss"] for r in h if "train_loss" in r] + [r["val_loss"] for r in h if "val_loss" in r]
              for k, h in runs.items()}
    assert len(losses[True]) == 4 and losses[True] == pytest.approx(losses[False], rel=1e-4)


@pytest.mark.slow
def test_gc_interval_trains_the_same_steps_and_gives_the_collector_back(cache_dir, tmp_path, monkeypatch):
    # trainer.gc_interval: automatic collection off while training, young objects every N steps, everything at each
    # validation / checkpoint; the losses are the automatic collector's, and the collector is on again afterwards
    import gc

    collections = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *generation: collections.append(generation) or real_collect(*generation))
    runs, states = {}, {}
    for interval in (0, 3):
        cfg = compose_config(tiny_overrides(cache_dir, "trainer.max_steps=10", "trainer.eval_interval=5",
                                            "trainer.save_interval=5", "trainer.log_interval=1",
                                            f"trainer.gc_interval={interval}", "data.sample_tokens=0"))
        collections.clear()
        runs[interval] = [r["train_loss"] for r in train(cfg, tmp_path / f"run{interval}").history if "train_loss" in r]
        states[interval] = (list(collections), gc.isenabled())
    assert len(runs[3]) == 10 and runs[3] == runs[0]
    assert states[0] == ([], True)
    # at the start (everything), steps 3, 6, 9 (young objects), steps 5 and 10 (validation + checkpoint: everything)
    assert states[3] == ([(), (1,), (), (1,), (1,), ()], True)


def test_profile_steps_write_a_trace_of_those_steps(cache_dir, tmp_path, capsys):
    # trainer.profile_steps=3-4: torch.profiler over optimizer steps 3 and 4, one Chrome trace per process
    cfg = compose_config(tiny_overrides(cache_dir, "trainer.max_steps=6", "trainer.eval_interval=6",
                                        "trainer.save_interval=6", "trainer.profile_steps=3-4", "data.sample_tokens=0"))
    train(cfg, tmp_path / "run")
    (trace,) = (tmp_path / "run" / "profile").iterdir()
    assert trace.name == "steps_3-4_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    # two steps of 2-layer GPT-2: each step's forward has the attention and every linear layer's matmul
    assert sum(event.get("name") == "aten::addmm" or event.get("name") == "aten::mm" for event in events) >= 2 * 2 * 4
    assert "profile of steps 3-4" in capsys.readouterr().out


def test_resume_is_exact(cache_dir, tmp_path):
    # dropout on everywhere: a resumed run must also restore the RNG states exactly
    extra = ["model.dropout=0.1", "model.attn_dropout=0.1", "trainer.max_steps=12", "trainer.log_interval=1",
             "trainer.eval_interval=6", "trainer.save_interval=100", "data.sample_tokens=0",
             "trainer.global_batch_size=16"]
    full = train(compose_config(tiny_overrides(cache_dir, *extra)), tmp_path / "full")

    first = train(compose_config(tiny_overrides(cache_dir, *extra, "trainer.stop_step=5")), tmp_path / "a")
    assert first.final_step == 5 and first.checkpoint.name == "step_00000005"
    second = train(compose_config(tiny_overrides(cache_dir, *extra, f"resume={tmp_path / 'a'}")), tmp_path / "b")
    assert second.final_step == 12

    def losses(history, key):
        return {r["step"]: r[key] for r in history if key in r}

    full_train, resumed_train = losses(full.history, "train_loss"), losses(second.history, "train_loss")
    assert sorted(resumed_train) == list(range(6, 13))
    for step in range(6, 13):
        assert resumed_train[step] == pytest.approx(full_train[step], rel=1e-6, abs=1e-6), step
    assert losses(second.history, "val_loss")[12] == pytest.approx(losses(full.history, "val_loss")[12], rel=1e-6)


def test_time_limit_stops_with_checkpoint_and_eval(cache_dir, tmp_path, capsys):
    cfg = compose_config(tiny_overrides(cache_dir, "trainer.max_minutes=1e-6", "data.sample_tokens=0"))
    result = train(cfg, tmp_path / "run")
    assert result.final_step == 1 and result.checkpoint.name == "step_00000001"
    run = tmp_path / "run"  # the signal stop's advice (outside launch.py: the settings to add)
    assert (f"stopped after trainer.max_minutes=1e-06 at step 1; checkpoint: {result.checkpoint}. Continue this run "
            f"in place (its metrics.jsonl and checkpoints) with: the same command with hydra.run.dir={run} "
            f"resume={run}\n") in capsys.readouterr().out
    assert [r["step"] for r in result.history if "val_loss" in r] == [0, 1]
    cfg = compose_config(tiny_overrides(cache_dir, "trainer.max_steps=3", "data.sample_tokens=0",
                                        f"resume={tmp_path / 'run'}"))
    assert train(cfg, tmp_path / "run2").final_step == 3


def test_resume_auto_picks_newest_complete_checkpoint(tmp_path):
    runs = tmp_path / "runs" / "demo"
    for run, steps in (("2026-01-01_00-00-00", [10, 20]), ("2026-01-02_00-00-00", [30])):
        for step in steps:
            ckpt = runs / run / "checkpoints" / f"step_{step:08d}"
            ckpt.mkdir(parents=True)
            (ckpt / "model.safetensors").write_bytes(bytes(range(step)))
            write_manifest(ckpt, step, config={})
    # a save that was interrupted leaves only a .tmp- directory: never picked
    (runs / "2026-01-02_00-00-00" / "checkpoints" / ".tmp-step_00000040").mkdir()
    assert resolve_resume("auto", runs).name == "step_00000030"
    assert resolve_resume(str(runs / "2026-01-01_00-00-00"), runs).name == "step_00000020"
    assert resolve_resume(None, runs) is None
    assert resolve_resume("auto", tmp_path / "nothing") is None
    with pytest.raises(FileNotFoundError, match="resume"):
        resolve_resume(str(tmp_path / "missing"), runs)


def test_param_groups_and_schedule():
    cfg = compose_config(["name=x", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.vocab_size=50"])
    model = cfg.model.build()
    decay, no_decay = param_groups(model, weight_decay=0.1, decay_embeddings=False)
    decay_ids = {id(p) for p in decay["params"]}
    for name, p in model.named_parameters():
        expect = p.dim() >= 2 and ".wte." not in name and ".wpe." not in name
        assert (id(p) in decay_ids) == expect, name
    n_total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == n_total  # tied weight counted once
    with_emb, _ = param_groups(model, weight_decay=0.1, decay_embeddings=True)
    assert id(model.transformer.wte.weight) in {id(p) for p in with_emb["params"]}

    factors = [lr_factor(s, warmup_steps=10, max_steps=110, min_lr_ratio=0.1) for s in range(111)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert factors[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the scalar summaries in the TensorBoard event files under `directory` (TFRecords:
    length, its crc, an Event protobuf, its crc)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            length = int.from_bytes(data[offset:offset + 8], "little")
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


@pytest.mark.slow
def test_launch_end_to_end_with_wandb_offline_and_tensorboard(cache_dir, tmp_path):
    """logger.kind takes several Accelerate trackers: the same metrics go to metrics.jsonl, an offline wandb run and
    TensorBoard event files."""
    pytest.importorskip("tensorboardX")
    run_dir = tmp_path / "run"
    overrides = [o for o in tiny_overrides(cache_dir) if o not in ("name=test", "logger=none")]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "launch.py", *overrides, "trainer.max_steps=20",
                           "logger.kind=[wandb,tensorboard]", f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint: {run_dir / 'checkpoints' / 'step_00000020'}" in proc.stdout
    assert "---- sample ----" in proc.stdout
    assert "MFU: not reported on a CPU (" in proc.stdout  # the model's GFLOP per token, no GPU peak to divide by
    assert f"wandb: {run_dir / 'wandb'} (offline" in proc.stdout and f"tensorboard: {run_dir / 'tensorboard'}" in \
        proc.stdout
    records = read_metrics(run_dir / "metrics.jsonl")
    ppl = [r["val_ppl"] for r in records if "val_ppl" in r]
    assert ppl[-1] < 0.5 * ppl[0], ppl
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb wrote no offline run"
    scalars = tensorboard_scalars(run_dir / "tensorboard" / "flashtrain")
    for key in ("val_loss", "train_loss", "lr"):
        assert scalars[key] == pytest.approx({r["step"]: r[key] for r in records if key in r}, rel=1e-6), key
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert torch.load(run_dir / "checkpoints" / "step_00000020" / "optimizer.bin", weights_only=False)["state"]


def test_global_batch_size_gives_the_accumulation_or_stops_at_start_up(cache_dir, tmp_path):
    """trainer.global_batch_size = micro_batch_size x processes x accumulation steps; a size that no whole number of
    micro-batches makes stops the run before any data is prepared, naming the micro-batch sizes that fit."""
    assert [accumulation_steps(512, 8, n) for n in (1, 2, 4, 8, 64)] == [64, 32, 16, 8, 1]
    assert accumulation_steps(None, 8, 4) == 1  # null: one micro-batch per process and step
    with pytest.raises(ValueError, match=r"512 is not a multiple of 3 processes"):
        accumulation_steps(512, 8, 3)
    with pytest.raises(ValueError, match=r"trainer.micro_batch_size=8 x 4 process\(es\) = 32 .* fit 4 process\(es\): "
                                         r"1, 2, 5, 10, 25, 50\)"):
        accumulation_steps(200, 8, 4)  # 200 / 32 is not whole; 200 / (4 x m) is for m dividing 50
    cfg = compose_config(tiny_overrides(tmp_path / "no-cache", "trainer.global_batch_size=12"))
    with pytest.raises(ValueError, match=r"trainer.global_batch_size=12 is not a whole number of micro-batches: "
                                         r"trainer.micro_batch_size=8 x 1 process\(es\) = 8 sequences per micro-step "
                                         r"does not divide it \(micro-batch sizes that fit 1 process\(es\): 1, 2, 3, 4, "
                                         r"6, 12\)"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "no-cache").exists()
    with pytest.raises(ValueError, match="trainer.global_batch_size must be >= 1"):
        compose_config(["name=x", "trainer.global_batch_size=0"])


def test_checkpoint_from_before_sample_counts_continues_at_its_batches():
    state = TrainState()
    state.load_state_dict({"step": 7, "batches_consumed": 14, "tokens_seen": 100})  # a checkpoint's older TrainState
    assert (state.step, state.samples_consumed, state.legacy_batches_consumed) == (7, 0, 14)
    assert "legacy_batches_consumed" not in state.state_dict() and state.state_dict()["samples_consumed"] == 0
