"""Summaries of a run from its records (``raysc status RUN_DIR``), running or finished.

Goodput = time spent in optimizer steps that count toward the final model / wall time. A step
counts when its last occurrence in ``metrics.jsonl`` is the one kept (steps re-run after a restart
or a resume replace earlier attempts, whose time was lost) and its update was not skipped. Wall time
is the time the run was running: from each ``run_start`` (the first command, each ``--resume``) to
that session's last record; the hours between a stopped run and its resume are not the run's.
"""

from __future__ import annotations

from pathlib import Path

from raysc.fleet.events import EventKind
from raysc.fleet.records import read_jsonl, read_serving


def goodput(metrics: list[dict], wall_s: float) -> float | None:
    if wall_s <= 0 or not metrics:
        return None
    kept: dict[int, dict] = {}
    for m in metrics:
        kept[m["step"]] = m
    useful = sum(m.get("step_time", 0.0) for m in kept.values() if not m.get("skipped"))
    return min(1.0, useful / wall_s)


def running_s(events: list[dict], metrics: list[dict]) -> float:
    """Seconds the run was running: the sum, over its sessions (each begun by a ``run_start``
    event), of the time from that start to the session's last event or metrics record."""
    starts = [e["time"] for e in events if e["kind"] == EventKind.RUN_START] or [events[0]["time"]]
    times = sorted([e["time"] for e in events] + [m["time"] for m in metrics if "time" in m])
    total = 0.0
    for i, t0 in enumerate(starts):
        t_next = starts[i + 1] if i + 1 < len(starts) else float("inf")
        inside = [t for t in times if t0 <= t < t_next]
        total += (max(inside) - t0) if inside else 0.0
    return total


def tracker_states(events: list[dict]) -> dict[str, dict]:
    """Each [track] tracker's run id and state (ok, degraded since a time with its error, or
    undelivered at the run's end), from the run's events."""
    out: dict[str, dict] = {}
    for e in events:
        kind, name = e["kind"], e.get("tracker")
        if kind == EventKind.TRACKING:
            out[name] = {"run_id": e["run_id"], "state": "ok"}
        elif kind == EventKind.TRACKER_DEGRADED:
            out.setdefault(name, {}).update(state="degraded", since=e["time"], error=e.get("error"))
        elif kind == EventKind.TRACKER_RECOVERED:
            out.setdefault(name, {}).update(state="ok", recovered_after_s=e.get("down_s"))
            out[name].pop("since", None)
        elif kind == EventKind.TRACKER_UNDELIVERED:
            out.setdefault(name, {}).update(state="undelivered", pending=e.get("pending"), error=e.get("error"))
    return out


def resizes(events: list[dict]) -> list[str]:
    """An elastic run's size changes, oldest first (``dp_replicate 2->1 at ... (why)``)."""
    return [
        f"{e['dim']} {e['from']}->{e['to']} ({e['why']}; {e['seconds']:g}s, {e['steps_lost']} steps lost)"
        for e in events
        if e["kind"] == EventKind.RESIZED
    ]


def run_status(run_dir: str | Path) -> dict:
    rd = Path(run_dir)
    if not (rd / "events.jsonl").is_file():
        raise FileNotFoundError(f"{rd} has no events.jsonl: not a raysc run directory")
    events = read_jsonl(rd / "events.jsonl")
    metrics = read_jsonl(rd / "metrics.jsonl")
    last_event = events[-1]
    state = {EventKind.RUN_END: "finished", EventKind.RUN_FAILED: "failed", EventKind.RUN_STOPPED: "stopped"}.get(
        last_event["kind"], "running"
    )
    wall = running_s(events, metrics)
    last = metrics[-1] if metrics else {}
    total = None
    if (rd / "config.toml").is_file():
        from raysc.config.load import load_config

        total = load_config(rd / "config.toml").train.steps
    saved = [e for e in events if e["kind"] == EventKind.CHECKPOINT_SAVED]
    return {
        "run_dir": str(rd),
        "state": state,
        "step": last.get("step"),
        "total_steps": total,
        "loss": last.get("loss"),
        "grad_norm": last.get("grad_norm"),
        "tokens_per_s": last.get("tokens_per_s"),
        "mfu": last.get("mfu"),
        "tokens": last.get("tokens"),
        "dp": last.get("dp"),
        "resizes": resizes(events),
        "restarts": sum(1 for e in events if e["kind"] == EventKind.RECOVERED),
        "peer_heals": sum(1 for e in events if e["kind"] == EventKind.RECOVERED and e.get("healed_by") == "peer"),
        "skipped_updates": sum(1 for e in events if e["kind"] == EventKind.UPDATE_SKIPPED),
        "failed_saves": sum(1 for e in events if e["kind"] == EventKind.CHECKPOINT_SAVE_FAILED),
        "last_checkpoint": saved[-1]["step"] if saved else None,
        "wall_s": round(wall, 2),
        "goodput": goodput(metrics, wall),
        "sessions": max(1, sum(1 for e in events if e["kind"] == EventKind.RUN_START)),
        "last_events": [f"{e['kind']}" + (f" step={e['step']}" if "step" in e else "") for e in events[-5:]],
        "serving": read_serving(rd),
        "trackers": tracker_states(events),
    }
