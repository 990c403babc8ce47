"""Every model config with every data config (conf/model/*.yaml x conf/data/*.yaml), composed as launch.py composes
them (conf/config.yaml with the default recipe, register_configs, typed_config), either passes the start-up
model/data check or stops with that check's message naming both configs: a key of one group that reads the other
(`seq_len: ${model.n_positions}`) never stops the composition first. Nothing is prepared, trained or downloaded (the
suite runs offline: a preview that needs a Hugging Face tokenizer which is not cached says so, naming both configs).

Hydra merges each group into its own key, so the composition of `model=M data=D` is M's composition with D's `data`
node; the cross product is built that way from one composition per file (test_pairs_compose_as_hydra_does checks it
against Hydra's own on a sample covering every file), as 180 compositions would take half a minute."""

import copy
import functools

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flashtrain.data.task import check_model_fits_before_preparing
from flashtrain.train import train, typed_config
from hydra_config import CONF, compose_config

MODELS = sorted(path.stem for path in (CONF / "model").glob("*.yaml"))
DATA = sorted(path.stem for path in (CONF / "data").glob("*.yaml"))
# the pairs that pass the check before the data is prepared
DECODERS = ("gpt2-tiny", "gpt2-small", "gpt2-medium", "llama-tiny", "llama-125m", "llama-350m", "hf")
FITS = {(model, data) for model in DECODERS for data in ("stdlib", "python-site")} | {
    ("lra-image", "lra-image"), ("lra-listops", "listops"), ("lra-path64", "pathfinder32"),
    ("lra-path64", "pathfinder64"), ("lra-pathfinder32", "pathfinder32"), ("lra-retrieval", "lra-retrieval"),
    ("lra-text", "lra-text")}
# data whose preview loads a tokenizer from the Hugging Face Hub (its cache, offline)
HUB_TOKENIZER_DATA = {"ecthr", "mimic-top50", "openwebtext", "wikipedia-mlm"}
# the pairs of those that pass the check once the tokenizer loads
FITS_WITH_THE_TOKENIZER = {(model, "openwebtext") for model in DECODERS} | {
    ("bert-large", "wikipedia-mlm"), ("roberta-base", "ecthr"), ("roberta-base", "mimic-top50")}


def test_the_lists_are_the_files():
    assert len(MODELS) >= 12 and len(DATA) >= 15
    assert {m for m, _ in FITS | FITS_WITH_THE_TOKENIZER} <= set(MODELS)
    assert {d for _, d in FITS | FITS_WITH_THE_TOKENIZER} | HUB_TOKENIZER_DATA <= set(DATA)


@functools.cache
def composed_with(group: str, option: str):
    """launch.py's composition with `group=option` (name=x: launch.py takes the name from Hydra's runtime)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=["name=x", f"{group}={option}"])


def composed(model: str, data: str):
    """The composition of `model=MODEL data=DATA`: MODEL's with DATA's `data` node (unresolved: keys that read the
    other group resolve against it in typed_config)."""
    cfg = copy.deepcopy(composed_with("model", model))
    cfg.data = copy.deepcopy(composed_with("data", data).data)
    return cfg


@pytest.mark.slow  # (~11 s of Hydra compositions on 2 cores)
def test_pairs_compose_as_hydra_does():
    n = max(len(MODELS), len(DATA))
    pairs = {(MODELS[i % len(MODELS)], DATA[i % len(DATA)]) for i in range(n)}  # every file once at least
    assert {m for m, _ in pairs} == set(MODELS) and {d for _, d in pairs} == set(DATA)
    for model, data in sorted(pairs):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            hydras = compose("config", overrides=["name=x", f"model={model}", f"data={data}"])
        ours = composed(model, data)
        assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydras), (model, data)
        assert typed_config(ours) == typed_config(hydras), (model, data)


@pytest.mark.parametrize("model", MODELS)
def test_every_data_config_passes_or_stops_naming_both_configs(model):
    for data in DATA:
        cfg = typed_config(composed(model, data))  # composes: no interpolation error
        names = f"model config {type(cfg.model).__name__} "
        try:
            check_model_fits_before_preparing(cfg.model, cfg.data)
        except ValueError as error:
            message = str(error)
            if data in HUB_TOKENIZER_DATA and message.startswith(
                    names + f"cannot be checked against data config {type(cfg.data).__name__}: "):
                assert "the data config cannot say what it provides before it is prepared: tokenizer" in message
                continue
            assert message.startswith(names + f"does not fit data config {type(cfg.data).__name__}: "), (data, message)
            assert (model, data) not in FITS, (data, message)
        else:
            assert (model, data) in FITS | FITS_WITH_THE_TOKENIZER, data


@pytest.mark.parametrize("model, message", [
    ("bert-large", "model config BertConfig does not fit data config LMDataConfig: model.head=masked_lm trains on "
                   "masked_lm data; the data is causal_lm"),
    ("lra-listops", "model config LRAConfig does not fit data config LMDataConfig: the LRA classifier trains on "
                    "classification data (token rows, one label each); the data is causal_lm"),
    ("roberta-base", "model config BertConfig does not fit data config LMDataConfig: model.head=classification trains "
                     "on document_classification data; the data is causal_lm"),
], ids=["bert-large", "lra-listops", "roberta-base"])
def test_a_model_on_the_default_data_stops_with_the_check(model, message):
    """`python launch.py model=bert-large` (or lra-listops): the default recipe's data, stdlib LM text."""
    cfg = compose_config(["name=x", f"model={model}"])
    with pytest.raises(ValueError) as raised:
        check_model_fits_before_preparing(cfg.model, cfg.data)
    assert str(raised.value) == message


