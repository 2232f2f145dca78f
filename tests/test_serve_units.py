"""raysc serve without an engine: what a source resolves to (export once per checkpoint, object-store
exports that Ray Serve LLM's own downloader mirrors), the serve.* → vLLM mapping and its errors, the
API-key and request-check middlewares, and jobs/serve_config.yaml against Ray Serve's schemas."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import yaml

from raysc.config import load_config
from raysc.config.schema import ServeConfig
from raysc.serve.app import BearerAuth, RequestChecks, check_request, key_digest
from raysc.serve.engine import ServeConfigError, check, engine_kwargs, llm_config_dict, speculative_config
from raysc.serve.source import EXPORT_RECORD, ServedModel, resolve

ROOT = Path(__file__).resolve().parents[1]


# ---- sources ----


def test_an_object_store_export_is_uploaded_once_and_ray_serve_llm_mirrors_it(s3_server, tmp_path, monkeypatch):
    """What a replica on another node does with ``model_source = {bucket_uri: ...}``: Ray Serve LLM's own
    downloader (``download_model_files``) fetches the folder ``raysc serve`` uploaded, byte for byte."""
    import s3fs
    from ray.llm._internal.common.utils.cloud_utils import CloudMirrorConfig
    from ray.llm._internal.common.utils.download_utils import download_model_files

    from raysc.serve.source import _upload_once

    local = tmp_path / "step_00000002"
    local.mkdir()
    for name, data in [
        ("config.json", b'{"model_type": "llama"}'),
        ("model.safetensors", os.urandom(4096)),
        ("tokenizer.json", b"{}"),
        (EXPORT_RECORD, b'{"step": 2}'),
    ]:
        (local / name).write_bytes(data)
    s3_server["client"].create_bucket(Bucket="serve")
    fs = s3fs.S3FileSystem(
        key="testing",
        secret="testing-secret",
        client_kwargs={"endpoint_url": s3_server["endpoint"], "region_name": "us-east-1"},
    )
    _upload_once(local, fs, "serve/run/checkpoints/serve/step_00000002")
    puts = []
    monkeypatch.setattr(fs, "put_file", lambda *a, **k: puts.append(a))
    _upload_once(local, fs, "serve/run/checkpoints/serve/step_00000002")
    assert puts == []  # an identical export.json is there: nothing is uploaded again
    uri = "s3://serve/run/checkpoints/serve/step_00000002"
    for k, v in {
        "AWS_ENDPOINT_URL_S3": s3_server["endpoint"],
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "HF_HOME": str(tmp_path / "hf"),
    }.items():
        monkeypatch.setenv(k, v)
    mirrored = Path(download_model_files(model_id="raysc-test", mirror_config=CloudMirrorConfig(bucket_uri=uri)))
    for f in local.iterdir():
        assert (mirrored / f.name).read_bytes() == f.read_bytes()


def test_replicas_get_the_object_store_settings_the_driver_used():
    """A replica on another node reads an s3:// export with what the driver had: the run's endpoint and
    region, and credentials only when the driver holds them (never '***', never half a pair)."""
    from raysc.serve.store_env import replica_env

    run = {"endpoint_url": "http://minio:9000", "key": "***", "secret": "***", "region_name": "eu-1"}
    keys = {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_ENDPOINT_URL": "http://other"}
    assert replica_env("s3://b/run/serve/step_1", run, keys) == {
        "AWS_ENDPOINT_URL_S3": "http://minio:9000",
        "AWS_DEFAULT_REGION": "eu-1",
        "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    }
    assert replica_env("s3://b/x", {"client_kwargs": {"endpoint_url": "http://m:1"}}, {}) == {
        "AWS_ENDPOINT_URL_S3": "http://m:1"
    }
    assert replica_env("s3://b/x", None, keys)["AWS_ENDPOINT_URL_S3"] == "http://other"
    assert replica_env("s3://b/x", None, {"AWS_ACCESS_KEY_ID": "id"}) == {}  # an instance role applies
    assert replica_env("/local/export", run, keys) == {} and replica_env("gs://b/x", run, keys) == {}
    # handed to each node's download task by our callback, never through the (logged) runtime_env
    from ray.serve.llm import LLMConfig

    from raysc.serve.replica_setup import StoreSettings

    d = llm_config_dict(ServedModel("s3://b/x"), ServeConfig(), "m", env={"AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    assert "s3cr3t" not in json.dumps(d["runtime_env"])
    callback = LLMConfig(**d).get_or_create_callback()
    assert isinstance(callback, StoreSettings)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
        callback.run_callback_sync("on_before_download_model_files_distributed")
        assert os.environ["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"


def test_serve_command_line_reaches_the_deployment(tmp_path, monkeypatch):
    """``raysc serve RUN --follow --draft D --port P --set ...``: the flags become the config and the
    draft both the first deployment and every --follow roll use (what tests/test_serve.py runs live)."""
    import signal

    import ray

    from raysc.cli import build_parser
    from raysc.serve import command

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('[run]\nname = "r"\n')
    calls = []
    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    monkeypatch.setattr(command, "newest_verified_step", lambda _: 5)
    monkeypatch.setattr(
        command,
        "deploy",
        lambda source, cfg, step, draft: (
            calls.append(("deploy", source, step, draft, cfg.serve.port, cfg.serve.replicas, cfg.serve.max_num_seqs))
            or command.Deployment("app", "url", "r", ServedModel("/m"), cfg.serve)
        ),
    )
    monkeypatch.setattr(
        command,
        "follow",
        lambda dep, source, cfg, stop, poll_s, draft, log: calls.append(("follow", source, poll_s, draft)) or dep,
    )
    monkeypatch.setattr(command, "undeploy", lambda dep: calls.append(("undeploy", dep.app_name)))
    args = build_parser().parse_args(
        [
            "serve",
            str(run),
            "--follow",
            "--draft",
            "/d",
            "--port",
            "8123",
            "--replicas",
            "2",
            "--poll-s",
            "0.5",
            "--set",
            "serve.max_num_seqs=7",
        ]
    )
    assert args.func(args) == 0
    assert calls == [("deploy", str(run), None, "/d", 8123, 2, 7), ("follow", str(run), 0.5, "/d"), ("undeploy", "app")]
    with pytest.raises(SystemExit, match="--follow watches a run"):
        command.cli_settings(build_parser().parse_args(["serve", "s3://b/x", "--follow"]))


def test_served_sources_resolve(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve(str(folder)) == ServedModel(str(folder.resolve()))
    with pytest.raises(ValueError, match="--step applies to a run directory"):
        resolve(str(folder), step=3)
    # a run's export says which checkpoint it is (a broken record is a plain folder, not an error)
    record = {"format": 2, "step": 40, "checkpoint": "s3://b/run/step_00000040", "manifest_sha256": "0" * 64}
    (folder / EXPORT_RECORD).write_text(json.dumps(record))
    assert resolve(str(folder)) == ServedModel(str(folder.resolve()), 40, "s3://b/run/step_00000040")
    (folder / EXPORT_RECORD).write_text("{not json")
    assert resolve(str(folder)) == ServedModel(str(folder.resolve()))


# ---- engine mapping ----


def test_serve_settings_map_onto_vllm_engine_arguments():
    cfg = load_config(
        None,
        [
            "serve.max_num_seqs=7",
            "serve.max_model_len=96",
            'serve.dtype="bfloat16"',
            "serve.kv_cache_gb=2.5",
            "serve.autoscale_min=1",
            "serve.autoscale_max=3",
        ],
    ).serve
    d = llm_config_dict(ServedModel("/m"), cfg, "m")
    kw = d["engine_kwargs"]
    assert kw["max_num_seqs"] == 7 and kw["max_model_len"] == 96 and kw["dtype"] == "bfloat16"
    assert kw["enforce_eager"] is True and "block_size" not in kw  # CPU build: eager, vLLM's block size
    assert d["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "3"  # whole GiB, rounded up
    # one CPU rank: Ray Serve LLM's engine-class hook names ours (the model in vLLM's engine-core process)
    assert d["runtime_env"]["env_vars"]["RAYLLM_VLLM_ENGINE_CLS"] == "raysc.serve.one_process:OneProcessEngine"
    from ray.llm._internal.serve.constants import RAYLLM_VLLM_ENGINE_CLS_ENV

    assert RAYLLM_VLLM_ENGINE_CLS_ENV == "RAYLLM_VLLM_ENGINE_CLS"  # the hook is still Ray's
    assert d["deployment_config"]["autoscaling_config"]["max_replicas"] == 3
    gpu = llm_config_dict(ServedModel("s3://b/x"), ServeConfig(gpus_per_replica=1, tensor_parallel_size=2), "m")
    assert gpu["model_loading_config"]["model_source"] == {"bucket_uri": "s3://b/x"}
    assert gpu["placement_group_config"]["bundles"] == [{"CPU": 1.0, "GPU": 1}] * 2
    assert gpu["engine_kwargs"]["kv_cache_memory_bytes"] == 1 << 30 and "runtime_env" not in gpu
    from ray.serve.llm import LLMConfig

    assert LLMConfig(**d).model_id == "m"  # what Ray Serve LLM validates


@pytest.mark.parametrize(
    "settings,says",
    [
        ({"block_size": 16}, "multiple of 32"),
        ({"pipeline_parallel_size": 2}, "needs GPUs"),
        ({"autoscale_min": 3, "autoscale_max": 2}, "autoscale_min"),
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens"),
    ],
)
def test_serve_settings_vllm_cannot_run_are_refused_before_deploying(settings, says):
    with pytest.raises(ServeConfigError, match=says):
        check(ServeConfig(**settings))


def test_speculative_settings():
    assert speculative_config(ServeConfig(), None, None) is None
    ngram = speculative_config(ServeConfig(num_speculative_tokens=3, speculative_method="ngram"), None, None)
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 3
    tuned = speculative_config(ServeConfig(), "/draft", {"method": "draft_model", "num_speculative_tokens": 2})
    assert tuned == {"method": "draft_model", "model": "/draft", "num_speculative_tokens": 2}
    with pytest.raises(ServeConfigError, match="--draft"):
        speculative_config(ServeConfig(num_speculative_tokens=2), None, None)
    assert engine_kwargs(ServeConfig(), ngram)["speculative_config"] == ngram


# ---- middlewares ----


def _call(app, body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/completions"):
    sent, seen = [], {}

    async def inner(scope, receive, send):
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    asyncio.run(app(inner)(scope, receive, send))
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:]), seen.get("body")


def test_bearer_auth_compares_the_key_and_holds_only_its_digest():
    app = lambda inner: BearerAuth(inner, key_digest("k3y"))  # noqa: E731
    assert _call(app, b"{}", {"Authorization": "Bearer k3y"})[0] == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k3y"}, {"Authorization": "Basic k3y"}):
        status, body, _ = _call(app, b"{}", headers)
        assert status == 401 and b"Authorization: Bearer" in body
    assert "k3y" not in vars(BearerAuth(None, key_digest("k3y"))).values()
    assert _call(lambda inner: BearerAuth(inner, ""), b"{}")[0] == 200  # no key configured


def test_request_checks_reject_with_the_field_to_change_and_replay_good_bodies():
    app = lambda inner: RequestChecks(inner, ["m"], 64)  # noqa: E731
    good = json.dumps({"model": "m", "prompt": "x", "max_tokens": 4}).encode()
    assert _call(app, good) == (200, b"ok", good)  # the app reads the body unchanged
    assert _call(app, b"{oops")[0] == 400
    assert _call(app, b"{oops", path="/v1/models")[0] == 200  # only completions and chat are checked
    for body, says in [
        ({"model": "x"}, "unknown model"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1000}, "context of 64"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n must be"),
    ]:
        status, text, _ = _call(app, json.dumps(body).encode())
        assert status == 400 and says in json.loads(text)["error"]["message"]
    assert check_request([1], ["m"], 0) == "the request body must be a JSON object"


# ---- cluster deployment file ----


def test_serve_config_yaml_is_a_valid_ray_serve_config_with_a_valid_llm_config():
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "jobs" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host == "127.0.0.1"
    [app] = config["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    [llm] = app["args"]["llm_configs"]
    assert LLMConfig(**llm).model_id == "llm"
    ours = llm_config_dict(ServedModel("s3://b/x"), ServeConfig(gpus_per_replica=1), "llm")
    assert set(llm) <= set(ours)  # the same keys raysc serve fills


def test_serve_fits_a_small_cluster_or_says_what_it_needs():
    """Serve's defaults (a 1-CPU replica actor merged into the engine's bundle, a 1-CPU ingress) need 3
    CPUs for one 1-CPU engine: on a 2-CPU laptop the ingress never scheduled. raysc gives the two relays
    an equal share of what the engines leave, and refuses before deploying what can never fit."""
    from raysc.serve.fit import ServeDoesNotFit, fit

    def cfg(*sets: str):
        return load_config(None, list(sets)).serve

    roomy = fit(cfg(), cluster_cpus=8)
    assert not roomy.shrunk and roomy.share == 1.0 and roomy.cpus == 3.0
    laptop = fit(cfg(), cluster_cpus=2)
    assert laptop.shrunk and laptop.share == 0.5 and laptop.cpus == 2.0
    three = fit(cfg("serve.replicas=2"), cluster_cpus=3)  # two engines leave 1 CPU for three relays
    assert three.share == 0.33 and three.cpus <= 3
    with pytest.raises(
        ServeDoesNotFit,
        match=r"needs at least 1 replica\(s\) × \(1 CPU engine \+ 0\.1 CPU replica "
        r"actor\) \+ 0\.1 CPU ingress = 1\.2 CPU; the cluster has 1 CPU",
    ):
        fit(cfg(), cluster_cpus=1)
    with pytest.raises(ServeDoesNotFit, match="serve.cpus_per_replica, serve.replicas"):
        fit(cfg("serve.replicas=2"), cluster_cpus=2)
    with pytest.raises(ServeDoesNotFit, match=r"largest node 1\)"):  # an engine and its actor share a node
        fit(cfg(), cluster_cpus=4, largest_node_cpus=1)
    with pytest.raises(ServeDoesNotFit, match="1 GPU; the cluster has 8 CPU .*0 GPU"):
        fit(cfg("serve.gpus_per_replica=1"), cluster_cpus=8, cluster_gpus=0)
    # autoscaling places its minimum (at least one replica) at start
    assert fit(cfg("serve.autoscale_min=0", "serve.autoscale_max=4"), cluster_cpus=2).replicas == 1


def test_the_fitted_shares_reach_the_replica_actor_and_the_ingress():
    """What Ray Serve LLM is handed: the replica actor's CPUs (merged into its first placement bundle by
    Serve LLM) and the ingress deployment's, only when Serve's defaults do not fit."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer
    from ray.serve.llm import LLMConfig

    from raysc.serve.engine import llm_config_dict
    from raysc.serve.source import ServedModel

    serve_cfg = load_config(None, []).serve
    model = ServedModel(path="/tmp/export")
    default = llm_config_dict(model, serve_cfg, "m")
    assert "ray_actor_options" not in default["deployment_config"]
    fitted = llm_config_dict(model, serve_cfg, "m", actor_cpus=0.5)
    options = LLMServer.get_deployment_options(LLMConfig(**fitted))
    assert options["placement_group_bundles"][0]["CPU"] == 1.5  # the 1-CPU engine + the 0.5-CPU actor
