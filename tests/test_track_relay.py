"""The tracker relay (``raysc.track.relay``) without a cluster: a tracker that is down, slow or
refusing never blocks the caller, gets every call in order once it answers, and a full buffer
drops the oldest metrics (counted), never the run's opening or a rewind. And naming a tracker
whose package is missing stops `raysc train` before Ray with the install command, while the run's
config still loads where the trackers are not installed (status, export, serve)."""

from __future__ import annotations

import threading
import time

import pytest

from raysc.track.relay import Relay


class FlakySink:
    """Refuses every call while ``down`` is set; ``slow_s`` delays each call it takes."""

    name = "flaky"

    def __init__(self) -> None:
        self.down = threading.Event()
        self.slow_s = 0.0
        self.calls: list[tuple] = []

    def _take(self, *call) -> None:
        if self.down.is_set():
            raise ConnectionError("tracker down")
        time.sleep(self.slow_s)
        self.calls.append(call)

    def open(self, run_id):
        self._take("open", run_id)
        return run_id or "new-id"

    def params(self, params, tags):
        self._take("params", params, tags)

    def metrics(self, rows):
        self._take("metrics", [r[0] for r in rows])

    def text(self, step, tag, text):
        self._take("text", step, tag)

    def rewind(self, step, why):
        self._take("rewind", step)

    def close(self, status):
        self._take("close", status)


def _rows(a: int, b: int) -> list:
    return [(s, 0.0, {"train/loss": 1.0}) for s in range(a, b)]


def test_a_down_tracker_never_blocks_and_gets_everything_in_order_when_back():
    sink, events = FlakySink(), []
    sink.down.set()
    relay = Relay(sink, buffer=1000, retry_max_s=0.2, report=lambda kind, f: events.append((kind, f)))
    t0 = time.perf_counter()
    relay.call("metrics", _rows(1, 5))
    relay.call("rewind", 2, "restart")
    relay.call("metrics", _rows(3, 6))
    assert time.perf_counter() - t0 < 0.2  # the caller (a step's report) never waits out a retry (retry_max_s)
    time.sleep(0.5)
    assert sink.calls == [] and [k for k, _ in events] == ["tracker_degraded"]
    assert relay.state.pending == 7 and not relay.state.healthy
    sink.down.clear()
    assert relay.close("FINISHED", timeout_s=10)
    assert sink.calls == [
        ("open", None),
        ("metrics", [1, 2, 3, 4]),
        ("rewind", 2),
        ("metrics", [3, 4, 5]),
        ("close", "FINISHED"),
    ]
    assert [k for k, _ in events] == ["tracker_degraded", "tracker_recovered"]
    assert relay.state.sent == 7 and relay.state.dropped == 0 and relay.state.run_id == "new-id"


def test_a_slow_tracker_does_not_slow_the_caller_and_loses_no_row():
    sink = FlakySink()
    sink.slow_s = 0.05
    relay = Relay(sink, buffer=1000, retry_max_s=1, report=lambda *_: None, run_id="kept")
    spent = 0.0
    for s in range(1, 41):  # calls keep coming while the relay sends earlier ones
        t0 = time.perf_counter()
        relay.call("metrics", _rows(s, s + 1))
        spent += time.perf_counter() - t0
        time.sleep(0.01)
    assert spent < 0.05
    assert relay.close("FINISHED", timeout_s=10)
    got = [s for c in sink.calls if c[0] == "metrics" for s in c[1]]
    assert got == list(range(1, 41)) and sink.calls[0] == ("open", "kept")
    assert len([c for c in sink.calls if c[0] == "metrics"]) < 40  # batched while it was busy


def test_a_full_buffer_drops_the_oldest_metrics_never_a_rewind():
    sink, events = FlakySink(), []
    sink.down.set()
    relay = Relay(sink, buffer=100, retry_max_s=0.1, report=lambda kind, f: events.append((kind, f)))
    relay.call("metrics", _rows(1, 80))
    relay.call("rewind", 10, "rollback")
    relay.call("metrics", _rows(11, 91))
    assert relay.state.pending == 100 and relay.state.dropped == 59
    sink.down.clear()
    assert relay.close("FINISHED", timeout_s=10)
    assert ("rewind", 10) in sink.calls
    got = [s for c in sink.calls if c[0] == "metrics" for s in c[1]]
    assert got == list(range(60, 80)) + list(range(11, 91))  # the oldest 59 went
    assert events[-1][1]["dropped"] == 59


def test_close_gives_up_on_a_tracker_that_stays_down():
    sink = FlakySink()
    sink.down.set()
    relay = Relay(sink, buffer=1000, retry_max_s=0.2, report=lambda *_: None)
    relay.call("metrics", _rows(1, 3))
    t0 = time.perf_counter()
    assert not relay.close("FINISHED", timeout_s=3)
    assert time.perf_counter() - t0 < 3.5 and relay.state.pending == 2


def test_a_tracker_that_is_not_installed_stops_training_before_ray_but_not_reading_the_run(monkeypatch, tmp_path):
    import importlib.util

    from raysc.config import load_config
    from raysc.config.checks import ConfigError
    from raysc.config.load import dump_config
    from raysc.fleet.driver import check_inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = load_config(None, ['track.mlflow_uri="sqlite:///x.db"'])  # a run's config still loads (status, export)
    with pytest.raises(
        ConfigError,
        match=r"track.mlflow_uri is set but the 'mlflow' package is not installed; "
        r"`pip install 'raysc\[track\]'`",
    ):
        check_inputs(cfg)  # what `raysc train` runs before it starts Ray
    (tmp_path / "config.toml").write_text(dump_config(cfg))
    load_config(tmp_path / "config.toml")
    check_inputs(load_config(None, ["track.tensorboard=true"]))  # installed: accepted


def test_a_runs_trackers_open_one_at_a_time(tmp_path):
    """Opening a tracker imports its library, and two imports parsing source side by side on two
    threads can fail on CPython 3.11 (gh-106905, seen in CI: wandb half imported for the rest of the
    run); so a run's relays open their trackers one after the other."""
    from raysc.config import load_config
    from raysc.track.run_tracker import RunTracker

    opening: list[str] = []
    overlaps: list[list[str]] = []

    class SlowOpen(FlakySink):
        def open(self, run_id):
            opening.append(self.name)
            if len(opening) > 1:
                overlaps.append(list(opening))
            time.sleep(0.3)
            opening.remove(self.name)
            return "id-" + self.name

    sinks = [SlowOpen(), SlowOpen(), SlowOpen()]
    for i, s in enumerate(sinks):
        s.name = f"sink{i}"
    tracker = RunTracker(load_config(None), tmp_path, event=lambda *a, **k: {}, ids={}, sinks=sinks)
    for r in tracker.relays:
        assert r.close("FINISHED", timeout_s=5)
    assert [r.state.run_id for r in tracker.relays] == ["id-sink0", "id-sink1", "id-sink2"]
    assert overlaps == []
