"""Export a flashtrain run as a transformers model directory: `python -m flashtrain.export RUN_OR_CHECKPOINT OUT_DIR`.

RUN_OR_CHECKPOINT is a run directory (its newest checkpoint) or one checkpoint (runs/NAME/TIME/checkpoints/step_N).
The run's composed config (`RUN_DIR/.hydra/config.yaml`, written by launch.py) says which model it is and where its
tokenizer is. OUT_DIR then holds what `AutoModelForCausalLM` / `AutoModelForMaskedLM` /
`AutoModelForSequenceClassification` and `AutoTokenizer.from_pretrained(OUT_DIR)` load, offline:

    config.json, model.safetensors      the transformers config and weights (flashtrain.models.hf_convert)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   a transformers fast tokenizer
    generation_config.json              causal LMs (GPT-2, Llama-style): EOS and flashtrain.generate's sampling defaults

Which transformers class a model becomes, and how its config and weights convert, is the model class's Hugging Face
adapter (`flashtrain.models.hf_convert.register_hf_adapter`); the tokenizer is the data's (`Task.hf_tokenizer`). Runs
of models without an adapter (the LRA classifier) have no transformers counterpart. `load_run` is shared with
`flashtrain.generate`: the typed config, the model with the checkpoint's weights (a strict load_state_dict) and the
tokenizer. The checkpoint is verified as `resume` verifies it (`flashtrain.train.checkpoint.intact_checkpoint`): a run
directory gives its newest intact checkpoint, each damaged one skipped named in a warning; a damaged checkpoint named
explicitly, or a run with none intact, stops with a message naming the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from flashtrain.models.gpt2 import SAMPLING
from flashtrain.models.hf_convert import has_hf_adapter, hf_adapter, to_hf_state_dict
from flashtrain.train.checkpoint import CHECKPOINT_PREFIX, DamagedCheckpointError, intact_checkpoint, model_state
from flashtrain.train.hf_files import HF_FILES, hf_tokenizer_of

MAX_NEW_TOKENS = 200  # generation_config.json's and flashtrain.generate's default length


@dataclass
class Run:
    cfg: object  # the run's typed FlashtrainConfig
    checkpoint: Path
    model: torch.nn.Module  # in eval mode, on the CPU
    tokenizer: object  # a transformers PreTrainedTokenizerFast; None for models without a transformers counterpart


def find_intact_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) of a checkpoint (which must be intact) or of a run directory (its newest
    intact checkpoint), verified as resume does: `intact_checkpoint`, whose DamagedCheckpointError names the file."""
    checkpoint = intact_checkpoint(path, runs=False)
    if checkpoint is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint directory ({CHECKPOINT_PREFIX}N) nor a run directory "
                                "with checkpoints/")
    return checkpoint.parent.parent, checkpoint


def _typed_schema(group: str, values: dict):
    """A structured config of the dataclass registered for config `group` ("model", "data", or a nested group such as
    "model/attention") whose fields are exactly the keys of `values`; its nested config groups typed the same way."""
    from flashtrain.train import register_configs

    register_configs()
    entries = ConfigStore.instance().repo
    for part in group.split("/"):
        entries = entries[part]
    schemas = [OmegaConf.get_type(entry.node) for entry in entries.values() if not isinstance(entry, dict)]
    matches = [schema for schema in schemas if {f.name for f in dataclasses.fields(schema)} == set(values)]
    if len(matches) != 1:
        raise ValueError(f"the run's {group} config (keys {sorted(values)}) matches {len(matches)} of the registered "
                         f"{group} schemas {[s.__name__ for s in schemas]}, not one")
    node = OmegaConf.structured(matches[0])
    for key, value in values.items():
        if isinstance(entries.get(key), dict) and isinstance(value, dict):  # a nested group: model/attention
            node[key] = _typed_schema(f"{group}/{key}", value)
    return node


def _fill_hydra_values(node, hydra_yaml: Path):
    """`node` with each "${hydra:KEY}" (e.g. the run name, ${hydra:runtime.choices.recipe}) replaced by KEY's value
    in the run's hydra.yaml: Hydra saves config.yaml unresolved, and its resolver only works inside a Hydra app."""
    if isinstance(node, dict):
        return {key: _fill_hydra_values(value, hydra_yaml) for key, value in node.items()}
    if isinstance(node, list):
        return [_fill_hydra_values(value, hydra_yaml) for value in node]
    match = re.fullmatch(r"\$\{hydra:([\w.]+)\}", node) if isinstance(node, str) else None
    if match is None:
        return node
    if not hydra_yaml.is_file():
        raise FileNotFoundError(f"{hydra_yaml}: needed for {node!r} in the run's config")
    return OmegaConf.select(OmegaConf.load(hydra_yaml).hydra, match.group(1), throw_on_missing=True)


