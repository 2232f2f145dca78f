"""Shared fixtures: one Ray instance per session, one cached tiny corpus, a tiny-config factory; the
``gpu`` marker's selection (deselected by ``make test``, run by ``make test-gpu``); the two lanes
``make test`` runs side by side (``pytest -n 2``): the modules on this session's Ray and the modules
that start Ray clusters of their own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lanes import GPU_DESELECTED as _GPU_DESELECTED
from lanes import GPU_NOTICE, Lanes
from raysc.config import Config, load_config

TINY = [
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=64",
    "train.global_batch=8",
    "train.steps=20",
    "train.log_every=10",
    "schedule.warmup_steps=5",
    "data.max_corpus_mb=1.0",
    "data.tokenizer_sample_mb=0.5",
    "parallel.cpus_per_worker=1",
    # warm spares cost a process start per rank; on 2 cores that slows every test run, so only the
    # recovery tests that measure or rely on them turn them on
    "supervisor.warm_spares=false",
]


def mutate_words(text: str, frac: float, rng) -> str:
    """``text`` with each word replaced by a random new one with probability ``frac`` (a near copy)."""
    return " ".join(f"x{rng.random():.6f}" if rng.random() < frac else w for w in text.split())


# Every Ray this suite starts (the session's, the `ray start` head's, the local clusters') inherits these
# two; test_newcomer's, which drops other RAY_* settings to run the README's commands as a user does, the first.
# Ray starts its worker processes at niceness 15 (the raylet's `worker_niceness`) so its own daemons stay
# responsive; beside the other lane's processes at niceness 0 (forked gloo ranks, vLLM and llama.cpp
# servers, in-process training) a worker gets 1/28 of their share of a core. Measured on 2 cores: the
# 8-rank parity run through Ray took 20.5 s alone and 255 s beside two busy processes (start 94 s, median
# step 5.8 s against 0.38 s), 30 s with its workers at 0; the forked 8-rank test 16.4 s and 26 s. That
# starvation, not a fault, is what cut the 8-rank layout off at pytest's 300 s in the landing CIs of
# sessions 29-32. On a user's training nodes nothing at niceness 0 competes (docs/operations.md).
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray's log monitor looks for new log files 10 times a second until
# there are 1,000 of them (then every 0.5 s); a session's hundreds of worker logs made that 2.4% of a
# core per node, against 1.1% at 0.5 s (measured with 207 files). New workers' output reaches drivers
# <= 0.5 s later.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# A driver or worker gives up on a GCS that does not answer within this many seconds (Ray's default is 5:
# a CI run on a loaded 2-core machine had `raysc train` fail with "Timed out while waiting for GCS to become
# available" against a healthy head whose GCS was queueing requests for 3 s)
os.environ.setdefault("RAY_gcs_rpc_server_connect_timeout_s", "60")
# `ray start --head` gives its dashboard 60 s to come up (Ray's RAY_DASHBOARD_STARTUP_TIMEOUT_S): with one core
# kept busy by another process, a clean-clone CI's head missed it twice in a row ("Failed to start the dashboard")
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "240")
RAY_SUITE_ENV = (
    "RAY_worker_niceness",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD",
    "RAY_gcs_rpc_server_connect_timeout_s",
    "RAY_DASHBOARD_STARTUP_TIMEOUT_S",
)

_HEAD_STOP = pytest.StashKey[object]()  # stops the ray_head cluster (idempotent)


def _head_tests_together(items: list) -> None:
    """The tests on the separate ``ray_head`` cluster run one after another, where the first of them
    is: the head is started for them and stopped at the session's end, and would otherwise sit
    through the modules between them taking a share of the two cores."""
    head = [item for item in items if "ray_head" in getattr(item, "fixturenames", ())]
    if head:
        at = items.index(head[0])
        rest = [item for item in items if item not in head]
        items[:] = rest[:at] + head + rest[at:]


@pytest.hookimpl(trylast=True)  # after pytest's own -m selection
def pytest_collection_modifyitems(config, items):
    """The ``ray_head`` tests together (``_head_tests_together``). Tests marked ``gpu`` need CUDA.
    Without ``-m`` (``make test``) they are deselected, never skipped, and one line says so; selected
    (``make test-gpu`` = ``-m gpu``) on a machine without CUDA, the session stops with an error instead
    of passing with nothing run (``--collect-only`` still lists them)."""
    _head_tests_together(items)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    if not config.option.markexpr:
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)
        config.stash[_GPU_DESELECTED] = len(gpu)
        return
    import torch

    if not torch.cuda.is_available() and not config.option.collectonly:
        pytest.exit(
            f"{len(gpu)} GPU tests selected but torch {torch.__version__} sees no CUDA device "
            f"(CUDA build: {torch.version.cuda or 'none'}); run them on a machine with a GPU and a "
            f"CUDA build of torch",
            returncode=1,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The ``ray_head`` cluster stops after the last test that uses it (they run together:
    ``_head_tests_together``), not at the session's end: idle, its head, dashboard and metrics agents
    took ~8% of a core through the rest of the suite."""
    yield
    uses = "ray_head" in getattr(item, "fixturenames", ())
    if uses and (nextitem is None or "ray_head" not in getattr(nextitem, "fixturenames", ())):
        stop = item.config.stash.get(_HEAD_STOP, None)
        if stop is not None:
            stop()


