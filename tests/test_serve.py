"""raysc serve: a training run answered by vLLM inside Ray Serve LLM, through the official ``openai``
client, from the run's export in an object store (``raysc serve s3://...``: the replica mirrors it
from the project's local S3 server with the endpoint and credentials the driver hands it); bad input,
the API key, a client that disconnects, 100 concurrent streams, a killed replica, and following a run
that is still training with ``--follow --draft`` (speculative decoding with a draft model, exact at T=0).

One vLLM deployment for the module, started twice: once by the module, once by the --follow roll
(which also brings the app back after the replica kill).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

from conftest import TINY
from greedy_check import greedy_mismatches
from raysc.cli import build_parser
from raysc.config import load_config
from raysc.data.tokenizer import load_tokenizer
from raysc.export.restore import load_run
from raysc.model.generate import generate

KEY = "test-serving-key-0123456789"
S3_SECRET = "serve-s3-secret-5f0c1d"  # the object store's secret key (moto accepts any)
PORT = 8471
# head_dim 32: vLLM's CPU attention has no kernel for the conftest model's head_dim 16
MODEL = [
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "train.steps=20",
    "checkpoint.every_steps=10",
    "checkpoint.keep_last=10",
]
PROMPTS = [
    "def ",
    "import ",
    "class ",
    "return self.",
    "for i in range(",
    "if __name__",
    "x = [",
    "print(",
    "    def __init__(self",
    "from . import",
    "try:\n    ",
    "while True:",
    "with open(",
    "raise ",
    "# ",
    "lambda x:",
]
NEW = 24


def _cfg(run_dir: Path, cache_dir: str, *extra: str):
    return load_config(
        None, [*TINY, *MODEL, f'data.cache_dir="{cache_dir}"', f'run.dir="{run_dir}"', f"serve.port={PORT}", *extra]
    )


def _greedy(run_dir: Path, step: int, prompts: list[str]) -> list[list[int]]:
    run = load_run(run_dir, step)
    tok = load_tokenizer(run.tokenizer_path)
    return [generate(run.model, tok.encode(p).ids, NEW) for p in prompts]


def _served_ids(client, model_id: str, prompts: list[str]) -> list[list[int]]:
    out = [
        client.completions.create(
            model=model_id, prompt=p, max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True}
        )
        for p in prompts
    ]
    return [r.choices[0].token_ids for r in out]


def _cli(*argv: str):
    """``raysc serve ARGV`` as the command line parses it, and the config it selects."""
    from raysc.serve.command import cli_settings

    args = build_parser().parse_args(["serve", *argv])
    return args, cli_settings(args)


@pytest.fixture(scope="module")
def served(ray_session, s3_server, tmp_path_factory, cache_dir):
    """A run trained with its checkpoints in S3, exported there, and served with ``raysc serve s3://...``."""
    from raysc.fleet.driver import train
    from raysc.serve.command import deploy, undeploy
    from raysc.serve.source import export_run

    bucket = "raysc-serve"
    s3_server["client"].create_bucket(Bucket=bucket)
    endpoint = s3_server["endpoint"]
    store = [
        f'checkpoint.uri="s3://{bucket}/run"',
        f'checkpoint.storage_options={{endpoint_url = "{endpoint}", key = "serve", '
        f'secret = "{S3_SECRET}", region_name = "us-east-1"}}',
    ]
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    cfg = _cfg(run_dir, cache_dir, *store)
    train(cfg, progress=False)
    # the user's shell: the API key and the object store's credentials (config.toml has them redacted)
    env = {
        "RAYSC_API_KEY": KEY,
        "AWS_ACCESS_KEY_ID": "serve",
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    export = export_run(run_dir)  # what `raysc serve RUN_DIR` uploads beside the run's checkpoints
    assert export.path == f"s3://{bucket}/run/serve/step_00000020"
    t0 = time.perf_counter()
    args, serve_cfg = _cli(export.path, "--port", str(PORT), "--set", 'serve.model_id="tiny"')
    dep = deploy(args.source, serve_cfg, args.step, args.draft)
    print(f"deployed in {time.perf_counter() - t0:.1f} s")
    state = {
        "dep": dep,
        "run_dir": run_dir,
        "cfg": cfg,
        "store": store,
        "export": export,
        "client": openai.OpenAI(base_url=dep.url, api_key=KEY),
    }
    yield state
    undeploy(state["dep"])  # the rolled deployment, if a test rolled it
    from ray import serve

    serve.shutdown()  # Serve's controller and proxy: not left running through the rest of the session
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _vllm_processes() -> list[str]:
    """The titles vLLM gives its processes ("VLLM::EngineCore", "VLLM::Worker...") on this machine."""
    import psutil

    titles = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("VLLM::"):
            titles.append(cmd[0].split()[0])
    return sorted(titles)


def test_openai_client_completions_chat_streaming_models_and_usage(served):
    c, dep = served["client"], served["dep"]
    # the one-rank CPU model runs in vLLM's engine-core process: no worker process of its own to start
    # (raysc.serve.one_process; Ray Serve LLM's default adds a VLLM::Worker under the EngineCore)
    assert _vllm_processes() == ["VLLM::EngineCore"], _vllm_processes()
    assert [m.id for m in c.models.list().data] == [dep.model_id] == ["tiny"]
    assert dep.model.remote and dep.model.path == served["export"].path  # raysc serve s3://...
    # the export's own record says which checkpoint it is: reported, and a follower of the run rolls only
    # onto newer steps (test_a_killed_replica_...: onto step 30, not first onto step 20 again)
    assert (dep.model.step, dep.model.checkpoint) == (20, "s3://raysc-serve/run/step_00000020")
    # vLLM serves exactly the trained model (step 20, mirrored from S3): greedy, token for token (up to ties)
    ids = _served_ids(c, dep.model_id, PROMPTS)
    assert not greedy_mismatches(served["run_dir"], 20, PROMPTS, ids)
    served["ids_20"] = ids
    tok = load_tokenizer(served["run_dir"] / "tokenizer.json")
    got = [c.completions.create(model=dep.model_id, prompt=p, max_tokens=NEW, temperature=0) for p in PROMPTS[:4]]
    for p, r, i in zip(PROMPTS, got, ids):
        assert r.choices[0].text == tok.decode(i)
        assert r.usage.prompt_tokens == len(tok.encode(p).ids) and r.usage.completion_tokens == len(i)
    # streaming yields the same text, and its usage when asked
    chunks = list(
        c.completions.create(
            model=dep.model_id,
            prompt=PROMPTS[0],
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == got[0].choices[0].text
    assert chunks[-1].usage.completion_tokens == got[0].usage.completion_tokens
    # chat: the exported template renders a transcript ending in "assistant:"
    chat = c.chat.completions.create(
        model=dep.model_id, messages=[{"role": "user", "content": "def"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens == len(tok.encode("user: def\nassistant:").ids)


@pytest.mark.parametrize(
    "body,status,says",
    [
        ("{not json", 400, "not valid JSON"),
        (json.dumps({"model": "nope", "prompt": "x"}), 400, "unknown model"),
        (json.dumps({"model": "MODEL", "prompt": "x", "max_tokens": 0}), 400, "max_tokens must be a positive"),
        (json.dumps({"model": "MODEL", "prompt": "x", "temperature": -0.5}), 400, "temperature must be"),
        (json.dumps({"model": "MODEL", "prompt": "x " * 400, "max_tokens": 4}), 400, "maximum context length"),
    ],
)
def test_bad_input_gets_a_4xx_that_says_what_to_change_and_the_server_keeps_serving(served, body, status, says):
    dep = served["dep"]
    r = requests.post(
        f"{dep.url}/completions",
        data=body.replace("MODEL", dep.model_id),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status and says in r.text, r.text
    ok = served["client"].completions.create(model=dep.model_id, prompt="def ", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_api_key_is_required_and_never_written(served):
    dep = served["dep"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.post(
            f"{dep.url}/completions", json={"model": dep.model_id, "prompt": "x"}, headers=headers, timeout=30
        )
        assert r.status_code == 401 and "Authorization: Bearer" in r.text
    r = requests.get(f"{dep.url}/models", timeout=30)
    assert r.status_code == 401
    # the key is in no file the run, the export or Ray's logs hold; nor is the object store's secret
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    for root in (served["run_dir"], logs):
        for f in root.rglob("*"):
            if f.is_file() and f.stat().st_size < 50 << 20:
                data = f.read_bytes()
                assert KEY.encode() not in data and S3_SECRET.encode() not in data, f


def test_a_client_that_disconnects_mid_stream_does_not_leak(served):
    """vLLM aborts the request (its slot and KV blocks are freed): a full batch of new requests still
    completes with every token afterwards."""
    dep = served["dep"]
    for _ in range(4):
        with requests.post(
            f"{dep.url}/completions",
            stream=True,
            timeout=60,
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": dep.model_id, "prompt": "def ", "max_tokens": 40, "stream": True, "ignore_eos": True},
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith(b"data:"))  # the first token arrived; hang up
    results = asyncio.run(_streams(dep, n=dep.serve.max_num_seqs, max_tokens=30))
    assert all(n == 30 for n, _ in results)


async def _streams(
    dep, n: int, max_tokens: int, limit: int = 100, first_token: asyncio.Event | None = None
) -> list[tuple[int, str]]:
    """``n`` concurrent streaming completions (at most ``limit`` in flight); (tokens received, error).
    ``first_token`` is set when any stream has received its first token."""
    client = openai.AsyncOpenAI(base_url=dep.url, api_key=KEY, max_retries=0, timeout=300)
    gate = asyncio.Semaphore(limit)

    async def one(i: int) -> tuple[int, str]:
        async with gate:
            try:
                stream = await client.completions.create(
                    model=dep.model_id,
                    prompt=PROMPTS[i % len(PROMPTS)],
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage, finish = 0, None
                async for ch in stream:
                    if first_token is not None:
                        first_token.set()
                    if ch.choices and ch.choices[0].finish_reason:
                        finish = ch.choices[0].finish_reason
                    if ch.usage:
                        usage = ch.usage.completion_tokens
                # a stream that ends without a finish_reason was cut off: the client can tell
                return usage, "" if finish else "ended without finish_reason"
            except Exception as e:  # what the client saw
                return 0, type(e).__name__

    out = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return out


def test_100_concurrent_streams_complete(served):
    results = asyncio.run(_streams(served["dep"], n=100, max_tokens=12))
    assert [n for n, _ in results] == [12] * 100, results


def _llm_replicas() -> list[str]:
    import ray

    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and "LLMServer" in a["name"] and "REPLICA" in a["name"]
    )


def test_a_killed_replica_is_replaced_and_follow_draft_rolls_onto_a_training_run_exactly(served):
    """Kill the replica's process under 20 streams: every client can tell what it got, and Serve starts
    a replacement by itself. Meanwhile ``raysc serve RUN --follow --draft DRAFT`` (the command line's
    own code) watches the run train 10 more steps and rolls onto step 30 with a draft model (the run's
    step-20 export, k=3): that roll is the engine start which brings the app back, and its greedy output
    equals the new checkpoint's, token for token (speculation exact at T=0)."""
    import ray

    from raysc.fleet.driver import train
    from raysc.fleet.status import run_status
    from raysc.serve.command import keep_serving

    run_dir, dep = served["run_dir"], served["dep"]
    [replica] = _llm_replicas()

    async def load_then_kill():
        streaming = asyncio.Event()
        task = asyncio.ensure_future(_streams(dep, n=20, max_tokens=40, limit=20, first_token=streaming))
        await asyncio.wait_for(streaming.wait(), 120)
        ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
        return await task

    during = asyncio.run(load_then_kill())
    failed = [e for _, e in during if e]
    # no client hangs, and each can tell: all 40 tokens with a finish_reason, an HTTP error, or a stream
    # cut off without a finish_reason (printed for docs/serving.md)
    print(
        f"in flight when the replica died: {len(during)}; completed {sum(n == 40 for n, _ in during)}, "
        f"failed {sorted((e, failed.count(e)) for e in set(failed))}"
    )
    assert all((n == 40) != bool(e) for n, e in during), during
    assert failed, f"no stream was in flight when the replica died, so nothing was tested: {during}"
    deadline = time.monotonic() + 120
    while _llm_replicas() in ([], [replica]):  # Serve replaces the dead replica on its own
        assert time.monotonic() < deadline, "Serve did not start a new replica within 120 s"
        time.sleep(0.5)

    draft = str(run_dir / "serve" / "step_00000020")  # the step-20 export: same tokenizer, other weights
    args, cfg = _cli(
        str(run_dir),
        "--follow",
        "--poll-s",
        "1",
        "--port",
        str(PORT),
        "--draft",
        draft,
        "--set",
        'serve.model_id="tiny"',
        "--set",
        "serve.num_speculative_tokens=3",
    )
    stop, rolled, logged = threading.Event(), {}, []
    watcher = threading.Thread(
        target=lambda: rolled.setdefault(
            "dep", keep_serving(args, cfg, dep, stop, log=lambda line, **_: logged.append(line))
        )
    )
    watcher.start()
    train(_cfg(run_dir, served["cfg"].data.cache_dir, *served["store"], "train.steps=30"), resume=True, progress=False)
    deadline = time.monotonic() + 400
    while not any(json.loads(line)["serving_step"] == 30 for line in logged):
        assert time.monotonic() < deadline and watcher.is_alive(), logged
        time.sleep(0.5)
    stop.set()
    watcher.join(timeout=60)
    # one roll, onto the one newer checkpoint (the step-20 export it served already is not rolled onto again)
    assert [json.loads(line).get("serving_step") for line in logged] == [30], logged
    new = served["dep"] = rolled["dep"]
    assert new.model.step == 30 and new.model.path.startswith("s3://")  # the run's export in its store
    assert new.speculative == {
        "method": "draft_model",
        "model": str(Path(draft).resolve()),
        "num_speculative_tokens": 3,
    }
    assert run_status(run_dir)["serving"]["url"] == new.url  # raysc status lists what serves the run
    ids = _served_ids(served["client"], new.model_id, PROMPTS)  # the app answers again
    assert not greedy_mismatches(run_dir, 30, PROMPTS, ids)  # exact at T=0 with speculation
    assert greedy_mismatches(run_dir, 20, PROMPTS, ids)  # step 30's weights: the draft's are rejected somewhere
    now = _llm_replicas()
    assert len(now) == 1 and now != [replica]
