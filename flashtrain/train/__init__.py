"""Training glue: typed configs, the Accelerate training loop, checkpoints, metrics."""

from flashtrain.train.config import FlashtrainConfig, register_configs, typed_config
from flashtrain.train.trainer import TrainResult, train

__all__ = ["FlashtrainConfig", "TrainResult", "register_configs", "train", "typed_config"]
