"""Run configuration, the bottom layer: typed sections (schema), the TOML loader with overrides (load),
the cross-key checks (checks) and the value syntaxes they parse (syntax, faults); it imports nothing
else of raysc."""

from raysc.config.checks import ConfigError, validate
from raysc.config.load import config_from_dict, config_hash, config_to_dict, dump_config, load_config
from raysc.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    ScheduleConfig,
    SupervisorConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "ScheduleConfig",
    "SupervisorConfig",
    "TrainConfig",
    "config_from_dict",
    "config_hash",
    "config_to_dict",
    "dump_config",
    "load_config",
    "validate",
]
