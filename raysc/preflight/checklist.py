"""The eight pre-flight items, each judged from measured evidence: pass, warn or fail.

Each ``check_*`` takes the config and what the probe run measured (``Evidence``) and returns
an ``Item``. The items follow the pre-training checklist raysc's users work from: profile
before planning, topology, checkpoints, consistency checks, data, hyperparameters, serving,
timeouts. What a platform does not report (ECC on CPUs, link topology without nvidia-smi) is
a warning that says so, never a silent pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from raysc.checkpoint.capacity import check_capacity, describe
from raysc.config.schema import Config
from raysc.config.syntax import parse_schedule
from raysc.data.shards import read_index
from raysc.fleet.checkpointing import young_interval_s
from raysc.fleet.events import EventKind

PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class Item:
    number: int
    name: str
    status: str
    summary: str
    evidence: dict = field(default_factory=dict)


@dataclass
class Evidence:
    """What the probe run measured (see ``raysc.preflight.run``)."""

    summary: dict  # the probe run's summary (peak_memory_gb, sdc, probe per rank ...)
    events: list[dict]
    step_s: float  # median step time
    store: dict  # checkpoint store write/read MB/s or the error
    estimate_bytes: float  # the planner's memory estimate for this layout
    startup_bytes: float = 0.0  # the planner's start-up peak (materialising the shard) for this layout


def _events(ev: Evidence, kind: EventKind) -> list[dict]:
    return [e for e in ev.events if e["kind"] == kind]


def check_profile(cfg: Config, ev: Evidence) -> Item:
    probe = ev.summary.get("probe") or []
    groups: dict[str, dict] = {}
    for rank in probe:
        for row in rank["bandwidth"]:
            g = groups.setdefault(row["group"], {"size": row["size"], "bytes": row["bytes"]})
            for k, v in row.items():
                if k.endswith("_gbps"):
                    g[k] = round(min(g.get(k, math.inf), v), 4)  # the slowest rank's group bounds the step
    expected = {n for n, s in cfg.parallel.dims.as_dict().items() if s > 1} | ({"ep"} if cfg.parallel.ep > 1 else set())
    peaks = ev.summary.get("peak_memory_gb") or []
    est_gb = ev.estimate_bytes / 1e9
    evidence = {
        "bus_bandwidth_gbps": groups,
        "peak_memory_gb_per_rank": peaks,
        "planner_estimate_gb": round(est_gb, 4),
        "step_time_s": round(ev.step_s, 4),
        "planner_startup_gb": round(ev.startup_bytes / 1e9, 4),
    }
    if set(groups) != expected or not peaks:
        return Item(
            1,
            "profile",
            FAIL,
            f"measured groups {sorted(groups)} of {sorted(expected)}, memory on {len(peaks)} ranks",
            evidence,
        )
    ratio = max(peaks) / est_gb if est_gb else math.inf
    evidence["measured_over_estimate"] = round(ratio, 3)
    status = PASS if 0.75 <= ratio <= 1.25 else WARN
    return Item(
        1,
        "profile",
        status,
        f"{len(groups)} group(s) measured; peak {max(peaks) * 1e3:.1f} MB/rank vs "
        f"estimate {est_gb * 1e3:.1f} MB (×{ratio:.2f})"
        + ("" if status == PASS else " (re-plan with `raysc plan --profile`)")
        + f"; start-up {ev.startup_bytes / 1e6:.1f} MB/rank estimated",
        evidence,
    )


def _groups_across_nodes(probe: list[dict], key) -> tuple[int, int]:
    """(groups, groups whose ranks sit on more than one node), the groups as ``key(coords)`` names them."""
    groups: dict[tuple, set] = {}
    for r in probe:
        groups.setdefault(key(r["coords"]), set()).add(r["node_id"])
    return len(groups), sum(len(nodes) > 1 for nodes in groups.values())


def check_topology(cfg: Config, ev: Evidence) -> Item:
    probe = ev.summary.get("probe") or []
    dims, ep = cfg.parallel.dims, cfg.parallel.ep
    nodes: dict[str, list[int]] = {}
    for r in probe:
        nodes.setdefault(r["node_id"], []).append(r["rank"])
    tp_groups, crossing = _groups_across_nodes(probe, lambda c: tuple(v for k, v in sorted(c.items()) if k != "tp"))
    topo = [r["topology"] for r in probe]
    evidence = {
        "nodes": len(nodes),
        "ranks_per_node": {k[:12]: v for k, v in nodes.items()},
        "device": topo[0]["device_type"] if topo else None,
        "links": next((t.get("topo") for t in topo if t.get("topo")), None),
        "tp_groups": tp_groups,
        "tp_groups_across_nodes": crossing,
    }
    if ep > 1:  # an EP group: ep consecutive dp_shard ranks, the other coordinates equal
        ep_groups, ep_crossing = _groups_across_nodes(
            probe, lambda c: tuple((k, v // ep if k == "dp_shard" else v) for k, v in sorted(c.items()))
        )
        evidence.update(ep_groups=ep_groups, ep_groups_across_nodes=ep_crossing)
    if not probe or len(probe) != dims.world_size:
        return Item(2, "topology", FAIL, f"{len(probe)} of {dims.world_size} ranks reported", evidence)
    if crossing:
        return Item(
            2,
            "topology",
            FAIL,
            f"{crossing} TP group(s) span nodes: lower parallel.tp to the GPUs per node",
            evidence,
        )
    links = (
        "link topology reported (nvidia-smi topo -m)" if evidence["links"] else "the platform reports no link topology"
    )
    if evidence.get("ep_groups_across_nodes"):
        return Item(
            2,
            "topology",
            WARN,
            f"{evidence['ep_groups_across_nodes']} expert-parallel group(s) span nodes: their all-to-all, four "
            f"per MoE layer and micro-batch, runs at the inter-node bandwidth; lower parallel.ep (or tp × cp) "
            f"so that tp × cp × ep fits a node; {links}",
            evidence,
        )
    return Item(
        2,
        "topology",
        PASS if evidence["links"] or cfg.parallel.device == "cpu" else WARN,
        f"{len(nodes)} node(s), {dims.world_size} rank(s), every TP group"
        + (" and EP group" if ep > 1 else "")
        + f" inside one node; {links}",
        evidence,
    )


def check_checkpoint(cfg: Config, ev: Evidence) -> Item:
    saves = _events(ev, EventKind.CHECKPOINT_SAVED)
    save_s = max((e["total_s"] for e in saves), default=None)
    evidence = {
        "uri": cfg.checkpoint_uri,
        "every_steps": cfg.checkpoint.every_steps,
        "spike_policy": cfg.supervisor.spike_policy,
        "store": ev.store,
        "save_s": save_s,
    }
    problems, warnings = [], []
    if "error" in ev.store:
        problems.append(f"store: {ev.store['error']}")
    if save_s is not None and ev.step_s > 0:
        young_s = young_interval_s(save_s, cfg.checkpoint.mtbf_hours * 3600)
        young_steps = max(1, round(young_s / ev.step_s))
        evidence["young_interval_s"], evidence["young_interval_steps"] = round(young_s, 2), young_steps
        every = cfg.checkpoint.every_steps
        if not every or every >= cfg.train.steps:
            problems.append(f"checkpoint.every_steps is not set: Young's interval is {young_steps} steps")
        elif not young_steps / 3 <= every <= young_steps * 3:
            warnings.append(
                f"every_steps={every} is far from Young's {young_steps} steps "
                f"(save {save_s:.2f} s, MTBF {cfg.checkpoint.mtbf_hours} h)"
            )
    else:
        problems.append("no checkpoint was saved during the probe")
    ckpt_bytes = max((e["bytes"] for e in saves), default=0)
    if ckpt_bytes:
        cap = evidence["capacity"] = check_capacity(cfg, ckpt_bytes)
        (warnings if cap["ok"] is None else problems if not cap["ok"] else []).append(describe(cap))
    if cfg.supervisor.spike_policy == "off":
        warnings.append("supervisor.spike_policy='off': no rollback/skip thresholds")
    status = FAIL if problems else WARN if warnings else PASS
    speed = (
        f"write {ev.store.get('write_mb_s', 0):.0f} MB/s, read {ev.store.get('read_mb_s', 0):.0f} MB/s"
        if "error" not in ev.store
        else ""
    )
    return Item(
        3,
        "checkpoint",
        status,
        "; ".join(problems + warnings)
        or f"every {cfg.checkpoint.every_steps} steps (Young: {evidence.get('young_interval_steps')}), "
        f"spike policy {cfg.supervisor.spike_policy}; {speed}",
        evidence,
    )


def check_consistency(cfg: Config, ev: Evidence) -> Item:
    sdc = ev.summary.get("sdc") or {}
    ecc = [r["topology"].get("ecc") for r in ev.summary.get("probe") or []]
    evidence = {
        "sdc_every_steps": cfg.supervisor.sdc_every_steps,
        "dp_replicate": cfg.parallel.dp_replicate,
        "checks_run": sdc.get("checks"),
        "mismatches": sdc.get("mismatches"),
        "overhead": sdc.get("overhead"),
        "false_positive_tolerance": 0,
        "comparison": "exact (bitwise parameter fingerprints): a healthy replica never differs",
        "ecc": next((e for e in ecc if e), None),
    }
    if cfg.parallel.dp_replicate < 2:
        return Item(
            4,
            "consistency",
            WARN,
            "parallel.dp_replicate=1: no replica to compare, silent corruption "
            "cannot be detected (use dp_replicate >= 2, HSDP)",
            evidence,
        )
    if not sdc.get("checks"):
        return Item(4, "consistency", FAIL, "no replica check ran during the probe", evidence)
    if sdc.get("mismatches"):
        return Item(
            4,
            "consistency",
            FAIL,
            f"{sdc['mismatches']} replica mismatch(es) on a healthy fleet: a device corrupts data",
            evidence,
        )
    notes = []
    if not cfg.supervisor.sdc_every_steps:
        notes.append("supervisor.sdc_every_steps is not set: training will not run these checks")
    if evidence["ecc"] is None:
        notes.append("ECC state not reported by this platform")
    status = WARN if notes else PASS
    return Item(
        4,
        "consistency",
        status,
        f"{sdc['checks']} check(s), 0 mismatches, overhead "
        f"{(sdc.get('overhead') or 0):.1%} of step time" + ("; " + "; ".join(notes) if notes else ""),
        evidence,
    )


def check_data(cfg: Config) -> Item:
    if cfg.data.source == "bundled" or (index := read_index(cfg.data.source, dict(cfg.data.storage_options))) is None:
        return Item(
            5,
            "data",
            WARN,
            f"data.source={cfg.data.source!r} has no curation report: run `raysc curate` "
            f"and `raysc pack` and train on the packed directory",
            {"source": cfg.data.source},
        )
    domains = {k: v["sequences"] for k, v in index["domains"].items()}
    evidence: dict = {"source": cfg.data.source, "domains": domains, "schedule": cfg.data.schedule or "natural"}
    problems = [f"domain {k!r} has no sequences" for k, v in domains.items() if v == 0]
    try:
        for phase in parse_schedule(cfg.data.schedule or "0:" + ",".join(f"{k}=1" for k in domains), list(domains)):
            missing = [d for d in phase.weights if not domains.get(d)]
            problems += [
                f"the schedule weights {d!r} (phase at {phase.start_tokens} tokens), which is empty" for d in missing
            ]
    except ValueError as e:
        problems.append(f"data.schedule: {e}")
    report = _curation_report(cfg, index)
    if report is None:
        problems.append("no report.json of `raysc curate` found beside the packed data")
    else:
        read = report["documents"]["read"] or 1
        evidence["removed_share"] = {k: round(v / read, 4) for k, v in report["removed"].items()}
        evidence["kept_domains"] = report.get("domains")
    status = FAIL if problems else PASS
    return Item(
        5,
        "data",
        status,
        "; ".join(problems) or f"curation report: removed {evidence['removed_share']}; domains {domains}",
        evidence,
    )


def _curation_report(cfg: Config, index: dict) -> dict | None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(cfg.data.source, **dict(cfg.data.storage_options))
    for path in (index.get("curated"), root.rstrip("/").rsplit("/", 1)[0]):
        if path:
            try:
                return json.loads(fs.cat_file(f"{path}/report.json"))
            except (FileNotFoundError, OSError):
                continue
    return None


def check_hyperparameters(cfg: Config) -> Item:
    from pathlib import Path

    path = Path(cfg.run_dir) / "coord_check" / "coord_check.json"
    evidence = {"mup": cfg.model.mup, "coord_check": str(path)}
    if not path.is_file():
        return Item(
            6,
            "hyperparameters",
            WARN,
            f"no μP coordinate check for this model family ({path}): run "
            f"`raysc mup coord-check CONFIG` (and tune optim.lr at a small width)",
            evidence,
        )
    report = json.loads(path.read_text())
    verdict = str(report.get("verdict", ""))
    evidence["verdict"] = verdict
    if not cfg.model.mup:
        return Item(
            6,
            "hyperparameters",
            WARN,
            "a coordinate check exists but model.mup is off: learning rates tuned at another width will not transfer",
            evidence,
        )
    ok = verdict.lower().startswith("pass")
    return Item(6, "hyperparameters", PASS if ok else WARN, f"μP coordinate check: {verdict}", evidence)


SERVE_FROM_TRAIN = {  # serving precision -> training precisions that export to it safely
    "bf16": {"bf16", "fp32"},
    "fp16": {"fp32"},
    "fp8": {"bf16", "fp32"},
    "int8": {"bf16", "fp32"},
    "int4": {"bf16", "fp32"},
}


def check_serving(cfg: Config, measured: dict | None = None) -> Item:
    """Item 7. ``measured``: the probe checkpoint quantized with ``serve.quantization``'s method
    (``raysc.preflight.quantized``), or ``{"error": ...}`` when that failed."""
    q = cfg.serve.quantization
    train = cfg.compute_dtype
    evidence = {"quantization": q or None, "training_precision": train}
    if not q:
        return Item(7, "serving", WARN, "no inference quantization named (serve.quantization)", evidence)
    if train not in SERVE_FROM_TRAIN[q]:
        return Item(
            7,
            "serving",
            WARN,
            f"serving in {q} from {train} training: bf16's range exceeds fp16's, "
            f"activations may overflow; check them or serve in bf16",
            evidence,
        )
    if measured is None:
        return Item(
            7,
            "serving",
            PASS,
            f"serve in {q}, trained in {train} (not measured: no quantized checkpoint is needed for {q})",
            evidence,
        )
    evidence["measured"] = measured
    if "error" in measured:
        return Item(
            7,
            "serving",
            WARN,
            f"serve in {q}: quantizing the probe checkpoint failed, quality not measured: {measured['error']}",
            evidence,
        )
    rel, limit = measured["relative_increase"], cfg.serve.max_quality_loss
    status = PASS if rel <= limit else WARN if rel <= 2 * limit else FAIL
    text = (
        f"serve in {q} ({measured['method']}, {measured['bits']}-bit): held-out perplexity "
        f"{measured['perplexity_training_precision']:.3f} -> {measured['perplexity_quantized']:.3f} "
        f"({rel:+.2%}, limit serve.max_quality_loss={limit:.0%}) on the probe checkpoint (step "
        f"{measured['step']}); {measured['bytes'] / 1e6:.2f} MB vs {measured['full_precision_bytes'] / 1e6:.2f} MB"
    )
    if status != PASS:
        text += ": choose another serve.quantization (int8 loses least) or raise serve.max_quality_loss"
    return Item(7, "serving", status, text, evidence)


def check_timeouts(cfg: Config, ev: Evidence) -> Item:
    cal = _events(ev, EventKind.TIMEOUTS_CALIBRATED)
    stress = _events(ev, EventKind.COLLECTIVE_STRESS)
    sup = cfg.supervisor
    evidence = {
        "timeout_factor": sup.timeout_factor,
        "floor_s": sup.timeout_floor_s,
        "calibration": cal[-1] if cal else None,
        "stress": stress[-1] if stress else None,
    }
    if not cal:
        return Item(8, "timeouts", FAIL, "timeouts were not calibrated (supervisor.calibrate_steps=0)", evidence)
    c = cal[-1]
    problems = []
    if not 3 <= sup.timeout_factor <= 5:
        problems.append(f"supervisor.timeout_factor={sup.timeout_factor} is outside 3-5")
    if not stress or stress[-1]["timeouts"] or stress[-1]["ops"] == 0:
        problems.append(
            "the collective stress loop "
            + ("did not run" if not stress else f"hit {stress[-1]['timeouts']} timeout(s)")
        )
    status = FAIL if problems else PASS
    return Item(
        8,
        "timeouts",
        status,
        "; ".join(problems)
        or f"process-group timeout {c['pg_timeout_s']} s = max(floor {sup.timeout_floor_s} s, "
        f"{sup.timeout_factor}× max(step {c['step_time_s']} s, all-reduce {c['allreduce_s']} s)); "
        f"stress: {stress[-1]['ops']} collectives, slowest {stress[-1]['slowest_op_s']} s, no timeout",
        evidence,
    )
