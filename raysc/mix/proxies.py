"""Proxy runs for mixture tuning: ordinary ``raysc train`` runs, several at a time on the Ray
cluster, each scored afterwards on every domain's held-out rows.

A proxy is the user's config with ``data.schedule`` set to one mixture, its own run directory
(and checkpoint prefix), ``train.steps``/``train.seed`` of the tuning, no warm spares and one
checkpoint at the end. ``run_all`` drives up to ``concurrency`` of them at once from threads of the
driver: each ``train`` call places its own supervisor and workers as Ray actors, so Ray spreads them
over the cluster's nodes and queues what does not fit. A finished proxy leaves ``result.json``; a
later call with the same config, mixture, seed and steps reuses it (and says so), anything else is
trained afresh (``overwrite``: the proxy directory belongs to the tuning).

The held-out rows are each domain's validation split exactly as training cuts it
(``split_rows`` with ``data.val_fraction``), so no proxy has seen them; a domain's loss is the
mean next-token cross-entropy (nats) over its first ``max_rows`` rows.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from raysc.config.load import load_config
from raysc.config.schema import Config
from raysc.data.packing import split_rows, val_every
from raysc.data.shards import load_domains


@dataclass
class Proxy:
    name: str
    schedule: str
    seed: int
    steps: int


def heldout_rows(cfg: Config, max_rows: int) -> dict[str, torch.Tensor]:
    """Each domain's validation rows (the split training holds out), at most ``max_rows`` each."""
    if cfg.data.val_fraction <= 0:
        raise ValueError(
            "mix tune scores proxies on held-out rows, but data.val_fraction = 0; set "
            "data.val_fraction > 0 (e.g. --set data.val_fraction=0.05)"
        )
    out = {}
    # training holds out every k-th row of a domain, so its first max_rows held-out rows lie in the
    # first k * max_rows rows: only the shards holding those are read
    every = val_every(cfg.data.val_fraction)
    for name, rows in load_domains(
        cfg.data.source, dict(cfg.data.storage_options), every * max_rows, seq_len=cfg.train.seq_len
    ).items():
        val = split_rows(rows, cfg.data.val_fraction)[1][:max_rows]
        if len(val) == 0:
            raise ValueError(
                f"domain {name!r} has no held-out rows ({len(rows)} rows, data.val_fraction="
                f"{cfg.data.val_fraction}); raise data.val_fraction or add data"
            )
        out[name] = torch.from_numpy(val.astype("int64"))
    return out


def domain_losses(run_dir: str | Path, rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean next-token loss (nats) of the run's final checkpoint on each domain's rows."""
    from raysc.export.restore import load_run
    from raysc.quantize.quality import perplexity

    model = load_run(run_dir).model.eval()
    return {name: math.log(perplexity(model, r)) for name, r in sorted(rows.items())}


def proxy_overrides(base: Config, p: Proxy, run_dir: Path) -> list[str]:
    extra = [
        f'run.dir="{run_dir}"',
        f'run.name="{p.name}"',
        f"train.steps={p.steps}",
        f"train.seed={p.seed}",
        f'data.schedule="{p.schedule}"',
        "supervisor.warm_spares=false",
        f"checkpoint.every_steps={p.steps}",
        "train.require_preflight=false",
        "train.log_every=1000000",
    ]
    if base.checkpoint.uri:  # a shared store: each proxy under its own prefix
        extra.append(f'checkpoint.uri="{base.checkpoint.uri.rstrip("/")}/mix-tune/{run_dir.parent.name}/{p.name}"')
    return extra


def _key(config_path: str | None, overrides: list[str], p: Proxy) -> str:
    text = Path(config_path).read_text() if config_path else ""
    blob = json.dumps([text, overrides, p.schedule, p.seed, p.steps])
    return hashlib.sha256(blob.encode()).hexdigest()


def run_one(
    config_path: str | None, overrides: list[str], p: Proxy, out_dir: Path, rows: dict[str, torch.Tensor]
) -> dict:
    from raysc.fleet.driver import train

    run_dir = out_dir / p.name
    result_path = run_dir / "result.json"
    key = _key(config_path, overrides, p)
    if result_path.is_file():
        old = json.loads(result_path.read_text())
        if old.get("key") == key:
            return {**old, "reused": True}
    base = load_config(config_path, overrides)
    cfg = load_config(config_path, [*overrides, *proxy_overrides(base, p, run_dir)])
    t0 = time.perf_counter()
    summary = train(cfg, progress=False, overwrite=True)
    result = {
        "name": p.name,
        "schedule": p.schedule,
        "seed": p.seed,
        "steps": p.steps,
        "key": key,
        "losses": domain_losses(run_dir, rows),
        "final_train_loss": summary.get("final_loss"),
        "tokens": summary.get("tokens"),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    result_path.write_text(json.dumps(result, indent=1))
    return {**result, "reused": False}


def run_all(
    config_path: str | None,
    overrides: list[str],
    proxies: list[Proxy],
    out_dir: Path,
    rows: dict[str, torch.Tensor],
    concurrency: int,
    target: str,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Every proxy's result, in the order given; a proxy that fails is ``{"name", "error"}``."""
    results: dict[str, dict] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(p: Proxy) -> dict:
        try:
            return run_one(config_path, overrides, p, out_dir, rows)
        except Exception as e:  # noqa: BLE001 - one failed proxy is reported, the others go on
            return {"name": p.name, "schedule": p.schedule, "error": f"{type(e).__name__}: {e}"}

    pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="mix-proxy")
    try:
        futures = {pool.submit(one, p): p for p in proxies}
        for fut in as_completed(futures):
            r = fut.result()
            with lock:
                results[r["name"]] = r
                done, elapsed = len(results), time.perf_counter() - t0
            left = elapsed / done * (len(proxies) - done)
            what = (
                f"error: {r['error']}"
                if "error" in r
                else f"{target} loss {r['losses'][target]:.4f}" + (" (reused)" if r["reused"] else "")
            )
            log(f"mix: {done}/{len(proxies)} {r['name']} [{r['schedule']}] {what}; {elapsed:.0f} s, ~{left:.0f} s left")
    except BaseException:  # Ctrl-C: queued runs never start; the ones in flight finish (their results stay)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return [results[p.name] for p in proxies]
