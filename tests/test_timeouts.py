"""Calibrated timeouts: measured step and collective times set the hang and process-group timeouts,
a collective stress loop under them fires no timeout, a hang is caught by the calibrated timeout
(not the 600 s default), and a straggler is reported without a restart."""

from __future__ import annotations

from pathlib import Path

from raysc.fleet.records import read_jsonl


def test_calibrated_timeouts_stress_and_fast_hang_detection(ray_session, make_cfg):
    from raysc.driver import train

    cfg = make_cfg("parallel.dp_replicate=2", "train.steps=14", "checkpoint.every_steps=5",
                   "checkpoint.async=false", "supervisor.calibrate_steps=3", "supervisor.timeout_floor_s=1",
                   "supervisor.stress_s=2", "supervisor.hang_timeout_s=600", "supervisor.restart_backoff_s=0.1",
                   'supervisor.inject="hang@9:1"')
    summary = train(cfg, progress=False)
    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    cal = [e for e in events if e["kind"] == "timeouts_calibrated"][0]
    assert cal["steps"] == "2..4" and cal["factor"] == 4.0
    assert cal["hang_timeout_s"] == max(1.0, 4.0 * max(cal["step_time_s"], 1.0))  # reports come >= 1/s
    assert cal["pg_timeout_s"] >= 4.0 * max(cal["step_time_s"], cal["allreduce_s"]) - 1e-3
    assert cal["pg_timeout_s"] < 60  # calibrated, not the 30 min default
    stress = [e for e in events if e["kind"] == "collective_stress"][0]
    assert stress["ops"] > 10 and stress["timeouts"] == 0 and stress["slowest_op_s"] < stress["pg_timeout_s"]
    fired = [e for e in events if e["kind"] == "fault_injected"][0]
    start = [e for e in events if e["kind"] == "recovery_start"][0]
    assert start["time"] - fired["time"] < 15  # seconds, where hang_timeout_s alone would wait 600
    assert summary["steps"] == 14 and summary["restarts"] == 1


def test_straggler_is_reported_not_restarted(ray_session, make_cfg):
    from raysc.driver import train

    cfg = make_cfg("parallel.dp_replicate=2", "train.steps=12", "supervisor.calibrate_steps=3",
                   'supervisor.inject="slow@8:1"')  # (no warm spares: their start-up slows steps too)
    summary = train(cfg, progress=False)
    slow = [e for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl") if e["kind"] == "slow_step"]
    assert [e["step"] for e in slow] == [8] and slow[0]["step_time_s"] >= 3.0
    assert summary["restarts"] == 0 and summary["steps"] == 12
