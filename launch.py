"""Start a training run: `python launch.py [recipe=NAME] [group.key=value ...]`.

Composes conf/config.yaml with the chosen recipe (recipes/NAME.yaml) and overrides, checks it against the typed
schemas in flashtrain/train/config.py (`+key=value` included), and hands it to the trainer. Several processes:
`accelerate launch [--cpu] --num_processes N launch.py ...`, `accelerate launch --config_file conf/accelerate/NAME.yaml
launch.py ...` or `torchrun --nproc_per_node N launch.py ...` (flashtrain/train/processes.py; README, "Several
processes").

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
from flashtrain.train.processes import hydra_overrides_for_other_ranks, relaunch_cpu_processes

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    result = train(typed_config(cfg), run_dir)  # every key checked against its schema first
    if result.exit_code:  # stopped by a signal (128 + its number) or by non-finite steps (1), with a checkpoint
        sys.exit(result.exit_code)


if __name__ == "__main__":
    # accelerate launch --cpu --num_processes N started only this process: it starts the N and waits for them
    exit_code = relaunch_cpu_processes()
    if exit_code is not None:
        sys.exit(exit_code)
    sys.argv += hydra_overrides_for_other_ranks()  # rank 0 alone writes the run directory
    main()
