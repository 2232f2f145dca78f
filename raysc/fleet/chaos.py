"""A chaos drill: a seeded random schedule of faults of every kind, and the report of what became of each.

``make_schedule`` draws faults (every kind of ``raysc.config.faults`` plus ``store_outage``, an
object store that refuses every write of one checkpoint) at random steps and ranks, spaced so
that each heals before the next and no restart rewinds past an earlier fault:

- training runs in slots that start at a checkpoint step ``b``; a fault fires at a random step
  of ``(b, b + every]`` and the next slot starts at ``b + every``: a restart resumes from ``b``
  at the latest and re-runs to the checkpoint at ``b + every`` before the next fault can fire;
- ``kill_save`` and ``store_outage`` hit the checkpoint of ``b + every`` itself, which is then not
  committed, so the next slot starts one interval later;
- with asynchronous saves (the default) a restart may find the checkpoint of ``b`` still uploading,
  abandon it and resume from ``b - every``: after a fault that changes the numbers or refuses a
  save, the next slot starts one interval later still, so no rewind crosses it;
- ``spike`` waits until the spike detector has a history to judge against (``min_step``);
- ``slow`` hits a rank other than 0 (see ``_rank``).

``store_outage`` is not an injected kind: the caller makes the store fail (for S3, an HTTP proxy
answering ``outage_pattern`` with 503s, ``tests/s3_fault_proxy.py``); the run's own events say
whether it happened. ``inject_spec`` is the ``supervisor.inject`` of a schedule and
``reference_spec`` that of the uninterrupted reference run: the faults that change the numbers on
purpose (``nan``/``spike`` skip an update; a flipped bit reaches the gradients of its step before
the replica check repairs it), which fire identically in both runs, so every other kind must leave
the final parameters bit-equal to the reference.

``report`` reads a finished run's events and the store's committed steps and says, per fault:
fired (its own event: ``fault_injected``, or a failed upload of that step for an outage), detected,
healed, seconds to heal and steps lost; and per run: committed checkpoints lost (saved by a
``checkpoint_saved`` event, not listed by the store), restarts nobody scheduled, goodput.

Time to heal (MTTR) is measured from the fault's own event (for an outage: the first refused
request, when the caller knows it, else the failed save's event) to the event that ends it:
``recovered`` (a new fleet has restored a checkpoint and is about to train) for the kinds that
restart the fleet; ``sdc_repaired`` / ``sdc_rollback`` for a flipped bit; ``update_skipped`` for
nan/spike (rank 0 reports metrics in batches at most once a second: up to 1 s late) or
``spike_rollback``; ``slow_step`` for a straggler (the straggle itself: nothing to heal); and the
next ``checkpoint_saved`` for an outage (the store holds newer work again).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from raysc.config.faults import KINDS as INJECTED

OUTAGE = "store_outage"
# not drawn: disk_loss and slow_upload fail nothing and heal nothing (one changes where the next restore
# reads from, the other holds a save in flight for a later fault to meet)
ALL_KINDS = (*(k for k in INJECTED if k not in ("disk_loss", "slow_upload")), OUTAGE)
SAVE_KINDS = ("kill_save", OUTAGE)  # hit the checkpoint of their step, which is then not committed
NUMERIC_KINDS = ("nan", "spike", "bitflip")  # change the numbers on purpose: replayed in the reference
RESTART_KINDS = ("kill", "hang", "raise", "kill_save", "node_loss")
MIN_STEP = {"spike": 24, "slow": 8}  # spike: the detector judges after 16 accepted steps; slow: after calibration

DETECTED_BY = {
    "kill": ("worker_died",),
    "kill_save": ("worker_died",),
    "raise": ("worker_error",),
    "hang": ("worker_hang", "worker_error", "worker_timeout"),
    "node_loss": ("node_lost",),
    "nan": ("update_skipped",),
    "spike": ("update_skipped", "spike_rollback"),
    "bitflip": ("sdc_mismatch",),
    "slow": ("slow_step",),
    OUTAGE: ("checkpoint_upload_retry", "checkpoint_save_failed"),
}
HEALED_BY = {
    **{k: ("recovered",) for k in RESTART_KINDS},
    "nan": ("update_skipped", "spike_rollback"),
    "spike": ("update_skipped", "spike_rollback"),
    "bitflip": ("sdc_repaired", "sdc_rollback"),
    "slow": ("slow_step",),
    OUTAGE: ("checkpoint_saved",),
}


@dataclass(frozen=True)
class ChaosFault:
    kind: str
    step: int
    rank: int

    @property
    def spec(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    faults: list[ChaosFault]
    steps: int  # train.steps that holds them all, with one checkpoint interval after the last
    every: int  # checkpoint.every_steps the spacing assumes


def make_schedule(
    seed: int,
    *,
    n: int = 12,
    world: int = 3,
    every: int = 4,
    first: int = 8,
    kinds: tuple[str, ...] = ALL_KINDS,
    extra_kinds: tuple[str, ...] | None = None,
    min_step: dict[str, int] | None = None,
    async_saves: bool = True,
) -> Schedule:
    """``n`` faults: each of ``kinds`` once, the rest drawn from ``extra_kinds`` (default: ``kinds``
    but node_loss, which needs a spare node each time), in a seeded random order, at random steps
    (slots after the checkpoint step ``first``; see the module docstring) and ranks < ``world``.
    ``async_saves`` (checkpoint.async, the default): a fault may meet the previous checkpoint still
    uploading, abandon it and rewind one interval further, so a fault that changes the numbers
    (replayed in the reference) or refuses a save is followed by one more interval."""
    if n < len(kinds):
        raise ValueError(f"{n} faults cannot cover the {len(kinds)} kinds {kinds}")
    if first % every:
        raise ValueError(f"the first slot must start at a checkpoint step (a multiple of {every}), not {first}")
    rng = random.Random(seed)
    extra = extra_kinds if extra_kinds is not None else tuple(k for k in kinds if k != "node_loss")
    chosen = list(kinds) + [rng.choice(extra) for _ in range(n - len(kinds))]
    floor = {**MIN_STEP, **(min_step or {})}
    for _ in range(10_000):
        rng.shuffle(chosen)
        faults, b = [], first
        for kind in chosen:
            step = b + every if kind in SAVE_KINDS else b + rng.randint(1, every)
            if step < floor.get(kind, 0):
                break
            faults.append(ChaosFault(kind, step, _rank(kind, world, rng)))
            b += 2 * every if kind in SAVE_KINDS else every
            if async_saves and kind in (*NUMERIC_KINDS, OUTAGE):
                b += every  # the next fault may rewind one more interval: never back across this one
        else:
            return Schedule(seed, faults, b + every, every)
    raise ValueError(f"no order of {chosen} meets the minimum steps {floor}")


def _rank(kind: str, world: int, rng: random.Random) -> int:
    """The rank a fault hits: any, but an outage is the store's (recorded as 0) and a straggler is
    never rank 0: ``slow`` sleeps before the timed step, and rank 0's step time is the only one the
    supervisor sees, so on rank 0 the sleep is invisible (on another rank rank 0 waits for it)."""
    if kind == OUTAGE:
        return 0
    if kind == "slow" and world > 1:
        return rng.randrange(1, world)
    return rng.randrange(world)


def inject_spec(schedule: Schedule) -> str:
    """``supervisor.inject`` of the chaos run (every fault but the store outages)."""
    return ",".join(f.spec for f in schedule.faults if f.kind != OUTAGE)


def reference_spec(schedule: Schedule) -> str:
    """``supervisor.inject`` of the reference run: the faults that change the numbers on purpose."""
    return ",".join(f.spec for f in schedule.faults if f.kind in NUMERIC_KINDS)


def outage_steps(schedule: Schedule) -> list[int]:
    return [f.step for f in schedule.faults if f.kind == OUTAGE]


def outage_pattern(bucket: str, prefix: str, step: int) -> str:
    """A regex of every write of checkpoint ``step`` under ``s3://bucket/prefix`` (as the S3 HTTP
    request line ``METHOD /bucket/key``)."""
    return rf"^(PUT|POST) /{bucket}/{prefix.strip('/')}/step_{step:08d}/"


def _fired_at(fault: ChaosFault, events: list[dict], outage_start: dict[int, float]) -> int | None:
    """Index of the event that proves ``fault`` fired."""
    for i, e in enumerate(events):
        if fault.kind == OUTAGE:
            if e["kind"] in DETECTED_BY[OUTAGE] and e.get("step") == fault.step:
                return i
        elif e["kind"] == "fault_injected" and e.get("fault") == fault.spec:
            return i
    return None


def _matches(fault: ChaosFault, e: dict) -> bool:
    """Whether event ``e`` is about ``fault`` (step-tagged events must name its step or later)."""
    if fault.kind in ("nan", "spike", "slow"):
        return e.get("step") == fault.step
    if fault.kind == "bitflip":
        return e.get("step", fault.step) >= fault.step
    if fault.kind == OUTAGE and e["kind"] == "checkpoint_saved":
        return e.get("step", 0) > fault.step
    return True


def report(
    schedule: Schedule,
    events: list[dict],
    committed: list[int],
    *,
    outage_start: dict[int, float] | None = None,
    params_equal: bool | None = None,
) -> dict:
    """What became of each fault of ``schedule`` in a run with ``events``, whose store lists the
    ``committed`` steps (see the module docstring for the definitions)."""
    outage_start = outage_start or {}
    fired_idx = {f.spec: _fired_at(f, events, outage_start) for f in schedule.faults}
    order = sorted((i, spec) for spec, i in fired_idx.items() if i is not None)
    rows, used = [], set()
    for f in schedule.faults:
        i = fired_idx[f.spec]
        row = {
            "fault": f.spec,
            "kind": f.kind,
            "fired": i is not None,
            "detected": None,
            "healed": None,
            "mttr_s": None,
            "steps_lost": None,
        }
        if i is not None:
            later = [j for j, _ in order if j > i]
            end = later[0] if later and f.kind != OUTAGE else len(events)  # before the next fault fires
            t0 = outage_start.get(f.step, events[i]["time"]) if f.kind == OUTAGE else events[i]["time"]
            det = next(
                (j for j in range(i, end) if events[j]["kind"] in DETECTED_BY[f.kind] and _matches(f, events[j])), None
            )
            heal = (
                next(
                    (
                        j
                        for j in range(det, end)
                        if events[j]["kind"] in HEALED_BY[f.kind] and _matches(f, events[j]) and j not in used
                    ),
                    None,
                )
                if det is not None
                else None
            )
            row["detected"] = det is not None
            row["healed"] = heal is not None
            if heal is not None:
                used.add(heal)
                row["mttr_s"] = round(events[heal]["time"] - t0, 3)
                row["steps_lost"] = events[heal].get("steps_lost", 0)
                row["healed_by"] = events[heal]["kind"]
        rows.append(row)

    per_kind: dict[str, dict] = {}
    for r in rows:
        k = per_kind.setdefault(
            r["kind"], {"injected": 0, "fired": 0, "detected": 0, "healed": 0, "steps_lost": 0, "mttr_s": []}
        )
        k["injected"] += 1
        k["fired"] += r["fired"]
        k["detected"] += bool(r["detected"])
        k["healed"] += bool(r["healed"])
        k["steps_lost"] += r["steps_lost"] or 0
        if r["mttr_s"] is not None:
            k["mttr_s"].append(r["mttr_s"])
    for k in per_kind.values():
        k["mttr_median_s"] = round(statistics.median(k["mttr_s"]), 3) if k["mttr_s"] else None

    saved = sorted({e["step"] for e in events if e["kind"] == "checkpoint_saved"})
    recovered = [e for e in events if e["kind"] == "recovered"]
    restart_faults = sum(1 for r in rows if r["kind"] in RESTART_KINDS and r["fired"])
    end = next((e for e in reversed(events) if e["kind"] == "run_end"), None)
    return {
        "seed": schedule.seed,
        "schedule": [f.spec for f in schedule.faults],
        "faults": {
            "injected": len(rows),
            "fired": sum(r["fired"] for r in rows),
            "detected": sum(bool(r["detected"]) for r in rows),
            "healed": sum(bool(r["healed"]) for r in rows),
        },
        "per_kind": per_kind,
        "per_fault": rows,
        "steps_lost": sum(r["steps_lost"] or 0 for r in rows),
        "restarts": len(recovered),
        "unscheduled_restarts": len(recovered) - restart_faults,
        "checkpoints_saved": saved,
        "checkpoints_committed": sorted(committed),
        "committed_checkpoints_lost": sorted(set(saved) - set(committed)),
        "run_completed": end is not None,
        "goodput": end.get("goodput") if end else None,
        "wall_s": end.get("wall_s") if end else None,
        "params_equal_reference": params_equal,
    }
