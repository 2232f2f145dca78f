"""Elastic runs (``parallel.elastic``): the sizes an elastic run may take, the fingerprint that shows its
sample sequence, and, on a local autoscaling cluster (Ray's own autoscaler with its fake multi-node
provider), a tp=2 x dp_replicate=2 run that loses a node with no replacement in time, continues at
dp_replicate=1, grows back to 2 when the autoscaler adds a node, and trains on the uninterrupted run's
samples with its losses until it is stopped (the uninterrupted run: the same config in one process)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY
from raysc.cluster.local import ClusterState
from raysc.config.checks import ConfigError
from raysc.config.load import config_hash, load_config
from raysc.data.fingerprint import rows_fingerprint
from raysc.fleet.elastic import Elastic, configured_sizes, min_world
from raysc.fleet.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")
# fp32 reduction order only: dp=1 accumulates two micro-batches where dp=2 all-reduces two gradients;
LOSS_ATOL = 1e-5  # measured 2.4e-7 (40 steps, tiny model)


def _cfg(*overrides: str):
    return load_config(ROOT / "jobs/configs/tiny.toml", [*TINY, *overrides])


def test_sizes_keep_the_micro_batch_and_the_hash():
    cfg = _cfg("parallel.elastic=true", "parallel.dp_replicate=4", "parallel.tp=2", "train.global_batch=16")
    assert configured_sizes(cfg) == [4, 2, 1] and min_world(cfg) == 2  # 3 would split 16 rows unevenly
    before = config_hash(cfg)
    el = Elastic(cfg)
    assert cfg.train.micro_batch == 4  # the configured local batch: a smaller fleet accumulates
    el.resize(1)
    assert (cfg.parallel.world_size, el.world(4), config_hash(cfg)) == (2, 8, before)
    pp = _cfg(
        "parallel.elastic=true",
        "parallel.dp_shard=4",
        "parallel.elastic_dim=dp_shard",
        "parallel.pp=2",
        "parallel.pp_microbatches=2",
        "train.global_batch=16",
        "model.tie_embeddings=false",
    )
    el = Elastic(pp)
    el.resize(2)
    assert pp.parallel.pp_microbatches == 4 and pp.train.micro_batch == 0  # 2 rows a microbatch at every size
    fixed = _cfg("parallel.dp_replicate=2", "parallel.tp=2")
    assert min_world(fixed) == 4
    # a fault for a rank the shrunk fleet lacks waits for it; the configured size still bounds the ranks
    shrunk = _cfg("parallel.elastic=true", "parallel.dp_replicate=1", 'supervisor.inject="node_loss@9:1"')
    assert shrunk.parallel.world_size == 1
    with pytest.raises(ConfigError, match="rank 1 in 'node_loss@9:1' does not exist"):
        Elastic(shrunk)
    with pytest.raises(ConfigError, match="min_dp=3 is larger than parallel.dp_replicate=2"):
        _cfg("parallel.elastic=true", "parallel.dp_replicate=2", "parallel.min_dp=3")


def test_the_batch_fingerprint_ignores_the_split_and_sees_other_rows():
    rows = torch.randint(0, 50_000, (16, 65))
    prime = 2**31 - 1
    whole = rows_fingerprint(rows)
    for parts in (2, 4, 16):
        assert sum(rows_fingerprint(p) for p in rows.chunk(parts)) % prime == whole
    assert rows_fingerprint(rows[torch.randperm(16)]) == whole
    other = rows.clone()
    other[3, 7] += 1
    assert rows_fingerprint(other) != whole
    assert rows_fingerprint(torch.cat([rows[:15], rows[:1]])) != whole  # a row twice, another missing


def _command(run_dir: Path, cache_dir: str, steps: int, *overrides: str) -> list[str]:
    cmd = [RAYSC, "train", "jobs/configs/tiny.toml", "--no-progress"]
    for s in [
        *TINY,
        f"train.steps={steps}",
        "checkpoint.every_steps=5",
        "parallel.tp=2",
        "parallel.dp_replicate=2",
        f'data.cache_dir="{cache_dir}"',
        f'run.dir="{run_dir}"',
        *overrides,
    ]:
        cmd += ["--set", s]
    return cmd


def _train_until_grown(
    st: ClusterState, run_dir: Path, cache_dir: str, steps: int, *overrides: str, timeout_s: float = 400
) -> int:
    """Run until the fleet has grown back and trained a step at its configured size, then stop the run as
    `ray job stop` does (SIGTERM: it stops at a step boundary and commits that step). Waits on the event,
    not a number of slow steps: how long the autoscaler takes to add a node depends on the machine's load
    (a fixed 36 s of slow steps once ran out in a CI lane). Once the run has shrunk, the cluster may grow to
    three nodes (`_two_nodes` holds it at two until then). The step the run stopped at."""
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    run = subprocess.Popen(
        _command(run_dir, cache_dir, steps, *overrides),
        env=st.env(),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while run.poll() is None and time.monotonic() < deadline:
            dps = [m["dp"] for m in read_jsonl(run_dir / "metrics.jsonl")]
            resized = [e["to"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resized"]
            if 1 in resized:
                _node_limits(st, max_nodes=3)  # a replacement may come now, after the shrink
            grown = 2 in resized
            if grown and 1 in dps and dps[-1] == 2:  # a step at dp 2 after the steps at dp 1
                run.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        code = run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        run.kill()
        log.close()
    out = (run_dir.parent / f"{run_dir.name}.log").read_text()
    events = read_jsonl(run_dir / "events.jsonl")
    assert code == 143, (
        code,
        out[-3000:],
        [{k: e.get(k) for k in ("kind", "step", "failed_step", "resumed_step", "from", "to", "error")} for e in events],
    )
    return [e for e in events if e["kind"] == "run_stopped"][0]["step"]


def _kept_steps(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics as the run kept them (a step re-run after a restore replaces the lost one)."""
    return {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}


