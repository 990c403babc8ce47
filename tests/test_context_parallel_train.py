"""Context parallelism in the trainer (parallel.context, flashtrain/parallel/context.py), with real gloo processes on
the CPU: a sequence split over 2 processes trains as one process does on the whole batch (the same losses within the
DDP tests' tolerance), with document masks and reset positions too; dp x cp = 2 x 2 under FSDP likewise; a
context-parallel checkpoint continues on one process. Also, without processes: how a batch is split, and the start-up
refusals (shapes, data, attention settings ring attention cannot run)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flashtrain.data.listops import ListOpsConfig
from flashtrain.data.lm import collate_documents, shard_lm_batch
from flashtrain.models.gpt2 import GPT2Config
from flashtrain.parallel.context import ContextParallel, build_context_parallel, check_shape
from flashtrain.parallel.ring_attention import shard_positions
from flashtrain.train import train
from flashtrain.train.trainer import read_metrics
from hydra_config import compose_config
from test_processes import ENV, ROOT, TOLERANCE, command, free_port, launch, losses
from test_train import tiny_overrides

# 20 optimizer steps of 16 sequences of 128 tokens (one process: 2 micro-batches of 8), a loss every step, validation
# at 0, 10 and 20, checkpoints at 10 and 20
STEPS = ["trainer.global_batch_size=16", "trainer.max_steps=20", "trainer.log_interval=1", "trainer.eval_interval=10",
         "data.val_samples=16", "trainer.save_interval=10", "trainer.keep_checkpoints=2", "data.sample_tokens=0"]
DOCUMENTS = ["data.document_mask=true", "data.reset_positions=true"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache-context")


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> Path:
    """A corpus of short documents (every 3 lines of the standard library's first 40 modules, ~300 KB used): several
    documents in every 128-token block, so document masks and reset positions change every step."""
    stdlib = Path(os.__file__).parent
    lines = [line for path in sorted(stdlib.glob("*.py"))[:40] for line in path.read_text().splitlines()
             if line.strip()]
    path = tmp_path_factory.mktemp("short-documents") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "\n".join(lines[i:i + 3])}) + "\n" for i in range(0, len(lines), 3)))
    return path


def overrides(cache_dir, *extra):
    return tiny_overrides(cache_dir, *STEPS, *extra)


def document_overrides(cache_dir, short_documents, *extra):
    return overrides(cache_dir, f"data.corpus={short_documents}", *DOCUMENTS, *extra)


def assert_same_losses(reference_records, run_dir: Path, train_steps: list[int], val_steps: list[int]) -> None:
    """run_dir's metrics.jsonl has the reference's training losses at exactly train_steps and its validation losses
    at val_steps (TOLERANCE), the same token counts, every record once (only the main process writes)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    ref_train, ref_val = losses(reference_records), losses(reference_records, "val_loss")
    assert sorted(losses(records)) == train_steps
    assert len([r for r in records if "train_loss" in r]) == len(train_steps)
    for step in train_steps:
        assert losses(records)[step] == pytest.approx(ref_train[step], **TOLERANCE), step
    assert sorted(losses(records, "val_loss")) == val_steps
    for step in val_steps:
        assert losses(records, "val_loss")[step] == pytest.approx(ref_val[step], **TOLERANCE), step
    ref_tokens = {r["step"]: r["tokens"] for r in reference_records}
    assert all(r["tokens"] == ref_tokens[r["step"]] for r in records)  # 16 x 128 tokens a step, all processes


# ---- without processes ---------------------------------------------------------------------------------------------

def test_a_batch_is_split_into_each_ranks_positions():
    eos = 0
    input_ids = torch.randint(1, 50, (3, 16))
    input_ids[0, 5] = input_ids[1, 11] = input_ids[2, 2] = eos  # documents restart after each EOS
    samples = [(x, torch.roll(x, -1)) for x in input_ids]
    full = collate_documents(samples, eos, document_mask=True, reset_positions=True)
    shards = [shard_lm_batch(full, shard_positions(16, rank, 2)) for rank in range(2)]
    # zigzag over 2 ranks: 4 chunks of 4 tokens, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert shard_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    for key in ("input_ids", "targets", "position_ids"):
        assert shards[0][key].shape == (3, 8)
        rebuilt = torch.empty_like(full[key])
        for rank, shard in enumerate(shards):
            rebuilt[:, shard_positions(16, rank, 2)] = shard[key]
        assert torch.equal(rebuilt, full[key]), key
    assert shards[1]["position_ids"][0].tolist() == [4, 5, 0, 1, 2, 3, 4, 5]  # positions 4-11, reset after the EOS at 5
    for shard in shards:  # the full sequences' document boundaries, unchanged, on the host
        assert shard["cu_seqlens"] is full["cu_seqlens"] and shard["cu_seqlens"].device.type == "cpu"
    # plain (x, y) batches: the dict form, the global positions as position ids
    plain = shard_lm_batch((input_ids, torch.roll(input_ids, -1, 1)), shard_positions(16, 1, 2))
    assert sorted(plain) == ["input_ids", "position_ids", "targets"]
    assert plain["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]] * 3
    assert torch.equal(plain["input_ids"], input_ids[:, 4:12])


def probe(**model_settings):
    """Check a tiny GPT-2's attention calls as a process of a 2-way context-parallel run does at start-up (no
    process group: the check computes nothing and sends nothing)."""
    context = ContextParallel(None, rank=0, size=2, dp_rank=0, dp_size=1, seq_len=128, device="cpu",
                              dtype=torch.float32)
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=3, n_head=2, **model_settings)
    context.check_model(config)
    return context.probed_calls


def test_start_up_check_finds_every_attention_call_and_refuses_what_ring_attention_cannot_run():
    assert probe() == 3  # one causal self-attention call per block, each one ring attention runs
    assert probe(attn_impl="reference") == 3
    ring = "parallel.context=2 runs the model's self-attention as ring attention .* which does not run "
    with pytest.raises(ValueError, match=ring + r"attention dropout \(dropout_p=0.1: the model's attention dropout, "
                                               r"model.attn_dropout; set it to 0\)"):
        probe(attn_dropout=0.1)
    with pytest.raises(ValueError, match=ring + r"a sliding window \(model.attn_window\)"):
        probe(attn_window=16)
    with pytest.raises(ValueError, match=ring + r"logit softcapping \(model.attn_softcap\)"):
        probe(attn_softcap=30.0)
    for impl in ("sdpa", "auto"):  # SDPA on the CPU: no log-sum-exp to merge the ring's blocks by
        with pytest.raises(ValueError, match=f"parallel.context=2: model.attn_impl={impl} runs PyTorch SDPA here.*"
                                             f"use model.attn_impl=flash or reference"):
            probe(attn_impl=impl)


def test_shape_and_data_checks_name_the_settings():
    with pytest.raises(ValueError, match=r"parallel.context=3 does not divide the 4 process\(es\).*"
                                         r"data.seq_len=256 tokens"):
        check_shape(3, 4, 256, "data.seq_len")
    with pytest.raises(ValueError, match=r"data.seq_len=100 is not a multiple of 2 x parallel.context = 8 "
                                         r"\(4 processes\)"):
        check_shape(4, 4, 100, "data.seq_len")
    check_shape(2, 4, 128, "data.seq_len")  # fits
    with pytest.raises(ValueError, match="parallel.context=2 splits the sequences of causal language-model data .*"
                                         "ListOpsConfig gives classification data"):
        build_context_parallel(2, 2, torch.device("cpu"), torch.float32, ListOpsConfig())
    assert build_context_parallel(1, 4, torch.device("cpu"), torch.float32, ListOpsConfig()) is None


def test_context_parallel_on_one_process_stops_before_preparing_data(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"parallel.context=2 does not divide the 1 process\(es\).*"
                                         r"data.seq_len=128 tokens"):
        train(compose_config(tiny_overrides(tmp_path / "cache", "parallel.context=2")), tmp_path / "run")
    assert capsys.readouterr().out.splitlines()[0] == "processes: 1 (cpu)"
    assert not (tmp_path / "cache").exists()


# ---- real processes ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_documents(cache_dir, short_documents, tmp_path_factory):
    """One process (in this process), document masks and reset positions: 20 steps of 2 micro-batches of 8."""
    return train(compose_config(document_overrides(cache_dir, short_documents)),
                 tmp_path_factory.mktemp("reference-documents") / "run")


@pytest.mark.slow
def test_context_parallel_2_trains_as_one_process_and_resumes_on_one(reference_documents, cache_dir, short_documents,
                                                                      tmp_path, capsys):
    # several documents in every block: the ring's document masks and the reset positions are used throughout
    task = compose_config(document_overrides(cache_dir, short_documents)).data.build()
    batch = next(iter(task.train_loader(8, 0, 1, 0)))
    assert len(batch["cu_seqlens"]) - 1 > 3 * 8  # more than 3 documents a block
    code, out, err = launch([command("torchrun"), "--nproc_per_node", "2", "--master_port", free_port()], tmp_path,
                            *document_overrides(cache_dir, short_documents, "parallel.context=2"),
                            f"hydra.run.dir={tmp_path / 'cp'}")
    assert out.splitlines()[0] == "processes: 2 (DDP over gloo, cpu; context parallel 2 x data parallel 1)"
    assert ("batch: 16 sequences per optimizer step = micro-batch 8 x 1 data-parallel group(s) x 2 accumulation "
            "step(s); each sequence split over the 2 processes of its group (64 of its 128 tokens each)") in out
    assert "attention: flash -> reference, as ring attention over 2 processes" in out
    assert_same_losses(reference_documents.history, tmp_path / "cp", list(range(1, 21)), [0, 10, 20])

    # its step-10 checkpoint continues on one process: the weights do not depend on the split, the data position is
    # counted in samples
    capsys.readouterr()
    one = train(compose_config([*document_overrides(cache_dir, short_documents),
                                f"resume={tmp_path / 'cp' / 'checkpoints' / 'step_00000010'}"]), tmp_path / "one")
    assert one.final_step == 20
    assert "checkpoint of 2 process(es) continues on 1: the data after sample 160" in capsys.readouterr().out
    assert_same_losses(reference_documents.history, tmp_path / "one", list(range(11, 21)), [20])


@pytest.mark.slow
def test_fsdp_data_parallel_2_by_context_parallel_2_trains_as_one_process(cache_dir, tmp_path):
    plain = [*overrides(cache_dir), "trainer.precision=no"]  # fsdp.yaml's bf16 is for GPUs
    reference = train(compose_config(plain), tmp_path / "reference")
    code, out, err = launch([command("accelerate"), "launch", "--config_file", str(ROOT / "conf/accelerate/fsdp.yaml"),
                             "--num_processes", "4", "--main_process_port", free_port()], tmp_path, *plain,
                            "parallel.context=2", f"hydra.run.dir={tmp_path / 'fsdp'}")
    assert out.splitlines()[0] == ("processes: 4 (FSDP2 full shard, sharded_state_dict checkpoints over gloo, cpu; "
                                   "context parallel 2 x data parallel 2)")
    assert "micro-batch 8 x 2 data-parallel group(s) x 1 accumulation step(s)" in out
    assert_same_losses(reference.history, tmp_path / "fsdp", list(range(1, 21)), [0, 10, 20])
    # the weights are sharded over all 4 processes (the flattened dp x cp mesh), each writing its shard
    shards = tmp_path / "fsdp" / "checkpoints" / "step_00000020" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", *(f"__{rank}_0.distcp" for rank in range(4))]


@pytest.mark.slow
def test_benchmark_smoke_run_trains_both_models_split_as_on_one_process(tmp_path):
    """benchmarks/context_parallel.py --smoke (2 gloo processes): every length trains on one process and split over
    two with the same losses (the same weights and tokens); PyTorch's own context parallelism has no CPU SDPA, and its
    rows say so rather than report a number."""
    out = tmp_path / "context_parallel.json"
    proc = subprocess.run([command("torchrun"), "--nproc_per_node", "2", "--master_port", free_port(),
                           str(ROOT / "benchmarks" / "context_parallel.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["env"]["device_name"] == "cpu" and result["env"]["gpus"] == 2
    assert result["env"]["torch"] == torch.__version__ and result["env"]["date"]
    assert result["longest"] == {model: {"one-gpu": 256, "flashtrain-cp": 256} for model in ("gpt2-tiny", "llama-tiny")}
    assert "in_progress" not in result  # the mark of a measurement under way is gone when the run ends
    rows = {(r["model"], r["mode"], r["seq_len"]): r for r in result["measurements"]}
    for model in ("gpt2-tiny", "llama-tiny"):
        for seq_len in (128, 256):
            one, split = rows[model, "one-gpu", seq_len], rows[model, "flashtrain-cp", seq_len]
            assert (one["gpus"], split["gpus"]) == (1, 2)
            # the first step's loss, and the next two's after updates from the gradients (through ring attention's
            # backward and activation checkpointing's recomputation)
            assert len(split["losses"]) == 3 and split["losses"] == pytest.approx(one["losses"], **TOLERANCE)
            assert split["tokens_per_s"] == pytest.approx(seq_len / split["step_seconds"], rel=1e-9)
        assert rows[model, "torch-cp", 128]["status"].startswith("error: NotImplementedError")
        assert (model, "torch-cp", 256) not in rows  # a mode stops after its first failure
    table = {(r["model"], r["seq_len"]): r for r in result["table"]}
    for model in ("gpt2-tiny", "llama-tiny"):
        for seq_len in (128, 256):
            row = table[model, seq_len]
            assert row["cp_over_one_gpu"] == pytest.approx(
                rows[model, "flashtrain-cp", seq_len]["tokens_per_s"] / rows[model, "one-gpu", seq_len]["tokens_per_s"],
                rel=1e-12)
            assert "cp_over_torch_cp" not in row
        assert table[model, 128]["torch-cp"].startswith("error: NotImplementedError")
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_benchmark_table_and_predicted_out_of_memory():
    """benchmarks/context_parallel.py's docs table: each mode's tokens/s or its status, and flashtrain CP's ratio
    to one GPU and to PyTorch's CP only where both trained; and which lengths a multi-GPU mode skips as predicted
    out of memory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("context_parallel_benchmark",
                                                  ROOT / "benchmarks" / "context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"model": "m", "mode": "one-gpu", "seq_len": 8, "status": "ok", "tokens_per_s": 100.0},
            {"model": "m", "mode": "flashtrain-cp", "seq_len": 8, "status": "ok", "tokens_per_s": 180.0},
            {"model": "m", "mode": "torch-cp", "seq_len": 8, "status": "ok", "tokens_per_s": 150.0},
            {"model": "m", "mode": "one-gpu", "seq_len": 16, "status": "out of memory"},
            {"model": "m", "mode": "flashtrain-cp", "seq_len": 16, "status": "ok", "tokens_per_s": 90.0},
            {"model": "m", "mode": "torch-cp", "seq_len": 16, "status": "ok", "tokens_per_s": 75.0}]
    table = module.comparison(rows)
    assert [(r["model"], r["seq_len"]) for r in table] == [("m", 8), ("m", 16)]
    assert table[0]["cp_over_one_gpu"] == pytest.approx(1.8, rel=1e-12)
    assert table[0]["cp_over_torch_cp"] == pytest.approx(1.2, rel=1e-12)
    assert table[1]["one-gpu"] == "out of memory" and "cp_over_one_gpu" not in table[1]
    assert table[1]["cp_over_torch_cp"] == pytest.approx(1.2, rel=1e-12)
    assert module.longest(rows) == {"m": {"one-gpu": 8, "flashtrain-cp": 16, "torch-cp": 16}}
    # the next length of a multi-GPU mode is skipped when its doubled peak would not fit the GPU
    rows[4]["peak_memory_gib"], rows[5]["peak_memory_gib"] = [70.0, 70.5], [60.0, 61.0]
    assert module.predicted_out_of_memory(rows, "m", "flashtrain-cp", 32, 139.8) == (
        "not run: predicted out of memory (peak 70.5 GiB per GPU at 16 tokens, doubled 141.0 > 139.8 GiB)")
    assert module.predicted_out_of_memory(rows, "m", "torch-cp", 32, 139.8) == ""  # 122 GiB fits
    assert module.predicted_out_of_memory(rows, "m", "flashtrain-cp", 64, 139.8) == ""  # no measurement at 32
    assert module.predicted_out_of_memory(rows, "m", "flashtrain-cp", 32, None) == ""  # the CPU: no prediction
    rows[3]["peak_memory_gib"] = [100.0]
    assert module.predicted_out_of_memory(rows, "m", "one-gpu", 32, 139.8) == ""  # one GPU just records its OOM
