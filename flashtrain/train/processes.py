"""Which processes run a training, and how they agree: the launchers, the check that every process asked for started,
Accelerate's FSDP on CPU processes, the batch plan, and rank 0 first where only one process may do the work.

Every process runs launch.py; Accelerate (DDP, FSDP) joins them. The launch paths (README, "Several processes"):

    accelerate launch --num_processes N [--cpu] launch.py ...           N GPUs, or N CPU processes with --cpu
    accelerate launch --config_file conf/accelerate/NAME.yaml launch.py ...    DDP, FSDP, several machines
    torchrun --nproc_per_node N launch.py ...

Without GPUs the processes join over gloo on the CPU. accelerate launch itself starts several CPU processes only
through an MPI hostfile (mpirun): given --cpu and N > 1 without one, it starts a single process. That process then
starts the N through accelerate's own multi-process launcher (torch.distributed.run, as accelerate does for GPUs) and
waits for them: `relaunch_cpu_processes`. Wherever a launch yields fewer processes than asked (a GPU count below
--num_processes, or a launcher's world size that the processes did not join), the first line of the run says so and
the run stops (`process_header`).

Only the main process (rank 0) writes: the Hydra run directory (`hydra_overrides_for_other_ranks`), the run's logs,
plots and checkpoint metadata (trainer.py). Data that is not prepared yet is prepared by rank 0 while the others wait
with a progress message and a timeout (`main_process_first`), not at a collective's default timeout.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, broadcast_object_list

T = TypeVar("T")

# a process's rank and the world size, as torchrun / accelerate (RANK, WORLD_SIZE) or MPI launchers set them
RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
# the words accelerate's command lines start their launch options after
ACCELERATE_LAUNCH_COMMANDS = ("launch", "accelerate-launch", "accelerate.commands.launch")


def _env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return None


def launched_rank() -> int:
    """This process's rank as its launcher set it (0 when started alone)."""
    return _env_int(RANK_VARS) or 0


# ---- accelerate launch's single-process path ---------------------------------------------------------------------

def accelerate_launch_options() -> argparse.Namespace | None:
    """The options of the `accelerate launch` command that started this process through accelerate's single-process
    launcher (its ACCELERATE_* variables are set, a launcher's world size is not), resolved as accelerate resolves
    them (a config file's values included); None when this process was not started that way."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ or _env_int(WORLD_SIZE_VARS) is not None:
        return None
    import psutil  # an accelerate dependency

    try:
        parent = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return None
    # the parent is `[python] accelerate launch OPTIONS SCRIPT ARGS`; this process is `SCRIPT ARGS` (sys.argv)
    n_own = len(sys.argv)
    if len(parent) < n_own or parent[len(parent) - n_own:] != sys.argv:
        return None
    starts = [i for i, word in enumerate(parent[:len(parent) - n_own])
              if word in ACCELERATE_LAUNCH_COMMANDS or os.path.basename(word) == "accelerate-launch"]
    if not starts:
        return None
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    options = launch_command_parser().parse_args(parent[starts[0] + 1:len(parent) - n_own] + [sys.argv[0]])
    accelerate_logger = logging.getLogger("accelerate")
    level = accelerate_logger.level
    accelerate_logger.setLevel(logging.ERROR)  # its "values not passed ... defaults used" notice, printed once already
    try:
        options, _, _ = _validate_launch_command(options)
    finally:
        accelerate_logger.setLevel(level)
    options.training_script_args = sys.argv[1:]
    return options


def relaunch_cpu_processes() -> int | None:
    """Under `accelerate launch --cpu --num_processes N` (N > 1, or several machines; --cpu or a config file's
    use_cpu: true) without an MPI hostfile, accelerate started only this process: start the N through accelerate's
    multi-process launcher, wait for them and return their exit status (0, or 1 when one failed). None when this
    process is one of the processes asked for; launch.py then trains."""
    options = accelerate_launch_options()
    if options is None or not (options.cpu or options.use_cpu) or options.mpirun_hostfile:
        return None
    if options.num_processes <= 1 and options.num_machines <= 1:
        return None
    from accelerate.commands.launch import multi_gpu_launcher
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    here = options.num_processes // options.num_machines
    share = f"the {here}" if options.num_machines == 1 else f"this machine's {here} of the {options.num_processes}"
    print(f"accelerate launch --cpu started one process for --num_processes {options.num_processes} (it starts several "
          f"CPU processes only with an MPI hostfile); starting {share} through accelerate's multi-process launcher "
          f"(torch.distributed.run)", flush=True)
    os.environ["ACCELERATE_USE_CPU"] = "true"  # the processes join over gloo, on the CPU
    try:
        multi_gpu_launcher(options)
    except ChildFailedError:  # the failed process printed its traceback; torch.distributed.run named it
        return 1
    return 0


# ---- the processes that started ----------------------------------------------------------------------------------

def processes_asked() -> tuple[int, str] | None:
    """(how many processes the launch asked for, which setting asked), or None when it did not say."""
    world_size = _env_int(WORLD_SIZE_VARS)
    if world_size is not None:
        return world_size, "the launcher's world size (WORLD_SIZE)"
    options = accelerate_launch_options()
    if options is not None and options.num_processes is not None:
        return options.num_processes, f"accelerate launch --num_processes {options.num_processes}"
    return None


def describe_processes(accelerator: Accelerator, context: int = 1) -> str:
    """The run header's words for how the processes run, e.g. "2 (DDP over gloo, cpu)", or with context parallelism
    (parallel.context=`context`, when it divides the processes) "4 (DDP over gloo, cpu; context parallel 2 x data
    parallel 2)"."""
    n = accelerator.num_processes
    if accelerator.distributed_type == DistributedType.NO:
        return f"1 ({accelerator.device})"
    backend = dist.get_backend() if dist.is_initialized() else accelerator.state.backend
    if accelerator.distributed_type == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        sharding = plugin.reshard_after_forward  # FSDP2: a bool; FSDP1: a ShardingStrategy
        sharding = ("full shard" if sharding else "shard grad op") if isinstance(sharding, bool) else \
            sharding.name.lower().replace("_", " ")
        kind = f"FSDP{plugin.fsdp_version} {sharding}, {plugin.state_dict_type.name.lower()} checkpoints"
    else:
        kind = "DDP"
    mesh = f"; context parallel {context} x data parallel {n // context}" if context > 1 and n % context == 0 else ""
    return f"{n} ({kind} over {backend}, {accelerator.device.type}{mesh})"


