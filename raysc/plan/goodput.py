"""Expected goodput of a run under device failures: whole-job restarts from a checkpoint against peer
healing (issue 60), at the user's size and at 1k / 16k / 100k devices.

Goodput is the share of wall-clock time that becomes kept training progress (Google's runtime
goodput: productive step time over wall time; start-up and scheduling are left out). Notation: ``N``
devices, ``rate`` failures per 1,000 device-days, ``Λ = N · rate / (1000 · 86400)`` failures per
second, ``C`` the part of a checkpoint save that stalls training, ``T`` the checkpoint interval, ``R``
the whole-job restart (every rank replaced, the newest checkpoint restored, to the next completed
step), ``s`` the stall every survivor takes in a peer heal and ``t`` the step time. A first-order
renewal model (Young / Daly):

- whole-job restart: every failure stops every device for ``R`` and loses ``T/2`` of work on average,
  ``G = (1 − C/T) / (1 + Λ (R + T/2))``, best at Young's ``T = max(√(2C/Λ), t)``;
- peer healing: nothing is rolled back; every survivor loses ``s`` and the interrupted step (``t/2`` on
  average); the share ``uncovered`` of failures that no peer covers (a whole replica group lost at
  once, a heal that fails) is healed by the whole-job restart,
  ``G = (1 − C/T) / (1 + Λ ((1 − u)(s + t/2) + u (R + T/2)))``, with checkpoints only for those: Young's
  interval at their rate ``Λu`` (or the run's own interval when given).

The model leaves out what it cannot know: the per-step cost of being ready to heal, failures that
strike during a recovery, and correlated failures. The research behind the defaults
(``FAILURE_RATES``) and the model's calibration against published runs: docs/resilience.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from raysc.fleet.records import read_jsonl
from raysc.fleet.status import goodput as kept_share

DAY_S = 86_400.0
FAILURE_RATES = {  # failures per 1,000 device-days, and where the figure comes from
    "llama3": (
        0.47,
        "Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 H100 (arXiv 2407.21783, §3.3.4)",
    ),
    "rsc1": (0.81, "Meta RSC-1, 16k A100, 11 months: 6.50 failures per 1,000 node-days of 8 GPUs (arXiv 2410.21680)"),
    "rsc2": (0.29, "Meta RSC-2, 8k A100, 11 months: 2.34 failures per 1,000 node-days of 8 GPUs (arXiv 2410.21680)"),
}
SIZES = (1_024, 16_384, 100_000)
UNCOVERED = 0.01  # share of failures no peer covers, assumed (no published figure)
UNCOVERED_SOURCE = "assumed: 1 % (a whole replica group lost at once, or a heal that fails)"


@dataclass(frozen=True)
class Recovery:
    """What one failure costs: ``save_stall_s`` (C), ``restart_s`` (R), ``peer_heal_s`` (s), ``step_s`` (t),
    ``interval_s`` (T, the run's own checkpoint interval; None: Young's best) and where each came from."""

    save_stall_s: float
    restart_s: float
    peer_heal_s: float
    step_s: float
    interval_s: float | None = None
    uncovered: float = 0.0
    sources: tuple[tuple[str, str], ...] = ()


def failures_per_s(devices: int, rate_per_1000_days: float) -> float:
    return devices * rate_per_1000_days / 1000.0 / DAY_S


def best_interval(stall_s: float, lam: float, step_s: float) -> float:
    """Young's checkpoint interval ``√(2C/Λ)``, at least one step."""
    if lam <= 0:
        return math.inf
    return max(math.sqrt(2 * max(stall_s, 0.0) / lam), step_s)


def whole_job(lam: float, stall_s: float, interval_s: float, restart_s: float) -> float:
    """Goodput with every failure healed by a whole-job restart from the newest checkpoint."""
    if math.isinf(interval_s):
        return 1.0
    return max(0.0, (1 - stall_s / interval_s) / (1 + lam * (restart_s + interval_s / 2)))


def whole_job_per_kept_second(lam_kept: float, stall_s: float, interval_s: float, restart_s: float) -> float:
    """``whole_job`` with ``lam_kept`` failures per second of kept work (what a drill counts): the costs add up
    per kept second, C/T of saves and Λ(R + T/2) of failures, so G = 1 / (1 + C/T + Λ(R + T/2)).
    ``whole_job`` is its first-order form, with Λ per second of the job."""
    return 1 / (1 + stall_s / interval_s + lam_kept * (restart_s + interval_s / 2))


