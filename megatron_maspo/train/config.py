"""The trainer's config sections, re-exported: they live in ``megatron_maspo/train_config.py`` (below
``train/``, so the root ``config.py`` does not import the trainer)."""

from megatron_maspo.train_config import CHECKPOINT_SUBDIR as CHECKPOINT_SUBDIR
from megatron_maspo.train_config import CheckpointConfig as CheckpointConfig
from megatron_maspo.train_config import LoggingConfig as LoggingConfig
from megatron_maspo.train_config import OptimConfig as OptimConfig
from megatron_maspo.train_config import TrainConfig as TrainConfig
