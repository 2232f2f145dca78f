"""The goodput model of `raysc plan --goodput` (raysc.plan.goodput): it reproduces the published-rate
table of the research it is built on, reads a run's measured costs from its records, and prints the
table at the user's size and at 1k/16k/100k devices."""

from __future__ import annotations

import json

import pytest

from raysc.plan import goodput


def test_the_model_reproduces_the_whole_job_restart_rows_of_the_research_table():
    """Llama 3's failure rate, a 10-minute restart and a 30 s save (../shared/research, section 7): 97.9 %
    at 1,024 devices (checkpoint every 54 min), 88.3 % at 16,384 (14 min), 64.1 % at 100,000 (5.5 min)."""
    rate = goodput.FAILURE_RATES["llama3"][0]
    rec = goodput.Recovery(save_stall_s=30, restart_s=600, peer_heal_s=15, step_s=10)
    rows = {r["devices"]: r for r in goodput.table(16_384, rate, rec)}
    for n, want, minutes in ((1_024, 0.979, 54), (16_384, 0.883, 14), (100_000, 0.641, 5.5)):
        assert rows[n]["whole_job_best"] == pytest.approx(want, abs=0.002)
        assert rows[n]["best_interval_s"] / 60 == pytest.approx(minutes, rel=0.03)
    assert rows[16_384]["yours"] and rows[16_384]["mtbf_h"] == pytest.approx(3.1, abs=0.05)
    # peer healing loses s and half a step per failure instead of R and half an interval
    assert all(r["peer_heal"] > r["whole_job"] for r in rows.values())
    every = goodput.Recovery(save_stall_s=30, restart_s=600, peer_heal_s=15, step_s=10, uncovered=1.0)
    lam = goodput.failures_per_s(16_384, rate)
    assert goodput.peer_healed(lam, every, 822.0) == pytest.approx(goodput.whole_job(lam, 30, 822.0, 600))


def test_a_runs_records_give_the_costs_it_measured(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    events = [
        {"kind": "run_start", "time": 0},
        {"kind": "checkpoint_saved", "step": 4, "stall_s": 0.2},
        {"kind": "checkpoint_saved", "step": 8, "stall_s": 0.4},
        {"kind": "checkpoint_saved", "step": 12, "stall_s": 0.3},
        {"kind": "recovered", "seconds": 4.0},
        {"kind": "recovered", "seconds": 6.0, "healed_by": "checkpoint"},
        {"kind": "recovered", "seconds": 0.5, "healed_by": "peer"},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_time": 0.1 * i}) + "\n" for i in (1, 2, 3)))
    (run / "config.toml").write_text("[checkpoint]\nevery_steps = 50\n")
    got = {k: v for k, (v, _) in goodput.from_run(run).items()}
    assert got == pytest.approx(
        {"step_s": 0.2, "save_stall_s": 0.3, "restart_s": 5.2, "peer_heal_s": 0.5, "interval_s": 10.0}
    )


def test_raysc_plan_goodput_prints_the_table_with_its_sources_and_refuses_a_bad_rate(tmp_path, capsys):
    from raysc.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"kind": "recovered", "seconds": 3.0}) + "\n")
    argv = ["plan", "jobs/configs/llama-1b.toml", "--gpus", "4096", "--goodput", "--failure-rate", "rsc1"]
    assert main([*argv, "--from-run", str(run), "--step-s", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert "Meta RSC-1" in out and "restart_s: median seconds of 1 recovered (checkpoint) + a step" in out
    assert "step_s: given" in out and "*   4,096" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert [r["devices"] for r in report["goodput"]] == [1_024, 4_096, 16_384, 100_000]
    assert report["failure_rate"] == 0.81 and report["goodput"][1]["yours"]
    with pytest.raises(ValueError, match="--failure-rate 'often' is neither a number"):
        goodput.failure_rate("often")
