"""Typed configuration: one dataclass per Hydra config group, registered as structured-config schemas.

Every YAML file under conf/ starts from one of these schemas (its `defaults:` names `<thing>_schema`), so a
misspelled key, in a file or on the command line, stops the start with "Key 'lr_typo' not in 'OptimConfig'".
Hydra lets `+key=value` add a key that no schema has (the fix its own error message suggests); `typed_config` stops
those too, then turns the composed config into these dataclasses, which also runs each one's `__post_init__` checks.
The root `FlashtrainConfig` ties the groups together; `launch.py` composes it and calls `typed_config`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

from flashtrain.data.documents import EcthrConfig, LongDocConfig, MimicConfig
from flashtrain.data.listops import ListOpsConfig
from flashtrain.data.lm import LMDataConfig
from flashtrain.data.mlm import MaskedLMDataConfig
from flashtrain.data.lra_hf import LRAImageConfig, LRARetrievalConfig, LRATextConfig
from flashtrain.data.pathfinder import PathfinderConfig
from flashtrain.data.task import model_data_misfit
from flashtrain.models.attention_variants import VARIANTS as ATTENTION_VARIANTS
from flashtrain.models.bert import BertConfig
from flashtrain.models.gpt2 import GPT2Config
from flashtrain.models.hf_model import HFCausalLMConfig
from flashtrain.models.llama import LlamaConfig
from flashtrain.models.lra import LRAConfig

PRECISIONS = ("auto", "no", "bf16", "fp16")
SCHEDULES = ("cosine", "rsqrt", "linear")
OPTIMIZERS = ("adamw", "lamb")
TRACKERS = ("wandb", "tensorboard")  # Accelerate's trackers that the trainer sets up
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")  # flashtrain/train/activation_checkpoint.py


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw (torch.optim.AdamW) | lamb (flashtrain.train.lamb.LAMB, MLPerf BERT's optimizer)
    lr: float = 6e-4  # peak learning rate, reached after warmup
    # after warmup: cosine (to lr * min_lr_ratio) | rsqrt (lr * sqrt(warmup / step), LRA's) | linear (to
    # lr * min_lr_ratio at max_steps: MLPerf BERT's polynomial decay of power 1)
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # cosine and linear decay to lr * min_lr_ratio at trainer.max_steps (rsqrt: unused)
    warmup_steps: int = 100  # linear warmup from 0, in optimizer steps
    weight_decay: float = 0.1  # decoupled (AdamW); never applied to biases and norm weights
    decay_embeddings: bool = False  # also decay token/position embeddings (GPT-2 recipes: no)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    fused: bool = True  # fused AdamW kernel when the parameters are on a GPU

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name must be one of {OPTIMIZERS}, got {self.name!r}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "rsqrt" and self.warmup_steps < 1:
            raise ValueError(f"optim.warmup_steps must be >= 1 with schedule rsqrt (it sets the decay), "
                             f"got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass
class TrainerConfig:
    max_steps: int = 200  # optimizer steps; also the length of the LR schedule
    stop_step: Optional[int] = None  # stop (with a checkpoint) at this step without changing the schedule
    max_minutes: Optional[float] = None  # stop (with a checkpoint) after this much wall-clock training time
    micro_batch_size: int = 8  # sequences per process per forward/backward
    # sequences per optimizer step, all processes together (null: micro_batch_size x processes). Gradient accumulation
    # is derived: global_batch_size / (micro_batch_size x processes) micro-batches per process and step, which must be
    # a whole number (the run stops at start-up otherwise, saying which micro-batch sizes fit)
    global_batch_size: Optional[int] = None
    precision: str = "auto"  # auto (bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU) | no | bf16 | fp16
    cpu: bool = False  # force the CPU even when a GPU is present
    compile: bool = False  # torch.compile the model
    # torch.compile mode (with compile=true): default | reduce-overhead (CUDA graphs: replays each step's kernels
    # without their launch cost) | max-autotune (also searches matmul configurations)
    compile_mode: str = "default"
    # bitwise-reproducible steps on the GPU (a resumed run repeats the uninterrupted one exactly): PyTorch's
    # deterministic algorithms, cuBLAS's fixed workspace, and the attention kernel's deterministic backward (slower)
    deterministic: bool = False
    # recompute activations in the backward pass, per block (the model's _no_split_modules): none | full (keep only
    # each block's input) | selective (keep the matmul and attention outputs, recompute norms, GELU, dropout, adds)
    activation_checkpointing: str = "none"
    # several processes: when the data is not prepared yet (python -m flashtrain.data.prepare), rank 0 prepares it
    # while the others wait this long, saying so every minute, before they stop
    prepare_timeout_minutes: float = 360.0
    # Python's garbage collector: 0 leaves it automatic (a full collection can pause any step for tens of ms); N > 0
    # turns automatic collection off while training and collects young objects every N steps on every process at
    # once, and everything at each validation pass and checkpoint
    gc_interval: int = 0
    # torch.profiler over optimizer steps "A-B" (or "A"; 1-based, inclusive) on every process: a Chrome / Perfetto
    # trace per process in <run dir>/profile/, and the main process prints the ops that took the most time
    profile_steps: Optional[str] = None
    log_interval: int = 10  # steps between train-loss log lines
    eval_interval: int = 50  # steps between validation passes (and one at the end); data.val_samples says how much
    save_interval: int = 100  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 2  # most recent checkpoints kept on disk
    # a step whose loss or gradient norm is not finite is skipped (no update); after this many in a row the run stops,
    # with a checkpoint of the last finite weights
    max_nonfinite_steps: int = 10
    # true: read each step's finiteness one step later (with a fused AdamW and no fp16 loss scaler): the update of a
    # non-finite step is skipped on the device (the optimizer's found_inf), and the host, instead of waiting for the
    # backward pass before every optimizer step, queues the next step while the GPU finishes this one; its count, LR
    # schedule and records are corrected when the answer arrives (the same run, tested on the CPU). One process
    # without FSDP for now (elsewhere the step-by-step check runs); GPT-2 small 4K on an H200: 1.017-1.018x
    # tokens/s, curves within the run-to-run noise (docs/training.md); false: the host waits for each step's
    # answer
    lagged_finite_check: bool = True
    # stop (with a checkpoint) at the first validation pass where this metric (e.g. val_mlm_accuracy) is >= stop_value
    stop_metric: Optional[str] = None
    stop_value: Optional[float] = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"trainer.compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"trainer.activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, got "
                             f"{self.activation_checkpointing!r}")
        if self.prepare_timeout_minutes <= 0:
            raise ValueError(f"trainer.prepare_timeout_minutes must be > 0, got {self.prepare_timeout_minutes}")
        for name in ("max_steps", "micro_batch_size", "log_interval", "eval_interval",
                     "save_interval", "keep_checkpoints", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.gc_interval < 0:
            raise ValueError(f"trainer.gc_interval must be >= 0 (0: Python's automatic collection), got "
                             f"{self.gc_interval}")
        if self.profile_steps is not None:
            self.profile_window()  # a ValueError naming trainer.profile_steps when it is not "A" or "A-B"
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"trainer.global_batch_size must be >= 1 (or null), got {self.global_batch_size}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"trainer.max_minutes must be > 0 (or null), got {self.max_minutes}")
        if (self.stop_metric is None) != (self.stop_value is None):
            raise ValueError(f"trainer.stop_metric and trainer.stop_value go together, got {self.stop_metric!r} and "
                             f"{self.stop_value!r}")
        if self.stop_step is not None and not 0 < self.stop_step <= self.max_steps:
            raise ValueError(f"trainer.stop_step must be in [1, trainer.max_steps={self.max_steps}], "
                             f"got {self.stop_step}")

    def profile_window(self) -> tuple[int, int] | None:
        """profile_steps as (first, last) optimizer step, 1-based and inclusive; None when unset."""
        if self.profile_steps is None:
            return None
        first, _, last = str(self.profile_steps).partition("-")
        try:
            window = int(first), int(last or first)
        except ValueError:
            window = (0, 0)
        if not 1 <= window[0] <= window[1]:
            raise ValueError(f"trainer.profile_steps must be 'A' or 'A-B' with 1 <= A <= B (optimizer steps), got "
                             f"{self.profile_steps!r}")
        return window


@dataclass
class LoggerConfig:
    # the Accelerate trackers that also get the metrics, several at once: [wandb], [tensorboard] (into
    # RUN_DIR/tensorboard/), [wandb, tensorboard], or [] for none; metrics.jsonl and curves.png are always written
    kind: List[str] = field(default_factory=lambda: ["wandb"])
    project: str = "flashtrain"  # wandb project; the tensorboard run's directory name
    mode: str = "offline"  # wandb mode: offline needs no account; `wandb sync` uploads later

    def __post_init__(self) -> None:
        for tracker in self.kind:
            if tracker not in TRACKERS:
                raise ValueError(f"logger.kind lists trackers among {TRACKERS} ([] for none), got {tracker!r}")
        if len(set(self.kind)) != len(self.kind):
            raise ValueError(f"logger.kind names a tracker twice: {self.kind}")
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled, got {self.mode!r}")


@dataclass
class ParallelConfig:
    # context parallelism: each sequence split over this many processes, attention as ring attention between them
    # (flashtrain/parallel/context.py). The W processes form (W / context) data-parallel groups of `context` processes;
    # it must divide W, and data.seq_len must be a multiple of 2 x context (the zigzag layout). 1: none
    context: int = 1

    def __post_init__(self) -> None:
        if self.context < 1:
            raise ValueError(f"parallel.context must be >= 1 (1: no context parallelism), got {self.context}")


@dataclass
class FlashtrainConfig:
    name: str = MISSING  # run name; defaults to the recipe's name. Runs land in runs/<name>/<time>/
    seed: int = 1234  # seeds model init, dropout and the data order
    resume: Optional[str] = None  # null: fresh run | auto: newest checkpoint of runs/<name>/ | PATH: a checkpoint or run dir
    # resume a checkpoint trained with another model/data configuration (otherwise that stops, listing the keys)
    resume_allow_config_change: bool = False
    init_from: Optional[str] = None  # fresh run from these weights: checkpoint/run dir or hf:NAME (train/model_init.py)
    init_position_extension: str = "repeat"  # repeat | interpolate: how init_from's position table is lengthened
    model: Any = MISSING  # a model schema (GPT2Config, ...): `model.build()` builds the model
    data: Any = MISSING  # a data schema (LMDataConfig, ListOpsConfig, ...): `data.build()` prepares it, its task
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how the processes split the work

    def __post_init__(self) -> None:
        if self.init_position_extension not in ("repeat", "interpolate"):
            raise ValueError(f"init_position_extension must be repeat or interpolate, "
                             f"got {self.init_position_extension!r}")


class UnknownConfigKeyError(ValueError):
    """A key of the composed config that its schema does not have (typically added with `+group.key=value`)."""


def unknown_keys(cfg: DictConfig, prefix: str = "") -> Iterator[tuple[str, str, list[str]]]:
    """(dotted key, schema name, the schema's keys) of every key of `cfg` that is not a field of its node's dataclass
    schema, depth first; nodes without a schema (plain dicts) are not checked."""
    schema = OmegaConf.get_type(cfg)
    names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if names is not None and key not in names:
            yield path, schema.__name__, names
            continue
        child = cfg._get_node(key)
        if OmegaConf.is_dict(child) and not child._is_none():  # a nested node (not a value)
            yield from unknown_keys(child, path + ".")


def typed_config(cfg: DictConfig) -> FlashtrainConfig:
    """The composed config as its dataclasses (running their checks), after checking that every key, `+key=value`
    included, belongs to its schema: OmegaConf's to_object would drop an unknown key silently."""
    unknown = list(unknown_keys(cfg))
    if unknown:
        lines = [f"Key '{path.rsplit('.', 1)[-1]}' not in '{schema}' ({path}; {schema}'s keys: {', '.join(names)})"
                 for path, schema, names in unknown]
        raise UnknownConfigKeyError("\n".join(lines) + "\nEvery key, `+key=value` included, must be a field of its "
                                    "schema (flashtrain/train/config.py and the model/data config classes)")
    try:
        return OmegaConf.to_object(cfg)
    except InterpolationKeyError as error:
        misfit = interpolation_misfit(cfg, error)
        if misfit is None:
            raise
        raise misfit from None


def interpolation_misfit(cfg: DictConfig, error: InterpolationKeyError) -> ValueError | None:
    """A model key that reads a data key the chosen data config does not have (`vocab_size: ${data.vocab_size}`), or
    the other way round, as the model/data check's error naming both configs; None for any other missing key."""
    found = re.match(r"Interpolation key '([^']+)' not found", str(error.msg))
    group, missing = str(error.full_key).split(".", 1)[0], found.group(1) if found else ""
    other = missing.split(".", 1)[0]
    if {group, other} != {"model", "data"}:
        return None
    schemas = {name: getattr(OmegaConf.get_type(cfg, name), "__name__", name) for name in ("model", "data")}
    try:  # the key's own text, "${data.vocab_size}"
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in str(error.full_key).split("."):
            raw = raw[part]
    except (KeyError, TypeError):  # a key inside a list: say less
        raw = "${" + missing + "}"
    return model_data_misfit(schemas["model"], schemas["data"],
                             f"{error.full_key}={raw} reads {missing}, which {schemas[other]} does not have: "
                             f"set {error.full_key}=VALUE, or choose a {other} config that has it")


def job_dirname(override_dirname: str) -> str:
    """A sweep job's directory name from its overrides ("optim.lr=0.001,trainer.max_steps=9"): one path component
    ("/" in values replaced), and hashed past 120 characters (file names stop at 255)."""
    name = override_dirname.replace("/", "_") or "no-overrides"
    if len(name) <= 120:
        return name
    return f"{name[:100]}-{hashlib.sha256(override_dirname.encode()).hexdigest()[:12]}"


def config_group_choices() -> str:
    """The "group: option, ..." lines of `python launch.py --help` (conf/config.yaml's help template): Hydra's own
    list without the *_schema entries, the typed bases that every YAML file of a group starts from, not choices."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()
    choices, parents = {}, [""]
    while parents:
        parent = parents.pop()
        for group in loader.list_groups(parent):
            name = f"{parent}/{group}" if parent else group
            if name in ("hydra", "accelerate"):  # Hydra's own; conf/accelerate/: accelerate launch's config files
                continue
            options = [option for option in loader.get_group_options(name, ObjectType.CONFIG)
                       if not option.endswith("_schema")]
            if options:
                choices[name] = ", ".join(sorted(options))
            parents.append(name)
    return "\n".join(f"{name}: {choices[name]}" for name in sorted(choices))


PLUGINS_ENV = "FLASHTRAIN_PLUGINS"  # module[,module...]: models and data outside the package


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore and conf/config.yaml's resolvers (`job_dirname`,
    `config_group_choices`), then import
    the modules named by $FLASHTRAIN_PLUGINS, which register theirs (and their Hugging Face adapters) on import
    (idempotent)."""
    if not OmegaConf.has_resolver("job_dirname"):
        OmegaConf.register_new_resolver("job_dirname", job_dirname)
    if not OmegaConf.has_resolver("config_group_choices"):
        OmegaConf.register_new_resolver("config_group_choices", config_group_choices)
    cs = ConfigStore.instance()
    cs.store(name="flashtrain_schema", node=FlashtrainConfig)
    cs.store(group="model", name="gpt2_schema", node=GPT2Config)
    cs.store(group="model", name="llama_schema", node=LlamaConfig)
    cs.store(group="model", name="hf_schema", node=HFCausalLMConfig)
    cs.store(group="model", name="lra_schema", node=LRAConfig)
    cs.store(group="model", name="bert_schema", node=BertConfig)
    for name, schema in ATTENTION_VARIANTS.items():  # LRAConfig.attention: model/attention=NAME
        cs.store(group="model/attention", name=f"{name}_schema", node=schema)
    cs.store(group="data", name="lm_schema", node=LMDataConfig)
    cs.store(group="data", name="listops_schema", node=ListOpsConfig)
    cs.store(group="data", name="pathfinder_schema", node=PathfinderConfig)
    cs.store(group="data", name="lra_text_schema", node=LRATextConfig)
    cs.store(group="data", name="lra_retrieval_schema", node=LRARetrievalConfig)
    cs.store(group="data", name="lra_image_schema", node=LRAImageConfig)
    cs.store(group="data", name="mlm_schema", node=MaskedLMDataConfig)
    cs.store(group="data", name="ecthr_schema", node=EcthrConfig)
    cs.store(group="data", name="mimic_schema", node=MimicConfig)
    cs.store(group="data", name="longdoc_schema", node=LongDocConfig)
    cs.store(group="optim", name="adamw_schema", node=OptimConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    for plugin in filter(None, os.environ.get(PLUGINS_ENV, "").split(",")):
        importlib.import_module(plugin)
