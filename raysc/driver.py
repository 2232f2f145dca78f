"""The driver side of a run: connect to Ray, start the supervisor, show progress, return the summary.

The driver holds no training state. It resolves relative paths against its own
working directory (actors may run elsewhere), pins the supervisor to its node so
the run directory is where the user looks, and polls the supervisor for a
progress bar.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysc.config.load import config_to_dict
from raysc.config.schema import Config


def absolutize(cfg: Config) -> Config:
    """Turn every relative path in the config into an absolute one (in place)."""
    cwd = Path.cwd()
    cfg.run.dir = str((cwd / cfg.run_dir).resolve())
    if not cfg.checkpoint.uri or "://" not in cfg.checkpoint.uri:
        cfg.checkpoint.uri = str((cwd / cfg.checkpoint_uri).resolve())
    cfg.data.cache_dir = str((cwd / cfg.data.cache_dir).resolve())
    if cfg.data.source != "bundled" and "://" not in cfg.data.source:
        cfg.data.source = str((cwd / cfg.data.source).resolve())
    if cfg.data.tokenizer:
        cfg.data.tokenizer = str((cwd / cfg.data.tokenizer).resolve())
    return cfg


def preflight(cfg: Config) -> None:
    """Checks that need no Ray: inputs exist. Raises FileNotFoundError naming the key."""
    if cfg.data.source != "bundled" and "://" not in cfg.data.source and not Path(cfg.data.source).exists():
        raise FileNotFoundError(f"data.source {cfg.data.source!r} does not exist; use 'bundled', a JSONL file "
                                f"or directory, or a `raysc pack` output directory")
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).is_file():
        raise FileNotFoundError(f"data.tokenizer {cfg.data.tokenizer!r} does not exist; "
                                f"leave it empty to train one on the corpus")


def ensure_ray() -> None:
    if not ray.is_initialized():
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        ray.init(log_to_driver=True, configure_logging=False)


def train(cfg: Config, resume: bool | str = False, progress: bool = True, probe_bytes: int = 0) -> dict:
    """Run a training job to the end and return its summary (raises ``RunFailed`` on failure).
    ``probe_bytes`` > 0 adds the pre-flight probe's measurements (``summary["probe"]``)."""
    from raysc.fleet.supervisor import Supervisor

    cfg = absolutize(cfg)
    if cfg.train.require_preflight:
        from raysc.preflight.run import require_passing

        require_passing(cfg)  # before any worker starts
    ensure_ray()
    node = ray.get_runtime_context().get_node_id()
    sup = Supervisor.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    ).remote(config_to_dict(cfg), resume, probe_bytes)
    done_ref = sup.run.remote()
    bar = None
    progress = progress and sys.stderr.isatty()
    logged = 0
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.steps, desc="starting", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5)
    seen = 0
    try:
        while True:
            ready, _ = ray.wait([done_ref], timeout=1.0)
            prog = ray.get(sup.progress.remote(seen))
            seen += len(prog["events"])
            for ev in prog["events"]:
                _print(bar, format_event(ev))
            if bar is not None:
                _update_bar(bar, prog)
            else:
                logged = _log_line(prog, logged, cfg.train.log_every)
            if ready:
                return ray.get(done_ref)
    except ray.exceptions.RayTaskError as e:
        raise (e.cause if e.cause is not None else e) from None
    finally:
        if bar is not None:
            bar.close()
        ray.kill(sup)


def format_event(ev: dict) -> str:
    fields = ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("time", "kind"))
    return f"[raysc] {ev['kind']}: {fields}"


def _print(bar, line: str) -> None:
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, flush=True)


def _update_bar(bar, prog: dict) -> None:
    last = prog.get("last")
    bar.set_description(prog["phase"])
    if last:
        bar.n = last["step"]
        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                        lr=f"{last['lr']:.2e}", refresh=False)
        bar.refresh()


def _log_line(prog: dict, logged: int, every: int) -> int:
    """Without a terminal: one line every ``every`` steps (and at the last step)."""
    last = prog.get("last")
    if not last or last["step"] == logged:
        return logged
    if last["step"] // every > logged // every or last["step"] == prog["total_steps"]:
        print(f"step {last['step']}/{prog['total_steps']} loss {last['loss']:.4f} "
              f"grad_norm {last['grad_norm']:.3f} lr {last['lr']:.2e} "
              f"tokens/s {last['tokens_per_s']:.0f} mfu {last['mfu']:.1%}", flush=True)
        return last["step"]
    return logged