def load_run_config(run_dir: Path):
    """The typed FlashtrainConfig of a run, from RUN_DIR/.hydra/config.yaml."""
    from flashtrain.train.config import FlashtrainConfig

    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no composed config; runs started by launch.py write it")
    raw = _fill_hydra_values(OmegaConf.to_container(OmegaConf.load(path)), run_dir / ".hydra" / "hydra.yaml")
    raw = OmegaConf.to_container(OmegaConf.create(raw), resolve=True)  # ${data.vocab_size} and the like
    if isinstance(raw["logger"]["kind"], str):  # runs from before logger.kind listed trackers: "wandb" or "none"
        raw["logger"]["kind"] = [] if raw["logger"]["kind"] == "none" else [raw["logger"]["kind"]]
    schema = OmegaConf.structured(FlashtrainConfig)
    for group in ("model", "data"):  # typed `Any` in the root schema: pick their dataclass by their keys
        schema[group] = _typed_schema(group, raw[group])
    return OmegaConf.to_object(OmegaConf.merge(schema, raw))


def load_run(path: str | Path, attn_impl: str | None = None) -> Run:
    """The run at `path` (run or checkpoint directory): config, model with the checkpoint's weights, tokenizer.
    attn_impl overrides the model config's (e.g. "reference" or "sdpa" on a CPU). The checkpoint is verified
    (`find_intact_checkpoint`)."""
    run_dir, checkpoint = find_intact_checkpoint(path)
    cfg = load_run_config(run_dir)
    if attn_impl is not None:
        cfg.model.attn_impl = attn_impl
    model = cfg.model.build()
    try:  # strict: tied weights (flashtrain.models.tying) fill their second name themselves
        model.load_state_dict(model_state(checkpoint))  # any engine's checkpoint
    except RuntimeError as error:
        raise ValueError(f"{checkpoint} does not fit the run's model config: {error}") from None
    saved_tokenizer = run_dir / HF_FILES / "tokenizer.json"
    tokenizer = None
    if saved_tokenizer.is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer.parent)
    elif has_hf_adapter(type(model)):  # a run from before the run directory kept hf/: the data's tokenizer
        tokenizer = hf_tokenizer_of(model, cfg.data.build())
    return Run(cfg, checkpoint, model.eval(), tokenizer)


def hf_model_of(run: Run):
    """A transformers model with the run's weights, loaded strictly."""
    import transformers

    adapter = hf_adapter(type(run.model))
    hf_config = adapter.config_to_hf(run.model.config, run.tokenizer)
    hf_model = getattr(transformers, adapter.auto_class).from_config(hf_config)
    hf_model.load_state_dict(to_hf_state_dict(run.model), strict=True)
    return hf_model.eval()


def export(path: str | Path, out_dir: str | Path, push_to_hub: str | None = None) -> Path:
    """Write the transformers model directory of the run at `path` into `out_dir`; returns out_dir."""
    from transformers import GenerationConfig

    run = load_run(path)
    out_dir = Path(out_dir)
    hf_model = hf_model_of(run)
    hf_model.save_pretrained(out_dir, safe_serialization=True)
    run.tokenizer.save_pretrained(out_dir)
    if hf_model.can_generate():  # a causal LM: the sampling defaults of flashtrain.generate and the end-of-run sample
        GenerationConfig(bos_token_id=hf_model.config.bos_token_id, eos_token_id=run.tokenizer.eos_token_id,
                         pad_token_id=run.tokenizer.eos_token_id, do_sample=True, max_new_tokens=MAX_NEW_TOKENS,
                         **SAMPLING).save_pretrained(out_dir)
    if push_to_hub:  # the whole directory, as written
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(push_to_hub, exist_ok=True)
        api.upload_folder(repo_id=push_to_hub, folder_path=str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flashtrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint directory")
    parser.add_argument("out_dir", help="the transformers model directory to write")
    parser.add_argument("--push-to-hub", metavar="REPO", help="also upload to this Hub repository (online)")
    args = parser.parse_args(argv)
    try:
        out_dir = export(args.run, args.out_dir, args.push_to_hub)
    except DamagedCheckpointError as error:
        raise SystemExit(f"python -m flashtrain.export: {error}") from None
    print(f"wrote {out_dir} (load with transformers' Auto*.from_pretrained({str(out_dir)!r}))")


if __name__ == "__main__":
    main()
