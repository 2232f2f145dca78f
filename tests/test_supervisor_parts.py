"""The supervisor's parts that need no cluster: failure classification (a table), the event
vocabulary and its generated reference, the fault injector's hooks, and ``raysc status``'s goodput
over a stopped and resumed run."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from raysc.checkpoint.store import CorruptCheckpoint
from raysc.fleet.actions import Action, classify
from raysc.fleet.errors import Failure, FailureKind
from raysc.fleet.events import EventKind, events_reference
from raysc.fleet.faults import FaultInjector, InjectedFault
from raysc.fleet.records import RunRecords
from raysc.train.sdc import SilentCorruption
from raysc.train.stability import SpikeRollback

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    (None, Action.RESTART),
    (Failure(FailureKind.DIED, 1), Action.RESTART),
    (Failure(FailureKind.HUNG, 0), Action.RESTART),
    (Failure(FailureKind.TIMED_OUT, 0), Action.RESTART),
    (Failure(FailureKind.RAISED, 0, InjectedFault("boom")), Action.RESTART),
    (Failure(FailureKind.RAISED, 0, CorruptCheckpoint(4, "model.distcp", "sha256 mismatch")), Action.RESTART),
    (Failure(FailureKind.RAISED, 0, SpikeRollback(12, 10, {"loss": 9.0})), Action.ROLLBACK),
    (Failure(FailureKind.RAISED, 2, SilentCorruption(40, {})), Action.REPAIR),
    (Failure(FailureKind.STORAGE), Action.FATAL),
]


@pytest.mark.parametrize("failure,action", CASES, ids=[f"{a.value}-{i}" for i, (_, a) in enumerate(CASES)])
def test_classify_table(failure, action):
    assert classify(failure) is action


def test_events_reference_is_current():
    assert (ROOT / "docs" / "events.md").read_text() == events_reference(), (
        "regenerate: python -m raysc.fleet.events > docs/events.md"
    )


def test_every_recorded_kind_is_in_the_vocabulary(tmp_path):
    """No event is recorded under a string outside ``EventKind``: the records refuse it, and the
    code names kinds through the enum, never as string literals."""
    records = RunRecords(tmp_path, "t")
    assert records.event(EventKind.RUN_START)["kind"] == "run_start"
    with pytest.raises(ValueError, match="not a valid EventKind"):
        records.event("run_finished_ok")
    records.close()
    literal = re.compile(r"""(?:_event|\.event)\(\s*["']""")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in (ROOT / "raysc").rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not offenders, offenders


def test_fault_injector_hooks():
    announced = []
    faults = FaultInjector("spike@3:1,raise@5:1,kill_save@4:1,nan@3:0", rank=1, announce=announced.append)
    params = [torch.ones(4)]
    loss = torch.tensor(2.0)
    faults.before_step(2, params)
    assert faults.after_loss(loss) is loss and not announced  # no fault at step 2: the loss untouched
    faults.before_step(3, params)
    assert faults.after_loss(loss).item() == 2000.0 and [f.spec for f in announced] == ["spike@3:1"]
    faults.after_step()
    assert faults.after_loss(loss) is loss  # one step only (validation after it is not scaled)
    assert faults.on_file_written(3) is None and faults.on_file_written(4) is not None
    with pytest.raises(InjectedFault):
        faults.before_step(5, params)
    other = FaultInjector("nan@3:0", rank=0, announce=lambda f: None)
    other.before_step(3, params)
    assert math.isnan(other.after_loss(loss).item())


def test_a_phased_fault_fires_at_its_phase_of_its_step_and_bad_phases_are_refused():
    """``KIND@STEP:RANK/PHASE``: the fault fires inside the step at that phase, not at its start; a phase
    on a kind that acts elsewhere (nan, kill_save) and an unknown phase are config errors."""
    from raysc.config.faults import parse_faults

    announced = []
    faults = FaultInjector("raise@4:0/backward,kill@6:0/update", rank=0, announce=announced.append)
    faults.before_step(4, [torch.ones(1)])
    faults.at_phase(4, "data")
    assert not announced
    with pytest.raises(InjectedFault):
        faults.at_phase(4, "backward")
    faults.at_phase(4, "backward")  # fired once
    assert [f.spec for f in announced] == ["raise@4:0/backward"]
    assert parse_faults("kill@6:0/update")[0].phase == "update" and parse_faults("kill@6")[0].phase == "start"
    with pytest.raises(ValueError, match="unknown phase 'later'"):
        parse_faults("kill@6:0/later")
    with pytest.raises(ValueError, match="a nan fault acts where it acts"):
        parse_faults("nan@6/backward")


def test_bitflip_fault_flips_one_bit_of_the_first_parameter():
    params = [torch.ones(4), torch.ones(2)]
    FaultInjector("bitflip@7", rank=0, announce=lambda f: None).before_step(7, params)
    assert params[0][0].item() != 1.0 and torch.equal(params[0][1:], torch.ones(3))
    assert torch.equal(params[1], torch.ones(2))


def test_a_ranks_torch_exception_crosses_as_a_rank_error_that_still_names_a_peer_failure():
    """The supervisor imports no torch: a worker's torch exception reaches it as a RankError (class
    names and message), which root-cause analysis still recognises; raysc's own and Python's
    exceptions cross unchanged, so the classification table sees their types."""
    import pickle

    from raysc.fleet.errors import RankError, portable
    from raysc.fleet.watch import is_peer_failure

    timed_out = torch.distributed.DistBackendError("[gloo] Timed out waiting 1000ms for recv operation")
    crossed = pickle.loads(pickle.dumps(portable(timed_out)))
    assert isinstance(crossed, RankError) and str(crossed) == str(timed_out)
    assert crossed.is_a("torch.distributed.DistError") and is_peer_failure(crossed)
    assert not is_peer_failure(RankError(("torch.OutOfMemoryError",), "CUDA out of memory"))
    for own in (SilentCorruption(4, {}), SpikeRollback(12, 10, {}), ValueError("bad")):
        assert portable(own) is own
    assert (
        classify(Failure(FailureKind.RAISED, 0, pickle.loads(pickle.dumps(portable(SilentCorruption(4, {}))))))
        is Action.REPAIR
    )


def test_status_goodput_leaves_out_the_time_between_a_stop_and_its_resume(tmp_path):
    """A README walk printed goodput 48.2% for a run whose two sessions had 0.87 and 0.92: the idle
    time between `raysc train` and `raysc train --resume` counted as the run's."""
    import json

    from raysc.fleet.status import run_status

    ev = [
        {"kind": "run_start", "time": 1000.0},
        {"kind": "run_end", "time": 1010.0},
        {"kind": "run_start", "time": 4600.0},
        {"kind": "run_end", "time": 4610.0},
    ]
    mt = [{"step": s, "time": 1000.0 + s, "step_time": 0.9} for s in range(1, 11)]
    mt += [{"step": s, "time": 4590.0 + s, "step_time": 0.9} for s in range(11, 21)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in mt))
    st = run_status(tmp_path)
    assert st["sessions"] == 2 and st["wall_s"] == 20.0 and st["goodput"] == pytest.approx(0.9)
    # a session still running counts to its newest record
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev[:3]))
    st = run_status(tmp_path)
    assert st["state"] == "running" and st["wall_s"] == 20.0


def test_a_record_still_being_written_is_left_out(tmp_path):
    """A live run appends to metrics.jsonl while `raysc status` (or a test) reads it: the last line without
    its newline is a record not finished yet, left out instead of failing the reader (a CI run read half a
    metrics line); finished records all come back."""
    import json

    from raysc.fleet.records import read_jsonl

    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    done = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(done + json.dumps({"step": 4, "loss": 0.25})[:20])
    assert read_jsonl(path) == rows
    path.write_text(done)
    assert read_jsonl(path) == rows
    path.write_text("")
    assert read_jsonl(path) == []