def test_the_run_stops_at_start_up_with_the_check(tmp_path):
    """The start of a run (Trainer.setup) says it, before any data is prepared or a model built."""
    cfg = compose_config(["name=x", "logger=none", "model=bert-large", f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ValueError, match="^model config BertConfig does not fit data config LMDataConfig: "
                                         "model.head=masked_lm trains on masked_lm data; the data is causal_lm$"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "cache").exists()


def test_gpt2_tiny_on_data_without_a_vocabulary_size_stops_with_the_check():
    """gpt2-tiny's vocab_size reads data.vocab_size; ListOps has none."""
    cfg = compose_config(["name=x", "data=listops"])
    assert cfg.model.vocab_size == 50257  # the fallback of conf/model/gpt2-tiny.yaml
    with pytest.raises(ValueError, match="^model config GPT2Config does not fit data config ListOpsConfig: GPT-2 "
                                         r"trains on causal_lm data \(next-token prediction\); the data is "
                                         "classification$"):
        check_model_fits_before_preparing(cfg.model, cfg.data)


def test_a_data_key_reading_a_model_key_the_model_lacks_names_both_configs():
    """A data key set to read a model key (here on the command line) that the chosen model config does not have."""
    with pytest.raises(ValueError) as raised:
        compose_config(["name=x", "model=bert-large", "data.seq_len=${model.n_positions}"])
    assert str(raised.value) == (
        "model config BertConfig does not fit data config LMDataConfig: data.seq_len=${model.n_positions} reads "
        "model.n_positions, which BertConfig does not have: set data.seq_len=VALUE, or choose a model config that "
        "has it")


def test_a_plugin_model_reading_a_data_key_the_data_lacks_names_both_configs():
    """tests/conf/model/toy.yaml (a model outside the package) reads data.vocab_size; ListOps has none."""
    import toy_model  # noqa: F401  (registers its schema, as FLASHTRAIN_PLUGINS=toy_model does)

    with pytest.raises(ValueError) as raised:
        compose_config(["name=x", f"hydra.searchpath=[file://{CONF.parent / 'tests' / 'conf'}]", "model=toy",
                        "data=listops"])
    assert str(raised.value) == (
        "model config ToyConfig does not fit data config ListOpsConfig: model.vocab_size=${data.vocab_size} reads "
        "data.vocab_size, which ListOpsConfig does not have: set model.vocab_size=VALUE, or choose a data config "
        "that has it")


def test_a_tokenizer_that_cannot_be_loaded_names_both_configs_and_the_tokenizer(tmp_path):
    missing = tmp_path / "no-tokenizer"
    cfg = compose_config(["name=x", "model=roberta-base", "data=ecthr", f"data.tokenizer={missing}"])
    with pytest.raises(ValueError) as raised:
        check_model_fits_before_preparing(cfg.model, cfg.data)
    assert str(raised.value).startswith(
        "model config BertConfig cannot be checked against data config EcthrConfig: the data config cannot say what "
        f"it provides before it is prepared: tokenizer '{missing}' (data.tokenizer: a checkpoint directory, a Hub "
        "name or pkg:MODULE/SUBDIR) cannot be loaded: ")