def peer_healed(lam: float, rec: Recovery, interval_s: float) -> float:
    """Goodput with failures healed from a peer (``uncovered`` of them by a whole-job restart instead)."""
    u = rec.uncovered
    if math.isinf(interval_s):  # no checkpoint needed for failures (u = 0)
        return 1 / (1 + lam * (rec.peer_heal_s + rec.step_s / 2))
    lost = (1 - u) * (rec.peer_heal_s + rec.step_s / 2) + u * (rec.restart_s + interval_s / 2)
    return max(0.0, (1 - rec.save_stall_s / interval_s) / (1 + lam * lost))


def table(devices: int, rate: float, rec: Recovery) -> list[dict]:
    """A row per size (the user's, ``yours``, and ``SIZES``, in order): job MTBF, and goodput with whole-job restarts at
    Young's best interval and at the run's, and with peer healing at the run's."""
    rows = []
    for n in sorted({devices, *SIZES}):
        lam = failures_per_s(n, rate)
        best = best_interval(rec.save_stall_s, lam, rec.step_s)
        own = rec.interval_s or best
        # with peer healing, checkpoints are for the failures no peer covers: Young's interval at their rate
        peer_t = rec.interval_s or best_interval(rec.save_stall_s, lam * rec.uncovered, rec.step_s)
        rows.append(
            {
                "devices": n,
                "yours": n == devices,
                "mtbf_h": (1 / lam / 3600) if lam else math.inf,
                "best_interval_s": best,
                "whole_job_best": whole_job(lam, rec.save_stall_s, best, rec.restart_s),
                "interval_s": own,
                "whole_job": whole_job(lam, rec.save_stall_s, own, rec.restart_s),
                "peer_interval_s": peer_t,
                "peer_heal": peer_healed(lam, rec, peer_t),
            }
        )
    return rows


def format_table(rows: list[dict], rate: float, rec: Recovery) -> str:
    lines = [
        f"goodput at {rate:g} failures per 1,000 device-days: save stall C {rec.save_stall_s:g} s, whole-job "
        f"restart R {rec.restart_s:g} s, peer heal s {rec.peer_heal_s:g} s, step t {rec.step_s:g} s",
        *(f"  {name}: {where}" for name, where in rec.sources),
        f"{'devices':>9} {'job MTBF':>9} {'whole-job restart, best T':>28}"
        + (f" {'restart, run T':>22}" if rec.interval_s else "")
        + f" {'peer healing':>24}",
    ]
    for r in rows:
        lines.append(
            f"{'*' if r['yours'] else ' '}{r['devices']:>8,} {r['mtbf_h']:>8.1f}h"
            f" {r['whole_job_best'] * 100:>15.1f}% (T {_dur(r['best_interval_s']):>8})"
            + (f" {r['whole_job'] * 100:>9.1f}% (T {_dur(r['interval_s']):>8})" if rec.interval_s else "")
            + f" {r['peer_heal'] * 100:>11.1f}% (T {_dur(r['peer_interval_s']):>8})"
        )
    return "\n".join(lines)


