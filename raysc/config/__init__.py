"""Run configuration: typed sections (schema) and the TOML loader with overrides (load)."""

from raysc.config.load import (
    ConfigError,
    config_from_dict,
    config_hash,
    config_to_dict,
    dump_config,
    load_config,
    validate,
)
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
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig",
    "ParallelConfig", "RunConfig", "ScheduleConfig", "SupervisorConfig", "TrainConfig",
    "config_from_dict", "config_hash", "config_to_dict", "dump_config", "load_config", "validate",
]
