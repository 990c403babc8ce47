"""Several processes through the README's launch commands, with real processes on the CPU (gloo): DDP and FSDP give
the single-process losses for the same global batch, and checkpoints continue on another number of processes
(2 -> 1 -> 2) at the same data position with the same losses. Also: a launch that yields fewer processes than asked
stops in its header; processes other than rank 0 wait for it to prepare the data, with a timeout; the data can be
prepared as its own step (the prepare command)."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtrain.train import train
from flashtrain.train.checkpoint import model_state
from flashtrain.train.trainer import read_metrics
from hydra_config import compose_config
from test_train import ROOT, tiny_overrides

# 6 optimizer steps of 16 sequences (1 process: 2 micro-batches of 8; 2 processes: one each), a loss every step, a
# validation pass at 0, 3 and 6, a checkpoint every 2 steps
STEPS = ["trainer.global_batch_size=16", "trainer.max_steps=6", "trainer.log_interval=1", "trainer.eval_interval=3",
         "data.val_samples=16", "trainer.save_interval=2", "trainer.keep_checkpoints=3", "data.sample_tokens=0"]
# the processes' own reductions and thread counts change float summation order only: ~1e-6 on losses of ~6
TOLERANCE = dict(rel=0, abs=1e-5)
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flashtrain-cache-processes")


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    """The single-process run (in this process): 6 steps, each 2 micro-batches of 8."""
    return train(compose_config(tiny_overrides(cache_dir, *STEPS)), tmp_path_factory.mktemp("reference") / "run")


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def command(name: str) -> str:
    """A console script of this Python's environment (accelerate, torchrun)."""
    path = BIN / name
    return str(path) if path.is_file() else shutil.which(name)


def launch(launcher: list[str], cwd: Path, *overrides: str, expect_ok: bool = True,
           env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`<launcher> launch.py <overrides>` in `cwd`, with ENV and `env`: (exit status, stdout, stderr)."""
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*launcher, str(ROOT / "launch.py"), *overrides], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return proc.returncode, proc.stdout, proc.stderr


def losses(records, key="train_loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def assert_continues(reference, run_dir: Path, steps: list[int], val_steps: list[int]) -> None:
    """run_dir's metrics.jsonl has a training loss for exactly `steps`, each as the reference's, and validation losses
    at val_steps as the reference's; every record once (only the main process writes)."""
    records = read_metrics(run_dir / "metrics.jsonl")
    ref_train, ref_val = losses(reference.history), losses(reference.history, "val_loss")
    assert sorted(losses(records)) == steps
    assert len([r for r in records if "train_loss" in r]) == len(steps)
    for step in steps:
        assert losses(records)[step] == pytest.approx(ref_train[step], **TOLERANCE), step
    for step in val_steps:
        assert losses(records, "val_loss")[step] == pytest.approx(ref_val[step], **TOLERANCE), step
    ref_tokens = {r["step"]: r["tokens"] for r in reference.history}
    assert all(r["tokens"] == ref_tokens[r["step"]] for r in records)  # 16 x 128 tokens a step, all processes


@pytest.mark.slow
def test_ddp_two_processes_equal_one_and_resume_2_to_1_to_2(reference, cache_dir, tmp_path):
    overrides = tiny_overrides(cache_dir, *STEPS)
    # steps 1-2: `accelerate launch --num_processes 2 --cpu` (the README's command), Hydra's own run directory
    code, out, err = launch([command("accelerate"), "launch", "--num_processes", "2", "--cpu",
                             "--main_process_port", free_port()], tmp_path / "a", *overrides, "trainer.stop_step=2")
    (run_a,) = (tmp_path / "a" / "runs" / "test").iterdir()  # one run directory: rank 1 made none of its own
    assert "starting the 2 through accelerate's multi-process launcher" in out
    assert "processes: 2 (DDP over gloo, cpu)" in out
    assert "batch: 16 sequences per optimizer step = micro-batch 8 x 2 process(es) x 1 accumulation step(s)" in out
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["runs"]
    assert_continues(reference, run_a, [1, 2], [0])
    assert sorted(p.name for p in (run_a / "checkpoints" / "step_00000002").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]

    # steps 3-4 on 1 process (2 micro-batches of 8), in this process
    one = train(compose_config([*overrides, f"resume={run_a}", "trainer.stop_step=4"]), tmp_path / "b")
    assert one.final_step == 4
    assert_continues(reference, tmp_path / "b", [3, 4], [3])

    # steps 5-6 on 2 processes again, through torchrun
    code, out, err = launch([command("torchrun"), "--nproc_per_node", "2", "--master_port", free_port()], tmp_path,
                            *overrides, f"resume={tmp_path / 'b'}", f"hydra.run.dir={tmp_path / 'c'}")
    assert "processes: 2 (DDP over gloo, cpu)" in out
    assert (f"checkpoint of 1 process(es) continues on 2: the data after sample 64, as the uninterrupted run reads "
            f"it; processes 1-1 have no random state (dropout) in it and start theirs from the seed") in out
    assert_continues(reference, tmp_path / "c", [5, 6], [6])


@pytest.mark.slow
def test_fsdp_two_processes_equal_one_and_resume_2_to_1_to_2(reference, cache_dir, tmp_path):
    overrides = [*tiny_overrides(cache_dir, *STEPS), "trainer.precision=no"]  # the file's bf16 is for GPUs

    def fsdp(n, run, *extra):
        return launch([command("accelerate"), "launch", "--config_file", str(ROOT / "conf/accelerate/fsdp.yaml"),
                       "--num_processes", str(n), "--main_process_port", free_port()], tmp_path, *overrides, *extra,
                      f"hydra.run.dir={tmp_path / run}")[1]

    out = fsdp(2, "a", "trainer.stop_step=2")
    assert "processes: 2 (FSDP2 full shard, sharded_state_dict checkpoints over gloo, cpu)" in out
    assert_continues(reference, tmp_path / "a", [1, 2], [0])
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    # each process wrote its shard of the weights and of the optimizer state (torch.distributed.checkpoint)
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                  "__1_0.distcp"]
    assert sorted(p.name for p in (ckpt / "optimizer_0").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "model.safetensors").exists()
    assert (tmp_path / "a" / "hf" / "config.json").is_file()  # the FSDP-wrapped GPT-2 still exports its config

    out = fsdp(1, "b", f"resume={tmp_path / 'a'}", "trainer.stop_step=4")
    assert "processes: 1 (FSDP2 full shard" in out and "checkpoint of 2 process(es) continues on 1" in out
    assert_continues(reference, tmp_path / "b", [3, 4], [3])
    out = fsdp(2, "c", f"resume={tmp_path / 'b'}")
    assert "checkpoint of 1 process(es) continues on 2" in out
    assert_continues(reference, tmp_path / "c", [5, 6], [6])

    # the sharded weights gathered without a process group: the single-process run's, up to float summation order
    # (AdamW divides each gradient by its own running scale, so where a gradient is near zero the order's rounding
    # moves that weight's update most: up to 1.6e-5 after six steps on one CPU, 1e-5 on another)
    final = model_state(tmp_path / "c" / "checkpoints" / "step_00000006")
    for name, tensor in model_state(reference.checkpoint).items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=5e-5)
    # an FSDP checkpoint resumes under FSDP only, and says so
    with pytest.raises(ValueError, match="was saved by FSDP, sharded state dict, this run is one process or DDP"):
        train(compose_config([*overrides, f"resume={tmp_path / 'c'}", "trainer.max_steps=7"]), tmp_path / "d")


