"""Paths in a config: which values are URLs, and making the local ones absolute.

A run's actors may start in another working directory (or on another node), so the driver
resolves every relative path against its own before it hands the config on; a URL
(``s3://...``, ``file://...``) is left as written.
"""

from __future__ import annotations

from pathlib import Path

from raysc.config.schema import Config


def is_url(path: str) -> bool:
    """True for an fsspec URL with a protocol (``s3://bucket/x``), False for a plain path."""
    return "://" in path


def absolutize(cfg: Config) -> Config:
    """Turn every relative path in the config into an absolute one (in place)."""
    cwd = Path.cwd()
    cfg.run.dir = str((cwd / cfg.run_dir).resolve())
    if not cfg.checkpoint.uri or not is_url(cfg.checkpoint.uri):
        cfg.checkpoint.uri = str((cwd / cfg.checkpoint_uri).resolve())
    cfg.data.cache_dir = str((cwd / cfg.data.cache_dir).resolve())
    if cfg.data.source != "bundled" and not is_url(cfg.data.source):
        cfg.data.source = str((cwd / cfg.data.source).resolve())
    if cfg.data.tokenizer:
        cfg.data.tokenizer = str((cwd / cfg.data.tokenizer).resolve())
    if cfg.model.init_from and not is_url(cfg.model.init_from):
        cfg.model.init_from = str((cwd / cfg.model.init_from).resolve())
    return cfg
