"""A chaos soak: one run on a local multi-node cluster through a seeded random schedule of faults of
every kind, and what became of each (the reliability table of docs/resilience.md).

Setup: ``raysc cluster local`` with NODES worker nodes of 2 CPUs (real raylets, object stores and
node ids on this machine), the test suite's tiny Llama, three data-parallel replicas of one CPU each
(``parallel.dp_replicate = 3``: a flipped bit is outvoted and repaired; a lost node leaves room on
the others), a replica check every step, an asynchronous checkpoint (the default) every EVERY steps to an
S3-compatible store (moto on 127.0.0.1) behind an HTTP proxy that can refuse writes
(``tests/s3_fault_proxy.py``), every committed checkpoint kept (so none may be missing at the end).
Every run is ``raysc train`` as users run it.

The schedule (``raysc.fleet.chaos.make_schedule``, seeded): FAULTS faults, each of kill, hang, raise,
kill_save, node_loss, store_outage, slow, nan, spike, bitflip at least once, at random steps and
ranks, spaced so each heals before the next fires. ``store_outage@S``: the proxy answers every write
of checkpoint S with 503 ServiceUnavailable (the save retries, fails and is cleaned up; the next
checkpoint commits).

Exactness. nan and spike skip an update and a flipped bit reaches the gradients of its step before
the replica check repairs it: they change the numbers on purpose. The reference run is therefore the
same config, uninterrupted, with only those faults, at the same steps and ranks (they are
deterministic); every other fault (kill, hang, raise, kill_save, node_loss, store outage, slow) must
then leave the final parameters bit-equal to the reference, and the report says whether they are.

Definitions (see ``raysc.fleet.chaos``): fired = the fault's own event (``fault_injected``; for an
outage, a failed upload of that step); detected = the event of its detector; healed = the event that
ends it; MTTR = seconds from the fault's event (an outage: the proxy's first refused request) to the
healing event (``recovered`` for kinds that restart the fleet, ``sdc_repaired``, ``update_skipped``,
``slow_step``, or for an outage the next ``checkpoint_saved``); steps lost = ``steps_lost`` of the
healing event; committed checkpoints lost = steps of ``checkpoint_saved`` events that
``raysc ckpt list --json --checksums`` does not list as committed and verified.

    python benchmarks/chaos.py [--seed 2026] [--faults 12] [--nodes 4]

Prints progress, then the report as JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import common  # noqa: E402

RAYSC = str(Path(sys.executable).parent / "raysc")
EVERY = 4
MODEL = [
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=64",
    "train.global_batch=6",
    "schedule.warmup_steps=5",
    "data.max_corpus_mb=1.0",
    "data.tokenizer_sample_mb=0.5",
    "train.log_every=1000",
]
SETTINGS = [
    *MODEL,
    "parallel.dp_replicate=3",
    "parallel.cpus_per_worker=1",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep_last=1000",  # asynchronous saves, the default: a fault may meet a save in flight
    "checkpoint.upload_retries=2",
    "supervisor.sdc_every_steps=1",
    "supervisor.warm_spares=false",
    "supervisor.restart_backoff_s=0.1",
    # the floor of the calibrated timeouts: above the 3-s straggle of `slow`, so a straggler is not a hang
    "supervisor.timeout_floor_s=6",
    "supervisor.max_restarts=5",
]


def storage_options(endpoint: str) -> str:
    opts = ", ".join(f'{k} = "{v}"' for k, v in common.s3_options(endpoint).items())
    return f"checkpoint.storage_options={{{opts}}}"


def train(env: dict, run_dir: Path, sets: list[str], timeout: float = 540) -> subprocess.CompletedProcess:
    cmd = [RAYSC, "train", "jobs/configs/tiny.toml", "--no-progress"]
    for s in [*SETTINGS, *sets, f'run.dir="{run_dir}"', f'data.cache_dir="{ROOT / ".cache/raysc"}"']:
        cmd += ["--set", s]
    t0 = time.monotonic()
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(f"  {run_dir.name}: exit {run.returncode} in {time.monotonic() - t0:.0f}s", flush=True)
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
    return run


def committed_steps(uri: str, endpoint: str) -> list[int]:
    """Steps ``raysc ckpt list --json --checksums`` lists as committed and verified."""
    out = subprocess.run(
        [
            RAYSC,
            "ckpt",
            "list",
            uri,
            "--storage-options",
            json.dumps(common.s3_options(endpoint)),
            "--json",
            "--checksums",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return [r["step"] for r in json.loads(out.stdout.strip().splitlines()[-1]) if r["verified"] == "yes"]


def params_equal(a: Path, b: Path) -> bool:
    import torch

    from raysc.export.restore import load_run

    pa, pb = (dict(load_run(d).model.named_parameters()) for d in (a, b))
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def main() -> None:
    from raysc.cluster import local
    from raysc.fleet import chaos
    from raysc.fleet.records import read_jsonl
    from raysc.plan import goodput
    from s3_fault_proxy import FaultProxy

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--faults", type=int, default=12)
    p.add_argument("--nodes", type=int, default=4)
    args = p.parse_args()
    schedule = chaos.make_schedule(args.seed, n=args.faults, world=3, every=EVERY, first=2 * EVERY)
    print(f"seed {args.seed}: {schedule.steps} steps, faults {[f.spec for f in schedule.faults]}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-chaos-"))
    server, endpoint, bucket = common.start_s3()
    proxy = FaultProxy(endpoint)
    first_refused: dict[str, float] = {}
    match = proxy._match

    def timed_match(line: str):  # when the outage began: the first refused request of each rule
        rule = match(line)
        if rule is not None:
            first_refused.setdefault(rule.pattern, time.time())
        return rule

    proxy._match = timed_match
    for k, v in (("AWS_ACCESS_KEY_ID", common.S3_KEY), ("AWS_SECRET_ACCESS_KEY", common.S3_SECRET)):
        os.environ[k] = v  # config.toml has the secrets redacted: load_run reads them from here
    state = tmp / "cluster.json"
    t0 = time.monotonic()
    st = local.up(nodes=args.nodes, cpus_per_node=2, state=state, dashboard=False)
    print(f"local cluster: {args.nodes} worker nodes x 2 CPUs in {time.monotonic() - t0:.0f}s", flush=True)
    try:
        env = st.env()
        steps = f"train.steps={schedule.steps}"
        ref = train(
            env,
            tmp / "reference",
            [
                steps,
                f'checkpoint.uri="s3://{bucket}/reference"',
                storage_options(endpoint),
                f'supervisor.inject="{chaos.reference_spec(schedule)}"',
            ],
        )
        patterns = {}
        for s in chaos.outage_steps(schedule):
            patterns[s] = chaos.outage_pattern(bucket, "chaos", s)
            proxy.fail(patterns[s], "ServiceUnavailable", status=503)
        run = train(
            env,
            tmp / "chaos",
            [
                steps,
                f'checkpoint.uri="s3://{bucket}/chaos"',
                storage_options(proxy.endpoint),
                f'supervisor.inject="{chaos.inject_spec(schedule)}"',
            ],
        )
        proxy.clear()
        events = read_jsonl(tmp / "chaos" / "events.jsonl")
        ref_end = [e for e in read_jsonl(tmp / "reference" / "events.jsonl") if e["kind"] == "run_end"]
        equal = params_equal(tmp / "reference", tmp / "chaos") if ref.returncode == 0 and run.returncode == 0 else None
        rep = chaos.report(
            schedule,
            events,
            committed_steps(f"s3://{bucket}/chaos", endpoint),
            outage_start={s: first_refused[p] for s, p in patterns.items() if p in first_refused},
            params_equal=equal,
        )
        # raysc plan --goodput's model at the drill's own failure rate and costs, beside what it measured
        model = goodput.drill(events, read_jsonl(tmp / "chaos" / "metrics.jsonl"), EVERY)
    finally:
        local.down(state)
        proxy.close()
        server.stop()
    for r in rep["per_fault"]:
        print(
            f"  {r['fault']:18} fired={r['fired']} detected={r['detected']} healed={r['healed']} "
            f"by={r.get('healed_by')} mttr={r['mttr_s']}s steps_lost={r['steps_lost']}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "benchmark": "chaos",
                "seed": args.seed,
                "nodes": args.nodes,
                "cpus_per_node": 2,
                "layout": "dp_replicate=3, 1 CPU per worker",
                "checkpoint_every": EVERY,
                "steps": schedule.steps,
                "exit_codes": {"reference": ref.returncode, "chaos": run.returncode},
                "reference_inject": chaos.reference_spec(schedule),
                **{k: v for k, v in rep.items() if k != "per_fault"},
                "reference": {k: ref_end[0].get(k) for k in ("goodput", "wall_s")} if ref_end else None,
                "goodput_model": model,
                "per_fault": [
                    {k: r[k] for k in ("fault", "fired", "detected", "healed", "mttr_s", "steps_lost")}
                    for r in rep["per_fault"]
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
