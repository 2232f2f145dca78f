"""Rebuild a trained model from a run directory (for export, generation and inspection).

Reads the run's resolved ``config.toml``, finds its newest verified checkpoint
(or the given one) and loads the model tensors in a single process; no Ray and
no process group are needed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from raysc.checkpoint import store
from raysc.config.load import load_config
from raysc.config.schema import Config
from raysc.model.llama import Llama, build_model


@dataclass
class RunModel:
    model: Llama
    cfg: Config
    tokenizer_path: Path
    checkpoint: Path
    step: int


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None) -> RunModel:
    rd = Path(run_dir)
    cfg_path = rd / "config.toml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{rd} is not a raysc run directory (no config.toml); "
                                f"pass the run.dir of a training run")
    cfg = load_config(cfg_path)
    if checkpoint is None:
        ckpt = store.latest_checkpoint(cfg.checkpoint_uri)
        if ckpt is None:
            raise FileNotFoundError(f"run {rd} has no verified checkpoint under {cfg.checkpoint_uri}")
    else:
        ckpt = Path(checkpoint)
        reason = store.verify(ckpt)
        if reason:
            raise ValueError(f"checkpoint {ckpt} is not usable: {reason}")
    model = build_model(cfg.model, cfg.rope_len, cfg.train.seed)
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: intended here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        store.load_shards(ckpt, model, None, rank=0)
    step = int(store.read_manifest(ckpt)["step"])
    return RunModel(model, cfg, rd / "tokenizer.json", ckpt, step)
