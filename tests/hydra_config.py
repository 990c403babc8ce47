"""The tests' one way to build a run config: compose conf/config.yaml with overrides through real Hydra, then turn it
into the typed schemas (as launch.py does: every key checked, `+key=value` included), which runs their checks."""

from pathlib import Path

from hydra import compose, initialize_config_dir

from flashtrain.train import register_configs, typed_config

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return typed_config(compose("config", overrides=overrides))
