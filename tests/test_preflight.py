"""``raysc preflight`` on the fleet: every item judged from measurements, the report files, the exit
code on a fail, and ``train.require_preflight`` refusing a run without a passing report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysc.config.load import dump_config

FLEET = [
    "parallel.dp_replicate=2",
    "parallel.tp=2",
    "parallel.cpus_per_worker=0.5",
    "train.steps=200",
    "supervisor.sdc_every_steps=10",
    'serve.quantization="int8"',
]


def test_preflight_fails_without_checkpoints_then_passes_and_gates_training(ray_session, make_cfg, tmp_path, capsys):
    from raysc.cli import main
    from raysc.fleet.driver import train
    from raysc.fleet.preflight_gate import PreflightRequired, require_passing

    cfg = make_cfg(*FLEET, "checkpoint.every_steps=0", "checkpoint.capacity_gb=0.0001")  # and a 100 kB quota
    path = tmp_path / "cfg.toml"
    path.write_text(dump_config(cfg))
    assert main(["preflight", str(path), "--steps", "6"]) == 1  # no periodic checkpoints: a fail
    report = json.loads((Path(cfg.run_dir) / "preflight.json").read_text())
    status = {i["name"]: i["status"] for i in report["items"]}
    assert not report["passed"] and status["checkpoint"] == "fail"
    ckpt_item = [i for i in report["items"] if i["name"] == "checkpoint"][0]
    assert "Young's interval" in ckpt_item["summary"] and "store CANNOT hold" in ckpt_item["summary"]
    assert ckpt_item["evidence"]["capacity"]["need_bytes"] > ckpt_item["evidence"]["capacity"]["available_bytes"]
    assert (Path(cfg.run_dir) / "preflight.md").read_text().startswith("# Pre-flight report (FAILED")
    gated = make_cfg(
        *FLEET, "checkpoint.every_steps=0", "checkpoint.capacity_gb=0.0001", "train.require_preflight=true"
    )
    with pytest.raises(PreflightRequired, match="failed .*checkpoint"):
        train(gated, progress=False)

    cfg = make_cfg(*FLEET, "checkpoint.every_steps=50")
    path.write_text(dump_config(cfg))
    assert main(["preflight", str(path), "--steps", "6"]) == 0
    report = json.loads((Path(cfg.run_dir) / "preflight.json").read_text())
    items = {i["name"]: i for i in report["items"]}
    assert report["passed"] and [i["number"] for i in report["items"]] == list(range(1, 9))
    for name in ("profile", "topology", "serving", "timeouts"):
        assert items[name]["status"] == "pass", items[name]
    # CPUs do not report ECC: said, and a warning rather than a silent pass
    assert items["consistency"]["status"] == "warn" and "ECC state not reported" in items["consistency"]["summary"]
    bw = items["profile"]["evidence"]["bus_bandwidth_gbps"]
    assert set(bw) == {"tp", "dp_replicate"} and all(g["all_reduce_busbw_gbps"] > 0 for g in bw.values())
    assert 0.75 <= items["profile"]["evidence"]["measured_over_estimate"] <= 1.25
    assert items["consistency"]["evidence"]["checks_run"] >= 2 and items["consistency"]["evidence"]["mismatches"] == 0
    assert items["timeouts"]["evidence"]["stress"]["timeouts"] == 0
    assert items["data"]["status"] == "warn" and items["hyperparameters"]["status"] == "warn"  # not curated, no μP
    assert items["checkpoint"]["evidence"]["store"]["write_mb_s"] > 0
    assert items["checkpoint"]["evidence"]["capacity"]["ok"] is True  # a local store: its free space
    require_passing(make_cfg(*FLEET, "checkpoint.every_steps=50", "train.require_preflight=true"))
    with pytest.raises(PreflightRequired, match="config changed"):
        require_passing(make_cfg(*FLEET, "checkpoint.every_steps=60", "train.require_preflight=true"))
    with pytest.raises(PreflightRequired, match="does not exist"):
        require_passing(make_cfg(*FLEET, "train.require_preflight=true", run="elsewhere"))
