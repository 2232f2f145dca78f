"""The driver side of a run: connect to Ray, start the supervisor, show progress, return the summary.

The driver holds no training state. It resolves relative paths against its own
working directory (actors may run elsewhere), refuses to start without a passing
pre-flight report when ``train.require_preflight`` is set (``raysc.fleet.preflight_gate``),
pins the supervisor to its node so the run directory is where the user looks, and
polls the supervisor for a progress bar.

While a run is in progress it owns SIGINT and SIGTERM (Ctrl-C, `ray job stop`,
schedulers): the first asks the supervisor to stop at a step boundary, save and
shut the fleet down (``RunStopped`` is raised when it has); a second one, or
``train.stop_timeout_s`` passing, aborts at once by killing the supervisor (its
workers die with it, its placement groups are removed here: ``raysc.fleet.groups``; an uncommitted save
stays invisible).
SIGUSR1 and ``raysc ckpt now RUN_DIR`` ask for a checkpoint at the next step
boundary. The previous handlers are restored when ``train`` returns.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysc.checkpoint.signing import Signer
from raysc.checkpoint.storage import step_name
from raysc.checkpoint.store import CheckpointStore
from raysc.cluster.connect import init_ray
from raysc.cluster.fit import require_fleet_fit
from raysc.config.checks import check_track
from raysc.config.load import config_to_dict
from raysc.config.paths import absolutize, is_url
from raysc.config.schema import Config
from raysc.data import megatron
from raysc.fleet.elastic import min_world
from raysc.fleet.errors import RunFailed, RunStopped
from raysc.fleet.events import EventKind
from raysc.fleet.groups import remove_groups_of
from raysc.fleet.preflight_gate import require_passing
from raysc.fleet.records import JsonlWriter
from raysc.fleet.stopping import take_request


def check_inputs(cfg: Config) -> None:
    """Checks that need no Ray: inputs exist, a local ``model.init_from`` fits the model config, the
    tokenizer (``data.tokenizer`` or the checkpoint's) fits the embedding, has an end-of-text token and is
    the one a packed ``data.source`` was packed with.
    Raises FileNotFoundError naming the key, or a ValueError (``CheckpointMismatch`` lists the differences;
    ``ConfigError`` for a [track] tracker whose package is not installed)."""
    check_track(cfg, "config")
    if (
        cfg.data.source != "bundled"
        and not is_url(cfg.data.source)
        and not Path(cfg.data.source).exists()
        and megatron.prefix_of(cfg.data.source) is None
    ):
        raise FileNotFoundError(
            f"data.source {cfg.data.source!r} does not exist; use 'bundled', a JSONL file "
            f"or directory, a `raysc pack` output directory, a Megatron dataset prefix "
            f"(PREFIX.bin + PREFIX.idx) or .npy token files"
        )
    if cfg.data.tokenizer and not Path(cfg.data.tokenizer).is_file():
        raise FileNotFoundError(
            f"data.tokenizer {cfg.data.tokenizer!r} does not exist; leave it empty to train one on the corpus"
        )
    tokenizer, whose = cfg.data.tokenizer, "data.tokenizer"
    if cfg.model.init_from and not is_url(cfg.model.init_from):
        from raysc.model.hf_checkpoint import check_init_from

        info = check_init_from(cfg.model.init_from, cfg.model)  # headers only: a mismatch stops here, before Ray
        if not tokenizer and info["tokenizer"]:
            tokenizer, whose = info["tokenizer"], "model.init_from's"
    if tokenizer:
        from raysc.data.prepare import check_packed_source, check_tokenizer

        check_tokenizer(cfg, tokenizer)  # fits the embedding, has an end-of-text token: before Ray
        check_packed_source(cfg, tokenizer, whose)  # a packed data.source used this same tokenizer


def ensure_ray() -> None:
    """Join ``RAY_ADDRESS`` (a wrong address fails within seconds: ``raysc.cluster.connect``) or
    start a local Ray, unless this process already has one."""
    init_ray(log_to_driver=True, configure_logging=False)


def train(
    cfg: Config, resume: bool | str = False, progress: bool = True, probe_bytes: int = 0, overwrite: bool = False
) -> dict:
    """Run a training job to the end and return its summary (raises ``RunFailed`` on failure and
    ``RunStopped`` after SIGINT / SIGTERM). ``probe_bytes`` > 0 adds the pre-flight probe's
    measurements (``summary["probe"]``)."""
    cfg = absolutize(cfg)
    check_track(cfg, "config")  # (also in check_inputs) for a job's own train() call: before Ray
    # the key from RAYSC_CHECKPOINT_KEY travels to the actors inside the config (within the cluster's
    # trust boundary); every file written to disk shows it as '***'. A short key is refused here.
    cfg.checkpoint.signing_key = Signer.resolve(cfg.checkpoint.signing_key).key
    if cfg.train.require_preflight:
        require_passing(cfg)  # before any worker starts
    ensure_ray()
    # one rule for every command that trains (train, preflight's probe, parity): a fleet this Ray can never
    # hold stops here, before data or workers, instead of waiting out supervisor.start_timeout_s; that it
    # waits for nodes is said on stderr even without progress lines (a run that sits idle says why)
    require_fleet_fit(
        "the run",
        cfg.parallel,
        min_world(cfg),  # an elastic run starts with what fits
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    with StopSignals() as signals:
        return _follow(cfg, resume, progress, probe_bytes, overwrite, signals)


class _Abort(Exception):
    """Cut a graceful stop short (after a second stop signal, or when the grace period ends)."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


class StopSignals:
    """The driver's SIGINT / SIGTERM / SIGUSR1 handlers while ``train`` runs (Python allows them only
    in the main thread; elsewhere nothing is installed). The handlers only record what arrived, for
    the driver's loop to act on within a second (an exception raised from a handler would surface
    inside Ray's C++ calls as a SystemError)."""

    def __init__(self) -> None:
        self.stop: str | None = None  # the first stop signal's name
        self.abort: str | None = None  # a second stop signal's name
        self.checkpoints = 0  # SIGUSR1s not yet passed on
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():  # None: a handler not set from Python (Ray's)
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:
            self.checkpoints += 1
        elif self.stop is None:
            self.stop = name
        else:
            self.abort = name


def _follow(
    cfg: Config, resume: bool | str, progress: bool, probe_bytes: int, overwrite: bool, signals: StopSignals
) -> dict:
    """Start the supervisor, relay progress, signals and checkpoint requests until it returns."""
    from raysc.fleet.supervisor import Supervisor

    node = ray.get_runtime_context().get_node_id()
    bar = None
    progress = progress and sys.stderr.isatty()
    logged = 0
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=cfg.train.steps, desc="starting", unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5
        )
    seen, step, stop_sent, sup = 0, None, None, None
    try:
        sup = Supervisor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            config_to_dict(cfg), resume, probe_bytes, overwrite
        )
        done_ref = sup.run.remote()
        while True:
            ready, _ = ray.wait([done_ref], timeout=1.0)
            if signals.abort and not ready:
                raise _Abort(signals.stop, f"a second {signals.abort} during the graceful stop")
            if signals.stop and stop_sent is None:
                sup.request_stop.remote(signals.stop)
                stop_sent = time.monotonic()
                _print(
                    bar,
                    f"[raysc] {signals.stop}: stopping at the next step boundary"
                    f"{' and saving a checkpoint' if cfg.train.save_on_stop else ''} "
                    f"(at most train.stop_timeout_s={cfg.train.stop_timeout_s:g}s); "
                    f"press Ctrl-C again to abort",
                )
            if stop_sent is not None and not ready and time.monotonic() - stop_sent > cfg.train.stop_timeout_s:
                raise _Abort(
                    signals.stop,
                    f"the graceful stop took longer than train.stop_timeout_s={cfg.train.stop_timeout_s:g}s",
                )
            while signals.checkpoints:
                signals.checkpoints -= 1
                sup.request_checkpoint.remote("SIGUSR1")
            if take_request(cfg.run_dir):
                sup.request_checkpoint.remote("raysc ckpt now")
            prog = ray.get(sup.progress.remote(seen))
            seen += len(prog["events"])
            step = prog["last"]["step"] if prog.get("last") else step
            for ev in prog["events"]:
                _print(bar, format_event(ev))
            if bar is not None:
                _update_bar(bar, prog)
            else:
                logged = _log_line(prog, logged, cfg.train.log_every)
            if ready:
                summary = ray.get(done_ref)
                if summary.get("stopped"):
                    raise RunStopped(summary["stopped"], summary["step"], summary["checkpoint"], summary=summary)
                return summary
    except ray.exceptions.RayTaskError as e:
        raise _remote_cause(e) from None
    except _Abort as e:
        if sup is not None:  # before the record: the supervisor writes no event after it
            _kill_supervisor(sup)
            sup = None  # the `finally` has nothing left to stop
        raise _aborted(cfg, e, step) from None
    finally:
        if bar is not None:
            bar.close()
        if sup is not None:
            _kill_supervisor(sup)