def _dur(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def from_run(run_dir: str | Path) -> dict[str, tuple[float, str]]:
    """What a run measured of each cost, from its ``events.jsonl`` and ``metrics.jsonl``: the median save
    stall (``checkpoint_saved.stall_s``), the median whole-job restart (``recovered.seconds`` of restarts
    from a checkpoint, plus the median step: the model's R ends at the next completed step), the median
    peer heal (``recovered`` with ``healed_by`` peer), the median step time and the checkpoint interval
    (``checkpoint.every_steps`` × step). Each as (value, where it came from); a cost the run did not
    measure is left out."""
    run = Path(run_dir)
    events = read_jsonl(run / "events.jsonl")
    steps = [m["step_time"] for m in read_jsonl(run / "metrics.jsonl") if m.get("step_time")]
    out: dict[str, tuple[float, str]] = {}
    if steps:
        t = statistics.median(steps)
        out["step_s"] = (t, f"median step_time of {len(steps)} steps")
    stalls = [e["stall_s"] for e in events if e["kind"] == "checkpoint_saved" and "stall_s" in e]
    if stalls:
        out["save_stall_s"] = (statistics.median(stalls), f"median stall_s of {len(stalls)} checkpoint_saved")
    restarts = [e["seconds"] for e in events if e["kind"] == "recovered" and e.get("healed_by", "checkpoint") != "peer"]
    if restarts:
        r = statistics.median(restarts) + out.get("step_s", (0.0, ""))[0]
        out["restart_s"] = (r, f"median seconds of {len(restarts)} recovered (checkpoint) + a step")
    peers = [e["seconds"] for e in events if e["kind"] == "recovered" and e.get("healed_by") == "peer"]
    if peers:
        out["peer_heal_s"] = (statistics.median(peers), f"median seconds of {len(peers)} recovered (peer)")
    every = None
    if (run / "config.toml").is_file():
        import tomllib

        every = tomllib.loads((run / "config.toml").read_text()).get("checkpoint", {}).get("every_steps")
    if every and "step_s" in out:
        out["interval_s"] = (every * out["step_s"][0], f"checkpoint.every_steps {every} x the median step")
    return out


def recovery_from(args, run_costs: dict[str, tuple[float, str]], planned_step_s: float | None) -> Recovery:
    """The costs the model uses: what was given on the command line, else what the run measured, else the
    defaults (a planned step time; a save stall of 0 for asynchronous saves; assumed restart and peer-heal
    times, named as assumptions)."""
    defaults = {
        "save_stall_s": (30.0, "assumed: a synchronous save of a large model (--from-run gives a run's own)"),
        "restart_s": (600.0, "assumed: a whole-job restart of 10 min (FT-HSDP's measured stall)"),
        "peer_heal_s": (15.0, "assumed: one step and a re-formed group (the research table's optimistic s)"),
        "step_s": (
            planned_step_s or 10.0,
            "the planner's estimate for the best layout" if planned_step_s else "assumed",
        ),
    }
    values, sources = {}, []
    for name in ("save_stall_s", "restart_s", "peer_heal_s", "step_s", "interval_s"):
        given = getattr(args, name, None)
        if given is not None:
            values[name], where = given, "given"
        elif name in run_costs:
            values[name], where = run_costs[name]
        elif name in defaults:
            values[name], where = defaults[name]
        else:
            continue
        sources.append((name, where))
    sources.append(("uncovered", "given" if args.uncovered is not None else UNCOVERED_SOURCE))
    uncovered = UNCOVERED if args.uncovered is None else args.uncovered
    return Recovery(**values, uncovered=uncovered, sources=tuple(sources))


def failure_rate(value: str) -> tuple[float, str]:
    """``--failure-rate``: a number per 1,000 device-days, or a named published rate (``FAILURE_RATES``)."""
    if value in FAILURE_RATES:
        return FAILURE_RATES[value]
    try:
        rate = float(value)
    except ValueError:
        raise ValueError(
            f"--failure-rate {value!r} is neither a number (failures per 1,000 device-days) nor one of "
            f"{', '.join(FAILURE_RATES)}"
        ) from None
    if rate < 0:
        raise ValueError(f"--failure-rate {value}: a rate cannot be negative")
    return rate, "given"


def drill(events: list[dict], metrics: list[dict], every_steps: int) -> dict:
    """A fault drill's measured goodput beside the model's prediction at the drill's own failure rate and
    costs. Both over its training: from its first step's start to its last step's end (start-up and the
    final validation are not what the model is about). Measured: the kept steps' time (the last attempt
    of each step, skipped updates left out) over that span. Predicted: ``whole_job`` with Λ the restarts
    (``recovered``) per second of kept step time, R the median stall of a restart (from the last step
    completed before it to the first after, less one step), C the median save stall and T =
    ``every_steps`` steps of the median step, in ``whole_job_per_kept_second`` (Λ is counted per second of
    kept work). ``whole_job``'s first-order form is far off at a drill's checkpoint every few 0.1 s steps
    (C/T near 0.5): it read 8.6 % against a measured 13.8 % on one CI run, where this one reads 15.4 %."""
    timed = [m for m in metrics if "time" in m and m.get("step_time")]
    if not timed:
        raise ValueError("the drill has no timed steps (metrics.jsonl records with time and step_time)")
    kept: dict[int, dict] = {m["step"]: m for m in timed}
    span = max(m["time"] for m in timed) - (min(m["time"] for m in timed) - timed[0]["step_time"])
    measured = kept_share(timed, span)  # raysc status's goodput (the last attempt of each step), over the span
    useful = measured * span
    t = statistics.median(m["step_time"] for m in kept.values())
    stamps = sorted(m["time"] for m in timed)
    stalls = []
    for e in events:
        if e["kind"] != "recovered":
            continue
        begun = next(b["time"] for b in reversed(events) if b["kind"] == "recovery_start" and b["time"] <= e["time"])
        before = [s for s in stamps if s <= begun]
        after = [s for s in stamps if s > e["time"]]
        if before and after:
            stalls.append(after[0] - before[-1] - t)
    saves = [e["stall_s"] for e in events if e["kind"] == "checkpoint_saved" and "stall_s" in e]
    lam = len(stalls) / useful
    restart = statistics.median(stalls) if stalls else 0.0
    stall = statistics.median(saves) if saves else 0.0
    return {
        "measured": measured,
        "predicted": whole_job_per_kept_second(lam, stall, every_steps * t, restart),
        "restarts": len(stalls),
        "restart_s": restart,
        "save_stall_s": stall,
        "step_s": t,
        "kept_step_s": useful,
        "span_s": span,
    }
