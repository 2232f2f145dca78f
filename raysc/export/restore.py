"""Rebuild a trained model from a run directory (export, generation, parity), and sample text
from it.

Reads the run's resolved ``config.toml``, finds its newest committed checkpoint
(or the given step) among those its run wrote (``run.json``: never another run's
that happens to share the store), fetches it into a local cache verifying every file's
SHA-256 (and the manifest's signature when the run signs its checkpoints), and
loads the model tensors in one process; no Ray and no process
group are needed, and DCP reshards whatever layout wrote it.

It sits in export, above both ``checkpoint`` (which stores tensors and knows no model) and
``model``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from raysc.checkpoint.signing import Signer
from raysc.checkpoint.staging import load_local
from raysc.checkpoint.storage import step_name
from raysc.checkpoint.store import CheckpointStore, local_copy_dir, read_run_id
from raysc.config.load import load_config
from raysc.config.schema import Config
from raysc.config.secrets import REDACTED
from raysc.data.special_tokens import SpecialTokens, special_tokens_beside
from raysc.data.tokenizer import load_tokenizer
from raysc.model.generate import generate
from raysc.model.llama import Llama, build_model


@dataclass
class RunModel:
    model: Llama
    cfg: Config
    tokenizer_path: Path
    checkpoint: str
    step: int

    @property
    def special(self) -> SpecialTokens:
        """The special tokens the run packed with (its EOS ends generation)."""
        return special_tokens_beside(self.tokenizer_path)


def run_config(run_dir: str | Path) -> Config:
    """The resolved config a run wrote into its directory."""
    cfg_path = Path(run_dir) / "config.toml"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} is not a raysc run directory (no config.toml); pass the run.dir of a training run"
        )
    return load_config(cfg_path)


def _store_of(cfg: Config) -> CheckpointStore:
    # config.toml has secrets redacted: drop them so the environment's credentials apply
    options = {k: v for k, v in cfg.checkpoint.storage_options.items() if v != REDACTED}
    signer = Signer.resolve(cfg.checkpoint.signing_key)  # a signed run's key must be in the environment
    return CheckpointStore(cfg.checkpoint_uri, options, cfg.checkpoint.transfer_concurrency, signer)


def _owners(store: CheckpointStore) -> dict[int, str | None]:
    return {s: (store.read_manifest(s) or {}).get("run_id") for s in store.steps()}


def _mine(owners: dict[int, str | None], run_id: str | None) -> list[int]:
    return [s for s, o in owners.items() if run_id is None or o in (None, run_id)]


def newest_verified(store: CheckpointStore, steps: list[int]) -> int | None:
    """The newest of ``steps`` (oldest first) whose checkpoint verifies; None if none does."""
    return next((s for s in reversed(steps) if store.verify(s) is None), None)


def run_store(run_dir: str | Path) -> tuple[CheckpointStore, list[int]]:
    """The checkpoint store of the run in ``run_dir`` and the committed steps that run wrote (oldest
    first; another run's steps sharing the store are left out)."""
    store = _store_of(run_config(run_dir))
    return store, _mine(_owners(store), read_run_id(run_dir))


def load_run(run_dir: str | Path, step: int | None = None) -> RunModel:
    rd = Path(run_dir)
    cfg = run_config(rd)
    store = _store_of(cfg)
    owners = _owners(store)
    run_id = read_run_id(rd)
    mine = _mine(owners, run_id)
    if step is None:
        step = newest_verified(store, mine)
        if step is None:
            others = sorted(s for s in owners if s not in mine)
            raise FileNotFoundError(
                f"run {rd} has no committed checkpoint under {cfg.checkpoint_uri}"
                + (f" (steps {others} there belong to another run)" if others else "")
            )
    elif step in owners and step not in mine:
        raise ValueError(
            f"checkpoint step {step} under {cfg.checkpoint_uri} was written by run "
            f"{owners[step]}, not by the run in {rd} ({run_id}); refusing to mix runs"
        )
    local = local_copy_dir(cfg.data.cache_dir, cfg.checkpoint_uri, step)
    store.fetch(step, local)
    model = build_model(cfg.model, cfg.rope_len, cfg.train.seed)
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: intended here
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        load_local(local, model, None, rank=0, step=step)
    return RunModel(model, cfg, rd / "tokenizer.json", f"{cfg.checkpoint_uri}/{step_name(step)}", step)


def sample_text(
    run_dir: str | Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    """``prompt`` and its continuation by the newest checkpoint of the run in ``run_dir``
    (``raysc generate``, the demo's samples)."""
    run = load_run(run_dir)
    tok = load_tokenizer(run.tokenizer_path)
    ids = generate(
        run.model,
        run.special.begin(tok.encode(prompt, add_special_tokens=False).ids),
        max_new_tokens,
        temperature,
        top_k,
        seed,
        run.special.stops,
    )
    return prompt + tok.decode(ids)