def process_header(accelerator: Accelerator, context: int = 1) -> tuple[str, str | None]:
    """(the run header's first line, e.g. "processes: 2 (DDP over gloo, cpu)"; why the run must stop, or None). The
    run stops when fewer processes started than the launch asked for. context: parallel.context."""
    line = f"processes: {describe_processes(accelerator, context)}"
    asked = processes_asked()
    if asked is None or asked[0] == accelerator.num_processes:
        return line, None
    n_asked, setting = asked
    if _env_int(WORLD_SIZE_VARS) is None:  # accelerate launch's single-process path
        why = (f"accelerate launch starts several processes on a machine with as many GPUs (this one has "
               f"{torch.cuda.device_count()}), with --multi_gpu, or with a config file that asks for them; CPU "
               f"processes need --cpu (accelerate launch --cpu --num_processes {n_asked} launch.py ...)")
    else:
        why = (f"the processes did not join one process group (Accelerate: {accelerator.distributed_type.value}); "
               f"check that the launcher's settings agree on every machine")
    return line, f"{setting} asked for {n_asked}: stopping rather than training with fewer. {why}"


def hydra_overrides_for_other_ranks() -> list[str]:
    """Hydra overrides that keep processes other than rank 0 from writing: no run directory of their own (rank 0's is
    everyone's), no .hydra/ copy of the config, no launch.log. Empty on rank 0 and in a single process."""
    rank = launched_rank()
    if rank == 0:
        return []
    overrides = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if "-m" in sys.argv or "--multirun" in sys.argv:  # a sweep's jobs still get directories: outside the runs/ tree
        overrides.append(f"hydra.sweep.dir={tempfile.gettempdir()}/flashtrain-rank{rank}-{os.getpid()}")
    return overrides


# ---- building the accelerator ------------------------------------------------------------------------------------

def launcher_precision() -> str | None:
    """The mixed precision the launcher asked for (accelerate launch --mixed_precision, or a config file's
    mixed_precision), when it asked for bf16 or fp16."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return precision if precision in ("bf16", "fp16") else None


def build_accelerator(cpu: bool, mixed_precision: str, **accelerator_options) -> Accelerator:
    """An Accelerator for this process (`accelerator_options`: Accelerator's other arguments). Without a GPU every
    process runs on the CPU (several of them join over gloo; Accelerate would otherwise treat each as a run of its
    own). A launch that asks for FSDP (accelerate launch with conf/accelerate/fsdp.yaml, or --use_fsdp) gets
    Accelerate's FSDP plugin from the launcher's FSDP_* variables with `fsdp_precision_policy`, on CPU processes too:
    Accelerate enables its FSDP plugin for GPU process groups only, so it is enabled here the way Accelerate does it
    for GPUs."""
    cpu = cpu or not torch.cuda.is_available()
    fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    plugin = None
    if fsdp_asked:
        plugin = FullyShardedDataParallelPlugin()  # the launcher's FSDP_* variables
        plugin.mixed_precision_policy = fsdp_precision_policy(plugin.fsdp_version)
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, fsdp_plugin=plugin, **accelerator_options)
    if fsdp_asked and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # what accelerate.state.AcceleratorState does for a GPU process group asked for FSDP, in both shared states
        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return accelerator


def fsdp_precision_policy(fsdp_version: int):
    """FSDP's own mixed precision, turned off: parameters, gradients and their reduction stay in fp32, and the
    trainer's autocast (trainer.precision, the launcher's mixed_precision) computes in bf16/fp16, as one process and
    DDP do, so FSDP trains the same model. Accelerate's default for mixed_precision=bf16 casts the parameters
    themselves to bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)), and its FSDP2
    preparation applies no autocast: the residual stream, the layer norms and the gradients (summed over
    micro-batches, reduced over processes) ran in bf16, and the loss came back rounded to bf16. What fp32 costs:
    each block's all-gather and gradient reduce-scatter move twice the bytes of bf16 ones."""
    if fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy()  # param_dtype, reduce_dtype, output_dtype None: no casts
    from torch.distributed.fsdp import MixedPrecision
    return MixedPrecision()


