"""Prepare a run's data as its own step: `python -m flashtrain.data.prepare [recipe=NAME] [group.key=value ...]`.

Takes the same configuration as launch.py (conf/config.yaml, the recipe, the overrides; only `data` and what it
interpolates matter) and builds the data config's task: the corpus is read, a tokenizer trained when the config asks
for one, every split tokenized and cached under data.cache_dir. A training run of the same configuration then finds it
all in the cache and only opens it (the token files are memory-mapped). Run it once before a launch of several
processes (on every machine, unless data.cache_dir is on a filesystem they share): a run that finds the cache missing
prepares it on rank 0 while the other processes wait (trainer.prepare_timeout_minutes).
"""

import logging
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from flashtrain.train.config import register_configs, typed_config

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

register_configs()  # and the FLASHTRAIN_PLUGINS modules' schemas


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    data_cfg = typed_config(cfg).data  # every key checked against its schema, as launch.py does
    start = time.perf_counter()
    task = data_cfg.build()
    print(f"data ready ({time.perf_counter() - start:.1f} s): {type(data_cfg).__name__}, {task.spec}")


if __name__ == "__main__":
    # no run directory: this step writes only the data cache
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