def pytest_report_collectionfinish(config, start_path, items):
    n = config.stash.get(_GPU_DESELECTED, 0)
    return [GPU_NOTICE.format(n=n)] if n else []


def pytest_configure(config):
    config.pluginmanager.register(Lanes(), "raysc-lanes")


@pytest.fixture
def one_torch_thread():
    """torch's intra-op threads set to 1 for the test (the other lane has the other core), then put back."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("raysc-cache"))


@pytest.fixture
def make_cfg(cache_dir, tmp_path):
    """A tiny config whose run directory lives in this test's tmp_path."""

    def make(*overrides: str, run: str = "run") -> Config:
        return load_config(None, [*TINY, f'data.cache_dir="{cache_dir}"', f'run.dir="{tmp_path / run}"', *overrides])

    return make


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # address="local": a new instance even when another cluster on this machine (the local multi-node
    # cluster of test_multinode, `ray start` of ray_head) recorded itself as the one to join.
    # num_cpus=8 on 2 cores: the session's tests run 4- and 8-rank layouts side by side with Serve. It
    # cannot hide a newcomer's failure because the README's own commands are tested on a Ray with the
    # machine's real CPU count in their own processes: tests/test_newcomer.py (`raysc train` then
    # `raysc serve`) and tests/test_connect.py (`raysc preflight` of a recipe that does not fit)
    ray.init(address="local", num_cpus=8, include_dashboard=False, configure_logging=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _no_placement_group_left(request):
    """A test on this session's Ray leaves no raysc placement group standing (raysc.fleet.groups): a
    leftover holds CPUs the later tests' fleets need, and a CI run then failed an unrelated test on "could
    not reserve". This names the test that left it, and removes it so the next ones run."""
    yield
    if "ray_session" not in request.fixturenames:
        return
    import ray

    if not ray.is_initialized():
        return
    from raysc.fleet.groups import remove_groups_of, standing_groups

    left = standing_groups()
    if left:
        for name in set(left.values()):
            remove_groups_of(name.removeprefix("raysc-").rsplit("-", 1)[0])
        pytest.fail(
            f"placement group(s) {sorted(left.values())} were left standing on the session's Ray", pytrace=False
        )


@pytest.fixture(scope="session")
def hf_folders() -> dict:
    """Hugging Face tokenizer folders of real public vocabularies (Llama 3, Llama 2, Qwen2, GPT-2), by
    llama.cpp's names: ``llama_vocab.build_folders``."""
    from llama_vocab import build_folders

    return build_folders()


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto) on 127.0.0.1 for the object-store tests; yields its endpoint."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server._server.server_address
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
    )
    yield {"endpoint": endpoint, "client": client, "server": server}
    server.stop()


def s3_options(endpoint: str) -> str:
    return (
        f'checkpoint.storage_options={{endpoint_url = "{endpoint}", key = "testing", '
        f'secret = "testing-secret", region_name = "us-east-1"}}'
    )


_HEAD_WHY = pytest.StashKey[object]()  # says why the ray_head cluster is gone, or None while it is up