def accumulation_steps(global_batch_size: int | None, micro_batch_size: int, processes: int,
                       unit: str = "process(es)") -> int:
    """Micro-batches per process and optimizer step: global_batch_size / (micro_batch_size x processes); 1 when
    global_batch_size is None. `processes` are those that read different samples (with parallel.context: the
    data-parallel groups, `unit` names them). Raises ValueError naming the settings, and the micro-batch sizes that
    fit, when it is not a whole number."""
    if global_batch_size is None:
        return 1
    per_micro_step = micro_batch_size * processes
    if global_batch_size % per_micro_step == 0:
        return global_batch_size // per_micro_step
    fitting = [m for m in range(1, global_batch_size // processes + 1) if global_batch_size % (m * processes) == 0]
    hint = (f"micro-batch sizes that fit {processes} {unit}: {', '.join(map(str, fitting[-6:]))}" if fitting else
            f"no micro-batch size fits: {global_batch_size} is not a multiple of {processes} "
            f"{unit.replace('(es)', 'es').replace('(s)', 's')}")
    raise ValueError(f"trainer.global_batch_size={global_batch_size} is not a whole number of micro-batches: "
                     f"trainer.micro_batch_size={micro_batch_size} x {processes} {unit} = {per_micro_step} "
                     f"sequences per micro-step does not divide it ({hint})")


# ---- one process first -------------------------------------------------------------------------------------------

def main_process_first(work: Callable[[], T], accelerator: Accelerator, timeout_minutes: float,
                       what: str = "the data") -> T:
    """`work()` on the main process, then on the others (which then find its results in a cache). While the main
    process works the others wait on a gloo group of their own with a timeout of `timeout_minutes` (not the default
    process group's, which may be minutes), saying every minute how long they have waited; a failure on the main
    process stops every process with its message."""
    if accelerator.num_processes == 1:
        return work()
    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes + 1))
    try:
        if accelerator.is_main_process:
            try:
                result, error = work(), None
            except Exception as exc:  # the others must hear of it: they wait on this process
                result, error = None, exc
            dist.barrier(group=group)
            dist.broadcast_object_list([None if error is None else f"{type(error).__name__}: {error}"], src=0,
                                       group=group)
            if error is not None:
                raise error
            return result
        _wait(dist.barrier(group=group, async_op=True), accelerator, timeout_minutes, what)
        status = [None]
        dist.broadcast_object_list(status, src=0, group=group)
        if status[0] is not None:
            raise RuntimeError(f"rank 0 could not prepare {what}: {status[0]}")
        return work()
    finally:
        dist.destroy_process_group(group)


def _wait(barrier, accelerator: Accelerator, timeout_minutes: float, what: str) -> None:
    # one waiting process per machine speaks: rank 1 beside rank 0, the first process of every other machine
    speaks = accelerator.process_index == 1 or (accelerator.is_local_main_process and not accelerator.is_main_process)
    start = time.monotonic()
    deadline, next_message = start + timeout_minutes * 60, start + 60
    while not barrier.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"rank {accelerator.process_index}: rank 0 has not finished preparing {what} after "
                               f"trainer.prepare_timeout_minutes={timeout_minutes:g}; prepare it first with "
                               f"`python -m flashtrain.data.prepare` and the same overrides, or raise the timeout")
        if speaks and now >= next_message:
            print(f"rank {accelerator.process_index}: waiting for rank 0 to prepare {what}: {(now - start) / 60:.0f} "
                  f"min (trainer.prepare_timeout_minutes={timeout_minutes:g})", flush=True)
            next_message += 60
        time.sleep(min(0.5, deadline - now))
    barrier.wait()


def on_main_process(work: Callable[[], T], accelerator: Accelerator) -> T:
    """`work()` on the main process only, its result (picklable) given to every process; an exception on the main
    process is raised on every process."""
    if accelerator.num_processes == 1:
        return work()
    outcome = [None, None]
    if accelerator.is_main_process:
        try:
            outcome = [work(), None]
        except Exception as exc:
            outcome = [None, exc]
    result, error = broadcast_object_list(outcome)
    if error is not None:
        raise error
    return result
