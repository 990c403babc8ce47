"""The tests' one way to build a run config: compose conf/config.yaml with overrides through real Hydra, then turn it
into the typed schemas (as launch.py does), which runs their checks."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flashtrain.train import register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))