def _uninterrupted(cache_dir: str, steps: int, total: int) -> dict[int, dict]:
    """The same run in this process, one rank, never interrupted (the parity harness holds every layout to
    one process; tests/test_parallel.py): the metrics of its first ``steps`` steps, of ``total``. Same data:
    the corpus the run packed, from the shared cache."""
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    cfg = load_config(ROOT / "jobs/configs/tiny.toml", [*TINY, f"train.steps={total}", f'data.cache_dir="{cache_dir}"'])
    packed, _, _ = prepare_data(cfg)
    trainer = Trainer(cfg, packed.train, packed.val, measure_peak=False)
    return {m["step"]: m for m in (trainer.train_step() for _ in range(steps))}


def _node_limits(st: ClusterState, **limits: int) -> None:
    """Change the autoscaling cluster's node limits (min_nodes, max_nodes) while it runs: its monitor reads
    the config again on every update, as after `ray up` on a running cluster."""
    from raysc.cluster.autoscaling import WORKER_TYPE

    config = Path(st.autoscale["config"])
    kept = json.loads(config.read_text())
    workers, before = kept["available_node_types"][WORKER_TYPE], json.dumps(kept)
    if "min_nodes" in limits:
        workers["min_workers"] = limits["min_nodes"]
    if "max_nodes" in limits:
        workers["max_workers"] = kept["max_workers"] = limits["max_nodes"]
    if json.dumps(kept) == before:
        return
    config.with_suffix(".tmp").write_text(json.dumps(kept, indent=1))
    config.with_suffix(".tmp").replace(config)  # the monitor never reads half a file


