"""Start a training run: `python launch.py [recipe=NAME] [group.key=value ...]`.

Composes conf/config.yaml with the chosen recipe (recipes/NAME.yaml) and overrides, checks it against the typed
schemas in flashtrain/train/config.py, and hands it to the trainer. Multi-GPU: `accelerate launch launch.py ...`.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from flashtrain.train import register_configs, train

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    train(OmegaConf.to_object(cfg), run_dir)


if __name__ == "__main__":
    main()
