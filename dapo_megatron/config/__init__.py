"""Typed run configuration: one dataclass per component, loaded strictly from YAML.

Every setting of a run lives in :mod:`~dapo_megatron.config.sections`, with its type, its
default and a docstring, so that a misspelt key or a value of the wrong type is refused
before any process starts instead of being ignored or discovered an hour into a job.

- :mod:`~dapo_megatron.config.sections`: the sections and the facts derived from them;
- :mod:`~dapo_megatron.config.model`: the model section, filled from the HF ``config.json``;
- :mod:`~dapo_megatron.config.layout`: the parallel layout's arithmetic;
- :mod:`~dapo_megatron.config.loading`: YAML, overrides and paths;
- :mod:`~dapo_megatron.config.validate`: the rules that span keys;
- :mod:`~dapo_megatron.config.io`: the typed-YAML machinery and :class:`ConfigError`.

This front door exports what the rest of the package reads. Nothing here imports torch.
"""

from dapo_megatron.config.io import ConfigError
from dapo_megatron.config.loading import PATH_KEYS, config_from_dict, load_config, source_of
from dapo_megatron.config.model import (
    ModelConfig,
    engine_routing,
    moe_layers,
    padded_vocab_size,
    read_hf_model_shape,
    resolve_model_shape,
)
from dapo_megatron.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    RayConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "PATH_KEYS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RayConfig",
    "RolloutConfig",
    "TrainerConfig",
    "config_from_dict",
    "engine_routing",
    "load_config",
    "moe_layers",
    "padded_vocab_size",
    "read_hf_model_shape",
    "resolve_model_shape",
    "source_of",
]
