"""``raysc preflight CONFIG``: run the checklist on the actual fleet and write the verdict.

A probe run — the config's own layout, workers and checkpoint store, ``steps`` steps with
memory measurement, a checkpoint half-way, calibrated timeouts, a 2-second collective
stress loop, replica checks every 2 steps when there are replicas (the configured interval is
judged separately), then each rank's
bandwidth per parallel group and its node's topology — writes under
``<run.dir>/preflight/probe`` and checkpoints under ``<checkpoint.uri>/_preflight`` (deleted
after). The store's raw write and read speed is measured with a 32 MB object (8 MB on CPU).
Before the probe's checkpoints are deleted, item 7 quantizes the newest with the method
``serve.quantization`` names (``raysc.preflight.quantized``).
The eight items (``raysc.preflight.checklist``) are judged from that evidence and written to
``<run.dir>/preflight.json`` and ``preflight.md``; the command exits non-zero on a fail.

``train.require_preflight = true`` makes ``raysc train`` refuse to start unless that
``preflight.json`` passed for the same config (``raysc.fleet.preflight_gate``: the config hash without
``train.require_preflight`` itself); this module writes the report that gate reads.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from raysc.checkpoint.storage import Storage, StorageError
from raysc.config.measure import measurement_config
from raysc.config.paths import absolutize
from raysc.config.schema import Config
from raysc.fleet.driver import train
from raysc.fleet.preflight_gate import preflight_hash
from raysc.fleet.records import read_jsonl
from raysc.plan.layout import Layout
from raysc.plan.memory import estimate_memory
from raysc.preflight.checklist import (
    FAIL,
    Evidence,
    Item,
    check_checkpoint,
    check_consistency,
    check_data,
    check_hyperparameters,
    check_profile,
    check_serving,
    check_timeouts,
    check_topology,
)
from raysc.preflight.quantized import measure_quantization


def _store_speed(cfg: Config, nbytes: int) -> dict:
    try:
        storage = Storage(f"{cfg.checkpoint_uri.rstrip('/')}/_preflight", dict(cfg.checkpoint.storage_options))
        blob = bytes(nbytes)
        t0 = time.perf_counter()
        storage.write_bytes("speed.bin", blob)
        t1 = time.perf_counter()
        back = storage.read_bytes("speed.bin")
        t2 = time.perf_counter()
        storage.delete("speed.bin")
        if len(back) != nbytes:
            return {"error": f"read back {len(back)} of {nbytes} bytes"}
        return {
            "bytes": nbytes,
            "write_mb_s": round(nbytes / (t1 - t0) / 1e6, 1),
            "read_mb_s": round(nbytes / (t2 - t1) / 1e6, 1),
        }
    except (StorageError, OSError) as e:
        return {"error": str(e).splitlines()[0]}


def probe_config(cfg: Config, steps: int) -> Config:
    sup = cfg.supervisor
    return measurement_config(
        cfg,
        steps,
        Path(cfg.run_dir) / "preflight" / "probe",
        checkpoint={"uri": f"{cfg.checkpoint_uri.rstrip('/')}/_preflight", "every_steps": max(1, steps // 2)},
        supervisor={
            "stress_s": max(sup.stress_s, 2.0),
            "calibrate_steps": min(max(sup.calibrate_steps, 2), steps - 2),
            "sdc_every_steps": 2,
        },
    )  # a few replica checks, to measure their overhead


def run_preflight(cfg: Config, steps: int = 8, log=print) -> dict:
    cfg = absolutize(cfg)
    if steps < 6:
        raise ValueError("raysc preflight needs --steps >= 6 (calibration, a checkpoint and replica checks)")
    cpu = cfg.parallel.device == "cpu"
    log(f"preflight: probing the fleet for {steps} steps ({cfg.parallel.world_size} worker(s))")
    store = _store_speed(cfg, (8 if cpu else 32) << 20)
    probe_cfg = probe_config(cfg, steps)
    summary = train(
        probe_cfg, progress=False, probe_bytes=(4 if cpu else 64) << 20, overwrite=True
    )  # a probe left by an interrupted pre-flight is scratch
    events = read_jsonl(Path(probe_cfg.run_dir) / "events.jsonl")
    times = [m["step_time"] for m in read_jsonl(Path(probe_cfg.run_dir) / "metrics.jsonl") if m["step"] > 1]
    t = cfg.train
    lay = Layout.from_config(cfg)
    dtype = cfg.compute_dtype
    est = estimate_memory(cfg.model, t.seq_len, t.global_batch_sequences, lay, dtype, cfg.parallel.device)
    ev = Evidence(
        summary=summary,
        events=events,
        step_s=statistics.median(times) if times else 0.0,
        store=store,
        estimate_bytes=est["total"],
        startup_bytes=est["startup"]["total"],
    )
    try:  # item 7: quantize the probe checkpoint before it is deleted
        measured = measure_quantization(cfg, probe_cfg.run_dir)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        measured = {"error": str(e).splitlines()[0]}
    Storage(probe_cfg.checkpoint_uri, dict(cfg.checkpoint.storage_options)).delete_prefix("")
    items: list[Item] = [
        check_profile(cfg, ev),
        check_topology(cfg, ev),
        check_checkpoint(cfg, ev),
        check_consistency(cfg, ev),
        check_data(cfg),
        check_hyperparameters(cfg),
        check_serving(cfg, measured),
        check_timeouts(cfg, ev),
    ]
    report = {
        "config_hash": preflight_hash(cfg),
        "time": time.time(),
        "run_dir": cfg.run_dir,
        "passed": all(i.status != FAIL for i in items),
        "counts": {s: sum(i.status == s for i in items) for s in ("pass", "warn", "fail")},
        "items": [dataclasses.asdict(i) for i in items],
    }
    out = Path(cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "preflight.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "preflight.md").write_text(format_report(report))
    log(format_report(report))
    return report


def format_report(report: dict) -> str:
    mark = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}
    lines = [
        f"# Pre-flight report ({'passed' if report['passed'] else 'FAILED'}: "
        f"{report['counts']['pass']} pass, {report['counts']['warn']} warn, {report['counts']['fail']} fail)",
        "",
        f"config hash {report['config_hash']}",
        "",
    ]
    for item in report["items"]:
        lines.append(f"{item['number']}. [{mark[item['status']]}] {item['name']}: {item['summary']}")
    return "\n".join(lines) + "\n"