def _two_nodes(state: Path, tries: int = 3) -> ClusterState:
    """An autoscaling cluster with two 2-CPU nodes up before the run (its placement asks the autoscaler for
    nothing) and room for a third, which may be launched for the run once a node is lost. On a loaded
    machine Ray's autoscaler sometimes queues a third node at start (its node listing lags its launches:
    seen twice in CI beside the other test lane, in monitor.log); that node would take the lost node's
    ranks and the run would never shrink, so such a cluster is started again. Once the two are up, the
    autoscaler keeps no node by itself (min_workers 0 in its config, which its monitor reads again on every
    update, as after `ray up` on a running cluster): kept at 2, it launched a replacement the moment the
    lost node was declared dead, seconds before the restart looked for room, and in a landing CI the
    replacement was up in time and the run never shrank. With min_workers 0 the restart's own placement
    request still had a node launched and up within its 2 s wait (2 of 5 CIs: `workers_ready` 4 after the
    loss, no resize): the fake provider starts a node in seconds, a cloud in minutes. So the cluster is
    held at two nodes (max_workers 2) until the run has shrunk, then may grow to three for its growth
    request (`_train_until_grown`), as on a cloud whose replacement comes after the restart gave up waiting."""
    from raysc.cluster.autoscaling import alive_worker_nodes

    for _ in range(tries):
        up = subprocess.run(
            [
                RAYSC,
                "cluster",
                "local",
                "up",
                "--autoscale",
                "--nodes",
                "2",
                "--max-nodes",
                "3",
                "--cpus-per-node",
                "2",
                "--idle-timeout-s",
                "60",
                "--no-dashboard",
                "--state",
                str(state),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert up.returncode == 0, up.stderr[-2000:]
        st = ClusterState.read(state)
        deadline = time.monotonic() + 15  # the extra launch was queued 1.5-3 s after the first two
        while time.monotonic() < deadline and len(alive_worker_nodes(st)) == 2:
            time.sleep(1)
        if len(alive_worker_nodes(st)) == 2:
            _node_limits(st, min_nodes=0, max_nodes=2)
            return st
        subprocess.run([RAYSC, "cluster", "local", "down", "--state", str(state)], capture_output=True, timeout=120)
    raise AssertionError(f"the autoscaler started more than the 2 nodes asked for, {tries} times")


def test_a_run_shrinks_on_a_lost_node_and_grows_back_on_the_uninterrupted_runs_samples(cache_dir, tmp_path):
    state = tmp_path / "state.json"
    st = _two_nodes(state)
    try:
        el_dir = tmp_path / "elastic"
        # rank 2 sits on the second node (two 2-CPU nodes, ranks placed in node order); the slow steps after
        # the loss (3 s each) give the autoscaler time to add a node while the run trains at dp_replicate=1,
        # as long as it needs (up to ~3 min): the run is stopped once it has grown back
        total = 80
        slow = ",".join(f"slow@{s}:0" for s in range(14, total - 5))
        stopped = _train_until_grown(
            st,
            el_dir,
            cache_dir,
            total,
            "parallel.elastic=true",
            "parallel.min_dp=1",
            "supervisor.node_wait_s=2",
            f'supervisor.inject="node_loss@13:2,{slow}"',
        )
        events = read_jsonl(el_dir / "events.jsonl")
        resized = [e for e in events if e["kind"] == "resized"]
        print(json.dumps(resized, indent=1))
        assert [(e["from"], e["to"]) for e in resized] == [(2, 1), (1, 2)], [
            {k: e.get(k) for k in ("kind", "step", "time", "failed_step", "resumed_step", "seconds", "error")}
            for e in events
        ]
        assert "node was lost" in resized[0]["why"] and resized[0]["steps_lost"] == 2  # restored step 10
        assert resized[1]["steps_lost"] == 0
        ref, el = _uninterrupted(cache_dir, stopped, total), _kept_steps(el_dir)
        assert sorted(el) == sorted(ref) == list(range(1, stopped + 1))
        assert {m["dp"] for m in el.values()} == {1, 2}
        assert [el[s]["data_fp"] for s in ref] == [ref[s]["data_fp"] for s in ref]  # the same rows, every step
        worst = max(abs(el[s]["loss"] - ref[s]["loss"]) for s in ref)
        print(f"largest loss difference to the uninterrupted run: {worst:.2e}")
        assert worst <= LOSS_ATOL
        status = subprocess.run([RAYSC, "status", str(el_dir), "--json"], capture_output=True, text=True, timeout=60)
        shown = json.loads(status.stdout)
        assert shown["dp"] == 2 and len(shown["resizes"]) == 2 and "dp_replicate 2->1" in shown["resizes"][0]
    finally:
        subprocess.run([RAYSC, "cluster", "local", "down", "--state", str(state)], capture_output=True, timeout=120)