def _ray_head_death(head, out: Path, temp: Path) -> str | None:
    """None while the ``ray_head`` cluster's `ray start --block` runs; else its exit and its logs' tails.
    `--block` kills the whole cluster when any of its processes (GCS, raylet, dashboard, an agent, the
    log monitor) exits unexpectedly, and says which in its own output: a CI once lost the head between
    tests with no log left to say why."""
    code = head.poll()
    if code is None:
        return None
    parts = [f"`ray start --head --block` exited {code}; its output ({out}):\n{_tail(out)}"]
    logs = temp / "session_latest" / "logs"
    for name in (
        "ray_process_exit.log",
        "gcs_server.out",
        "gcs_server.err",
        "dashboard.log",
        "raylet.out",
        "monitor.log",
    ):
        if (logs / name).is_file():
            parts.append(f"{name}:\n{_tail(logs / name)}")
    return "\n".join(parts)


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed ``ray_head`` test's report says whether that cluster is still up, and if not, why."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _lead_with_the_run_trail(report)
    why = item.config.stash.get(_HEAD_WHY, None)
    if report.failed and call.when == "call" and why is not None and "ray_head" in getattr(item, "fixturenames", ()):
        report.sections.append(("ray_head cluster", why() or "still up"))


def _lead_with_the_run_trail(report, lines: int = 40) -> None:
    """A failed test's report leads with the last ``[raysc]`` lines its runs printed (the supervisor's
    events as the driver relayed them): CI's record keeps the head and the tail of the output only, and
    a run's own account (restarts, hangs, timeouts) scrolled out of it behind Ray's worker logs."""
    trail = [
        line
        for name, text in report.sections
        if name.startswith("Captured stdout")
        for line in text.splitlines()
        if line.startswith("[raysc]")
    ]
    if trail:
        report.sections.insert(
            0,
            (
                f"raysc events (last {min(lines, len(trail))} of {len(trail)})",
                "\n".join(line[:300] for line in trail[-lines:]),
            ),
        )


@pytest.fixture
def ray_head(_ray_head_cluster, request):
    """The ``ray_head`` cluster (``_ray_head_cluster``), checked before each test that uses it: a test
    after the cluster died fails at once with why, not after its own timeouts."""
    why = request.config.stash[_HEAD_WHY]()
    if why is not None:
        pytest.fail(f"the ray_head cluster is gone before this test:\n{why}", pytrace=False)
    return _ray_head_cluster