@pytest.mark.slow
def test_fsdp_bf16_on_one_process_trains_as_one_plain_process(cache_dir, tmp_path):
    """conf/accelerate/fsdp.yaml's bf16 (here CPU autocast) trains the model one process trains: fp32 parameters,
    gradients and reductions under the trainer's autocast. Accelerate's own FSDP bf16 policy (bf16 parameters and
    module outputs, no autocast) gave these 6 steps' losses rounded to bf16 and up to 0.012 off over 20 steps; bf16
    parameters alone 5e-4 off. One thread per process in both runs (accelerate launch's processes have one): the
    same float summation order, so the runs agree bit for bit."""
    overrides = [*tiny_overrides(cache_dir, *STEPS), "trainer.precision=bf16"]
    one_thread = {"OMP_NUM_THREADS": "1"}
    plain = launch([sys.executable], tmp_path, *overrides, f"hydra.run.dir={tmp_path / 'plain'}", env=one_thread)[1]
    _, fsdp, fsdp_stderr = launch([command("accelerate"), "launch", "--config_file",
                                   str(ROOT / "conf/accelerate/fsdp.yaml"), "--num_processes", "1",
                                   "--main_process_port", free_port()], tmp_path, *overrides,
                                  f"hydra.run.dir={tmp_path / 'fsdp'}", env=one_thread)
    assert "processes: 1 (FSDP2 full shard" in fsdp and "precision: bf16" in fsdp and "precision: bf16" in plain
    assert "returned a view tensor" not in fsdp_stderr  # torch's warning about an FSDP unit's output

    plain_records, fsdp_records = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("plain", "fsdp"))
    for key, steps in (("train_loss", [1, 2, 3, 4, 5, 6]), ("val_loss", [0, 3, 6])):
        assert sorted(losses(fsdp_records, key)) == steps
        assert losses(fsdp_records, key) == losses(plain_records, key), key
    # not rounded to bf16 on the way out (FSDP's output_dtype): a float32 loss a bf16 could hold is a 1/65536 chance
    assert all(torch.tensor(loss).bfloat16().item() != loss for loss in losses(fsdp_records).values())
    # the same weights after 6 steps: the plain run's model.safetensors, FSDP's shard gathered without processes
    step_6 = Path("checkpoints") / "step_00000006"
    fsdp_state = model_state(tmp_path / "fsdp" / step_6)
    for name, tensor in model_state(tmp_path / "plain" / step_6).items():
        torch.testing.assert_close(fsdp_state[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="accelerate launch starts one process per GPU here")
@pytest.mark.slow
def test_fewer_processes_than_asked_stops_in_the_header(tmp_path):
    # without --cpu (or GPUs), accelerate launch starts one process for --num_processes 2
    code, out, err = launch([command("accelerate"), "launch", "--num_processes", "2", "--main_process_port",
                             free_port()], tmp_path, *tiny_overrides(tmp_path / "cache"), expect_ok=False)
    assert code != 0
    assert out.splitlines()[0] == (
        "processes: 1 (cpu): accelerate launch --num_processes 2 asked for 2: stopping rather than training with "
        "fewer. accelerate launch starts several processes on a machine with as many GPUs (this one has 0), with "
        "--multi_gpu, or with a config file that asks for them; CPU processes need --cpu (accelerate launch --cpu "
        "--num_processes 2 launch.py ...)")
    assert not (tmp_path / "cache").exists()  # it stopped before preparing any data


@pytest.mark.slow
def test_other_processes_wait_for_rank_0_to_prepare_the_data_then_time_out(tmp_path):
    # a fresh cache: rank 0 trains a BPE and tokenizes (about a second) while rank 1 waits, here for 12 ms only
    code, out, err = launch([command("torchrun"), "--nproc_per_node", "2", "--master_port", free_port()], tmp_path,
                            *tiny_overrides(tmp_path / "cache"), "trainer.prepare_timeout_minutes=0.0002",
                            f"hydra.run.dir={tmp_path / 'run'}", expect_ok=False)
    assert code != 0
    assert ("TimeoutError: rank 1: rank 0 has not finished preparing the data after "
            "trainer.prepare_timeout_minutes=0.0002; prepare it first with `python -m flashtrain.data.prepare` and "
            "the same overrides, or raise the timeout") in err


@pytest.mark.slow
def test_prepare_command_fills_the_cache_and_training_only_opens_it(tmp_path, caplog):
    overrides = tiny_overrides(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-m", "flashtrain.data.prepare", *overrides], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data ready" in proc.stdout and "DataSpec(task='causal_lm', vocab_size=512, max_length=128" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no run directory: it writes the cache only
    (meta,) = (tmp_path / "cache" / "tokens").glob("*/meta.json")
    assert json.loads(meta.read_text())["n_tokens"]["train"] > 100_000
    with caplog.at_level(logging.INFO, logger="flashtrain.data.lm"):
        compose_config(overrides).data.build()
    assert f"token cache hit: {meta.parent}" in caplog.text


@pytest.mark.slow
def test_the_two_machine_commands_run_as_written(reference, cache_dir, tmp_path):
    """conf/accelerate/multi-node.yaml's two commands, one per machine rank (here both machines are this one, one CPU
    process each): they join into one run of 2 processes with the single-process losses."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
        with open(tmp_path / f"node{rank}.out", "w") as out, open(tmp_path / f"node{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                [command("accelerate"), "launch", "--config_file", str(ROOT / "conf/accelerate/multi-node.yaml"),
                 "--cpu", "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                 "--main_process_port", port, str(ROOT / "launch.py"), *tiny_overrides(cache_dir, *STEPS),
                 "trainer.stop_step=2", f"hydra.run.dir={tmp_path / 'run'}"],
                cwd=tmp_path / f"node{rank}", env=ENV, stdout=out, stderr=err))
    codes = [proc.wait(timeout=600) for proc in procs]
    outs = [(tmp_path / f"node{rank}.out").read_text() for rank in (0, 1)]
    assert codes == [0, 0], [(tmp_path / f"node{rank}.err").read_text()[-3000:] for rank in (0, 1)]
    for out in outs:
        assert "starting this machine's 1 of the 2 through accelerate's multi-process launcher" in out
    assert "processes: 2 (DDP over gloo, cpu)" in outs[0] and "processes:" not in outs[1]  # rank 0 speaks
    assert_continues(reference, tmp_path / "run", [1, 2], [0])
    assert list((tmp_path / "node1").iterdir()) == []  # machine 1's process wrote nothing of its own