def _kill_supervisor(sup) -> None:
    """Kill the supervisor (its workers and spares die with it) and remove the placement groups it left
    standing: Ray keeps those until this driver's job ends (``raysc.fleet.groups``)."""
    ray.kill(sup)
    left = remove_groups_of(sup._actor_id.hex())
    if left:
        print(f"[raysc] the supervisor was stopped holding placement group(s) {left}; removed", flush=True)


def _remote_cause(e: ray.exceptions.RayTaskError) -> BaseException:
    """What the supervisor raised: a ``RunFailed`` says all there is to say; anything else is a defect,
    shown with the supervisor's own traceback (the driver's frames alone name no line of ours)."""
    cause = e.cause
    if cause is None:
        return e
    if not isinstance(cause, RunFailed):
        cause.add_note(str(e).rstrip())  # Ray's account: the actor, its pid and node, its traceback
    return cause


def _aborted(cfg: Config, abort: _Abort, step: int | None) -> RunStopped:
    """Record an aborted stop in the run's events (the supervisor is gone) and describe it."""
    try:
        latest = CheckpointStore.for_config(cfg).latest()
    except Exception:  # the store is unreachable: say so rather than fail the report
        latest = None
    checkpoint = f"{cfg.checkpoint_uri}/{step_name(latest)}" if latest is not None else None
    events = JsonlWriter(Path(cfg.run_dir) / "events.jsonl")
    events.write(
        {
            "time": time.time(),
            "kind": EventKind.RUN_STOPPED.value,
            "reason": abort.reason,
            "aborted": True,
            "why": str(abort),
            "step": step,
            "checkpoint_step": latest,
            "checkpoint": checkpoint,
            "note": "the supervisor was killed; a save in flight stays uncommitted (no manifest)",
        }
    )
    events.close()
    print(
        f"[raysc] run_stopped: aborted ({abort}); newest committed checkpoint: {checkpoint or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    return RunStopped(abort.reason, step, checkpoint, aborted=True)


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
        bar.set_postfix(
            loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}", lr=f"{last['lr']:.2e}", refresh=False
        )
        bar.refresh()


def _log_line(prog: dict, logged: int, every: int) -> int:
    """Without a terminal: one line every ``every`` steps (and at the last step)."""
    last = prog.get("last")
    if not last or last["step"] == logged:
        return logged
    if last["step"] // every > logged // every or last["step"] == prog["total_steps"]:
        print(
            f"step {last['step']}/{prog['total_steps']} loss {last['loss']:.4f} "
            f"grad_norm {last['grad_norm']:.3f} lr {last['lr']:.2e} "
            f"tokens/s {last['tokens_per_s']:.0f} mfu {last['mfu']:.1%}",
            flush=True,
        )
        return last["step"]
    return logged
