"""Start a training run: `python launch.py [recipe=NAME] [group.key=value ...]`.

Composes conf/config.yaml with the chosen recipe (recipes/NAME.yaml) and overrides, checks it against the typed
schemas in flashtrain/train/config.py (`+key=value` included), and hands it to the trainer. Multi-GPU: `accelerate launch launch.py ...`.

Models and data outside the package: FLASHTRAIN_PLUGINS=module[,module...] imports those modules first
(`register_configs`); each registers its config schemas (hydra's ConfigStore, group "model" or "data") and ships its
YAML in a directory named by `hydra.searchpath=[file://DIR]`. tests/toy_model.py is one.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flashtrain.train import register_configs, train, typed_config

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    result = train(typed_config(cfg), run_dir)  # every key checked against its schema first
    if result.exit_code:  # stopped by a signal (128 + its number) or by non-finite steps (1), with a checkpoint
        sys.exit(result.exit_code)


if __name__ == "__main__":
    main()
