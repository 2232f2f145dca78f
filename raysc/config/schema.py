"""The typed configuration of a raysc run: the top-level ``Config`` that assembles every section, and
``[run]`` (the run's name and directory).

Every key a user can set is declared with ``options.opt`` (its default, the values it allows and a
one-line help text in ``metadata``) in one module per section group: ``model_schema`` (``[model]``),
``parallel_schema`` (``[parallel]``), ``train_schema`` (``[optim]``, ``[schedule]``, ``[train]``),
``data_schema`` (``[data]``), ``checkpoint_schema`` (``[checkpoint]``), ``supervisor_schema``
(``[supervisor]``), ``curate_schema`` (``[curate]``, ``[dedup]``, ``[quality]``), ``serve_schema``
(``[serve]``) and ``track_schema`` (``[track]``); every section class is importable from here too.
``raysc.config.load`` checks TOML files and ``--set`` overrides against these declarations; the key
names are the public contract of raysc, so rename nothing without a migration note in docs/config.md.
The order of ``Config``'s fields is the order of the sections in docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raysc.config.checkpoint_schema import CheckpointConfig
from raysc.config.curate_schema import CurateConfig, DedupConfig, QualityConfig
from raysc.config.data_schema import DataConfig
from raysc.config.model_schema import ModelConfig
from raysc.config.options import opt
from raysc.config.parallel_schema import ParallelConfig
from raysc.config.serve_schema import ServeConfig
from raysc.config.supervisor_schema import SupervisorConfig
from raysc.config.track_schema import TrackConfig
from raysc.config.train_schema import OptimConfig, ScheduleConfig, TrainConfig

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "CurateConfig",
    "DataConfig",
    "DedupConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "QualityConfig",
    "RunConfig",
    "ScheduleConfig",
    "ServeConfig",
    "SupervisorConfig",
    "TrackConfig",
    "TrainConfig",
]


@dataclass
class RunConfig:
    name: str = opt("tiny", "run name; the default run directory is runs/<name>")
    dir: str = opt("", "run directory; empty = runs/<name>")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    curate: CurateConfig = field(default_factory=CurateConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    track: TrackConfig = field(default_factory=TrackConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.run.name}"

    @property
    def checkpoint_uri(self) -> str:
        return self.checkpoint.uri or f"{self.run_dir}/checkpoints"

    @property
    def rope_len(self) -> int:
        return self.model.max_seq_len or self.train.seq_len

    @property
    def curated_uri(self) -> str:
        """Where ``raysc curate`` writes and ``raysc pack`` reads: curate.output, or <run.dir>/curated."""
        return (self.curate.output or f"{self.run_dir}/curated").rstrip("/")

    @property
    def compute_dtype(self) -> str:
        """The precision train.dtype resolves to: 'bf16' (autocast) or 'fp32'; auto = bf16 on cuda only."""
        dtype = self.train.dtype
        return "bf16" if dtype == "bf16" or (dtype == "auto" and self.parallel.device == "cuda") else "fp32"


SECTIONS: tuple[str, ...] = tuple(Config.__dataclass_fields__)
