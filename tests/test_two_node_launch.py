"""A launch over two machines, run for real: two `torchrun --nnodes 2` invocations (node ranks 0 and 1, one process
each), here both on this machine at 127.0.0.1, join into one run of 2 processes over gloo, train a few steps of the
default recipe (its model, on a small slice of its data) and log the losses of the same run launched as 2 processes on
one machine."""

import os
import subprocess

import pytest

from flashtrain.train.trainer import read_metrics
from test_processes import ENV, ROOT, TOLERANCE, command, free_port, launch, losses

# the default recipe (gpt2-tiny on the standard library) on 300 KB of its corpus: 4 optimizer steps of 16 sequences
# of 256 tokens (8 on each process), a loss every step, validation at 0, 2 and 4; trainer.cpu: gloo on the CPU even
# where GPUs are
RECIPE = ["recipe=gpt2-tiny-stdlib", "name=two-node", "logger=none", "trainer.cpu=true", "data.max_bytes=300000",
          "data.vocab_size=512", "data.num_proc=1", "data.val_samples=16", "data.sample_tokens=0",
          "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "trainer.max_steps=4",
          "trainer.log_interval=1", "trainer.eval_interval=2", "trainer.save_interval=4"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as torchrun gives each of several processes on one machine


@pytest.mark.slow
def test_two_torchrun_nodes_train_as_two_processes_on_one_node(tmp_path):
    overrides = [*RECIPE, f"data.cache_dir={tmp_path / 'cache'}"]
    # one machine, 2 processes (its rank 0 prepares the data, which the two-node run then finds in the cache)
    _, out, _ = launch([command("torchrun"), "--nproc_per_node", "2", "--master_port", free_port()], tmp_path,
                       *overrides, f"hydra.run.dir={tmp_path / 'one-node'}", env=ONE_THREAD)
    assert out.splitlines()[0] == "processes: 2 (DDP over gloo, cpu)"

    # two machines of one process each: the same command on each but for --node_rank, machine 0's address on both
    port, procs = free_port(), []
    try:
        for rank in (0, 1):
            (tmp_path / f"node{rank}").mkdir()
            with open(tmp_path / f"node{rank}.out", "w") as stdout, open(tmp_path / f"node{rank}.err", "w") as stderr:
                procs.append(subprocess.Popen(
                    [command("torchrun"), "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1",
                     "--master_addr", "127.0.0.1", "--master_port", port, str(ROOT / "launch.py"), *overrides,
                     f"hydra.run.dir={tmp_path / 'two-node'}"],
                    cwd=tmp_path / f"node{rank}", env={**ENV, **ONE_THREAD}, stdout=stdout, stderr=stderr))
        codes = [proc.wait(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    outs = [(tmp_path / f"node{rank}.out").read_text() for rank in (0, 1)]
    assert codes == [0, 0], [(tmp_path / f"node{rank}.err").read_text()[-3000:] for rank in (0, 1)]
    assert outs[0].splitlines()[0] == "processes: 2 (DDP over gloo, cpu)"  # one run of the two nodes' processes
    assert ("batch: 16 sequences per optimizer step = micro-batch 8 x 2 process(es) x 1 accumulation step(s)"
            in outs[0])
    assert "processes:" not in outs[1]  # rank 0 speaks, and writes: node 1's process wrote nothing of its own
    assert os.listdir(tmp_path / "node1") == []

    one_node, two_nodes = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("one-node", "two-node"))
    for key, steps in (("train_loss", [1, 2, 3, 4]), ("val_loss", [0, 2, 4])):
        assert sorted(losses(two_nodes, key)) == steps
        for step in steps:
            assert losses(two_nodes, key)[step] == pytest.approx(losses(one_node, key)[step], **TOLERANCE), (key, step)
    assert [r["tokens"] for r in two_nodes] == [r["tokens"] for r in one_node]