@pytest.fixture(scope="session")
def _ray_head_cluster(request, tmp_path_factory):
    """A separate local cluster started with `ray start --head` (job server included), as users run
    one; yields its dashboard address (for `ray job`, `ray.util.state`), its GCS address (RAY_ADDRESS
    for drivers), the environment to run Ray commands in and its temp dir (Prometheus's service
    discovery file). Stopped, with everything it started, after the last test that uses it
    (``pytest_runtest_teardown``) or at the end of the session."""
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    from raysc.cluster.ports import free_ports

    ray_bin = str(Path(sys.executable).parent / "ray")
    temp = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_DEDUP_LOGS"] = "0"
    for name in RAY_SUITE_ENV:  # as every Ray of the suite
        env[name] = os.environ[name]
    env["RAY_AUTH_MODE"] = "disabled"  # a loopback-only test cluster: no token to distribute
    # metrics reach the node's exporter every second, not every 10 s (tests/test_grafana.py scrapes them)
    env["RAY_metrics_report_interval_ms"] = "1000"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # an activated venv
    names = [
        "port",
        "dashboard-port",
        "ray-client-server-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
        "node-manager-port",
        "object-manager-port",
    ]
    kept = tmp_path_factory.mktemp("ray-head")  # outlives the temp dir: its output, and its logs if it died
    out = kept / "ray-start.out"

    def start() -> tuple[subprocess.Popen, dict]:
        ports = dict(zip(names, free_ports(len(names))))  # distinct, outside the ephemeral range (ports.py)
        with open(out, "a") as log:
            head = subprocess.Popen(
                [
                    ray_bin,
                    "start",
                    "--head",
                    "--block",
                    "--num-cpus=4",
                    "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1",
                    f"--temp-dir={temp}",
                    *[f"--{k}={v}" for k, v in ports.items()],
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return head, ports

    head, ports = start()
    address = f"http://127.0.0.1:{ports['dashboard-port']}"

    def stop() -> None:
        if head.poll() is not None and (temp / "session_latest" / "logs").is_dir():  # it died on its own
            shutil.copytree(temp / "session_latest" / "logs", kept / "logs", dirs_exist_ok=True)
            print(f"the ray_head cluster had died; its logs are kept in {kept / 'logs'}")
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:  # (it often takes over 10 s doing so; nothing of this test cluster needs to be kept)
                head.wait(timeout=3)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait()
        # anything of that cluster still alive (never `ray stop`: it would stop the test session's Ray)
        subprocess.run(["pkill", "-9", "-f", str(temp)], check=False)
        shutil.rmtree(temp, ignore_errors=True)

    request.config.stash[_HEAD_STOP] = stop
    request.config.stash[_HEAD_WHY] = lambda: _ray_head_death(head, out, temp)
    try:
        # Ray's own start-up gives the raylet 30 s to register with the GCS (ray._private.node, not
        # configurable): on a loaded 2-core machine `ray start` once exited 1 with "The current node timed
        # out during startup ... the GCS has become overloaded". The job server gets 180 s, and a head that
        # exits on its way up is started once more (its output kept in ray-start.out) before the tests fail
        for attempt in (1, 2):
            deadline = time.monotonic() + 180
            while (
                head.poll() is None
                and subprocess.run(
                    [ray_bin, "job", "list", "--address", address], env=env, capture_output=True
                ).returncode
                != 0
            ):
                assert time.monotonic() < deadline, f"the head's job server did not answer within 180 s:\n{_tail(out)}"
                time.sleep(0.5)
            if head.poll() is None:
                break
            why = _ray_head_death(head, out, temp)
            assert attempt == 1, f"Ray itself did not start (twice) for the ray_head cluster:\n{why}"
            print(f"`ray start --head` exited on its way up; starting it once more. {why}")
            subprocess.run(["pkill", "-9", "-f", str(temp)], check=False)
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir()
            head, ports = start()
            address = f"http://127.0.0.1:{ports['dashboard-port']}"
        yield {"address": address, "gcs": f"127.0.0.1:{ports['port']}", "env": env, "ray": ray_bin, "temp": temp}
    finally:
        stop()


def live_actors(address: str, besides: set[str] = frozenset()) -> list:
    """Actors of the cluster at ``address`` that are not DEAD (the job server's own and ``besides`` excepted)."""
    from ray.util.state import list_actors

    return [
        a
        for a in list_actors(
            address=address, filters=[("state", "!=", "DEAD")], limit=1000, raise_on_missing_output=False
        )
        if a.class_name != "JobSupervisor" and a.actor_id not in besides
    ]


_POOL_IDS = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
ids = []
for a in ray.util.list_named_actors(all_namespaces=True):
    if a["name"].startswith("raysc-worker-pool-"):
        try:  # a pool listed a moment ago may be gone now: it then keeps nothing alive
            pool = ray.get_actor(a["name"], namespace=a["namespace"])
            ids += [pool._actor_id.hex(), *(w._actor_id.hex() for w in ray.get(pool.idle_workers.remote()))]
        except (ValueError, ray.exceptions.RayActorError):
            continue
print(json.dumps(ids))
"""


def pool_actor_ids(cluster: dict) -> set[str]:
    """The ``ray_head`` cluster's worker pools (``raysc.fleet.pool``) and their idle workers: what a run
    that ended leaves alive by design (asked in a driver of its own: this process is on another cluster)."""
    import json
    import subprocess
    import sys

    for _ in range(3):  # a landing CI once saw this driver exit 1 with its stderr unseen: say why, try again
        done = subprocess.run(
            [sys.executable, "-c", _POOL_IDS, cluster["gcs"]],
            env=cluster["env"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode == 0:
            return set(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"pool_actor_ids: the listing driver exited {done.returncode}: {done.stderr[-3000:]}")
    raise AssertionError(f"pool_actor_ids: the listing driver failed 3 times: {done.stderr[-3000:]}")


@pytest.fixture(scope="session")
def packed_corpus(ray_session, cache_dir, tmp_path_factory):
    """The bundled corpus (1 MB) curated without quality filtering, then packed at seq_len 64 with a
    512-token tokenizer that `raysc pack` trains itself; shared by the pack, training and mixture-tuning tests."""
    from raysc.config import load_config
    from raysc.curate.pack import pack_curated
    from raysc.curate.pipeline import curate

    root = tmp_path_factory.mktemp("packed-corpus")
    cfg = load_config(
        None, [*TINY, f'data.cache_dir="{cache_dir}"', f'curate.output="{root / "cur"}"', "quality.enabled=false"]
    )
    curate(cfg, log=lambda *_: None)
    index = pack_curated(str(root / "cur"), None, 512, 64, str(root / "packed"), log=lambda *_: None, sample_mb=0.5)
    return {"root": root, "index": index, "packed": str(root / "packed")}
