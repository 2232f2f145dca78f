"""The run's final phase (validation, and the pre-flight probe of ``raysc preflight``) is healed like
training: a worker that dies or raises there is replaced, the fleet restored from the final checkpoint and
the phase run again; past ``supervisor.max_restarts`` the run still ends successfully, its validation
missing and a ``validation_missing`` event saying why, because its training and final checkpoint are
complete. A fault at step ``train.steps + 1`` fires at the start of the final validation
(``raysc.fleet.faults``). Both runs at the default asynchronous saves."""

from __future__ import annotations

import math
from pathlib import Path

from raysc.fleet.records import read_jsonl

BASE = ["train.steps=6", "checkpoint.every_steps=3", "parallel.dp_replicate=2", "supervisor.restart_backoff_s=0.1"]


def _events(cfg, kind: str) -> list[dict]:
    return [e for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl") if e["kind"] == kind]


def test_a_worker_lost_in_the_final_validation_is_healed_and_past_max_restarts_the_run_ends_without_it(
    ray_session, make_cfg
):
    from raysc.fleet.driver import train

    healed = make_cfg(*BASE, 'supervisor.inject="kill@7:1"', run="healed")
    summary = train(healed, progress=False)
    assert summary["restarts"] == 1 and summary["steps"] == 6, summary
    assert summary["val_loss"] is not None and math.isfinite(summary["val_loss"]), summary
    assert [e["rank"] for e in _events(healed, "worker_died")] == [1]
    assert [e["resumed_step"] for e in _events(healed, "recovered")] == [6]  # the final checkpoint
    assert not _events(healed, "validation_missing") and len(_events(healed, "run_end")) == 1

    gave_up = make_cfg(*BASE, 'supervisor.inject="raise@7:0"', "supervisor.max_restarts=0", run="gave_up")
    summary = train(gave_up, progress=False)  # returns: no RunFailed
    assert summary["val_loss"] is None and summary["checkpoint_lag_steps"] == 0, summary
    assert summary["checkpoint"].endswith("/step_00000006"), summary
    (missing,) = _events(gave_up, "validation_missing")
    assert missing["phase"] == "evaluating" and "injected fault raise@7:0" in missing["error"], missing
    assert _events(gave_up, "restarts_exhausted") and not _events(gave_up, "run_failed")
    assert _events(gave_up, "run_end")[0]["val_loss"] is None
