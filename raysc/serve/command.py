"""``raysc serve``: a run (or an export) answered by vLLM inside Ray Serve LLM, on the current Ray
cluster, through an OpenAI-compatible endpoint; ``--follow`` rolls it onto each new checkpoint.

The command resolves what to serve (``raysc.serve.source``), maps ``serve.*`` onto the engine
(``raysc.serve.engine``), deploys the application (``raysc.serve.app``) and records what serves a
run in ``<run>/serve/serving.json`` (``raysc status`` shows it). It stays in the foreground until
Ctrl-C or SIGTERM, then deletes its application; ``--detach`` leaves the application on the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from raysc.config.schema import Config, ServeConfig
from raysc.fleet.records import SERVING_RECORD
from raysc.serve.app import API_KEY_ENV, build_app, key_digest
from raysc.serve.engine import llm_config_dict, speculative_config
from raysc.serve.fit import ServeFit, ServeNotReady, fit
from raysc.serve.source import ServedModel, export_run, is_run_dir, newest_verified_step, resolve
from raysc.serve.store_env import replica_env

SPEC_TUNED = "serve_speculative.json"  # written into the target run by `raysc spec tune`


@dataclass
class Deployment:
    """A deployed application and what it serves."""

    app_name: str
    url: str
    model_id: str
    model: ServedModel
    serve: ServeConfig
    speculative: dict | None = None


def settings(source: str, overrides: list[str]) -> Config:
    """The config whose ``serve.*`` section applies: a run's own (with ``overrides``), else defaults."""
    from raysc.config.load import load_config

    path = Path(source) / "config.toml" if is_run_dir(source) else None
    return load_config(path, overrides)


def _model_id(cfg: Config, model: ServedModel) -> str:
    if cfg.serve.model_id:
        return cfg.serve.model_id
    return cfg.run.name if model.run_dir is not None else Path(model.path.rstrip("/")).name


def _api_key(cfg: ServeConfig) -> str:
    return cfg.api_key or os.environ.get(API_KEY_ENV, "")


def _hf_config(model: ServedModel) -> dict:
    if model.remote and not model.local:
        import fsspec

        with fsspec.open(f"{model.path}/config.json") as f:
            return json.load(f)
    return json.loads((Path(model.local or model.path) / "config.json").read_text())


def exported_dtype(hf: dict) -> str:
    """The dtype a Hugging Face ``config.json`` (as a dict) was exported in, as vLLM names it, or "auto"."""
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "auto"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def _resolved(cfg: ServeConfig, hf: dict) -> ServeConfig:
    """``cfg`` with ``dtype = "auto"`` made the exported dtype: vLLM's own "auto" serves an fp32
    checkpoint in 16 bits, which would not be the model that was trained and evaluated."""
    from dataclasses import replace

    return cfg if cfg.dtype != "auto" else replace(cfg, dtype=exported_dtype(hf))


def _speculative(cfg: Config, source: str, draft: str | None) -> dict | None:
    tuned = None
    if is_run_dir(source) and (Path(source) / SPEC_TUNED).is_file():
        tuned = json.loads((Path(source) / SPEC_TUNED).read_text())
    # vLLM loads a draft from a path on the replica's node (Ray Serve LLM mirrors only the target)
    drafted = resolve(draft) if draft else None
    draft_path = (drafted.local or drafted.path) if drafted else None
    if draft is None and not cfg.serve.num_speculative_tokens:
        # a tuned draft-model choice needs the draft: without --draft only a tuned n-gram choice applies
        tuned = tuned if (tuned or {}).get("method") == "ngram" else None
    return speculative_config(cfg.serve, draft_path, tuned)


def cluster_fit(serve_cfg: ServeConfig) -> ServeFit:
    """``raysc.serve.fit.fit`` against the connected cluster's total resources."""
    import ray

    total = ray.cluster_resources()
    largest = max((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")), default=0.0)
    return fit(serve_cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), largest)


def deploy(
    source: str,
    cfg: Config,
    step: int | None = None,
    draft: str | None = None,
    model: ServedModel | None = None,
    log=print,
) -> Deployment:
    """Deploy (or roll) the application serving ``source`` on the connected Ray cluster, sized to fit
    it (``raysc.serve.fit``); returns when the new version answers, or raises ``ServeNotReady`` after
    ``serve.ready_timeout_s`` and removes it (a roll onto a new checkpoint waits as Serve does, with
    the previous version serving meanwhile)."""
    from ray import serve

    model = model or resolve(source, step)
    model_id = _model_id(cfg, model)
    spec = _speculative(cfg, source, draft)
    hf = _hf_config(model)
    serve_cfg = _resolved(cfg.serve, hf)
    sizes = cluster_fit(serve_cfg)  # ServeDoesNotFit before anything is deployed
    if sizes.shrunk:
        log(f"[raysc] serve: the cluster has too few CPUs for Serve's defaults; fitted: {sizes.describe()}", flush=True)
    share = sizes.share if sizes.shrunk else None
    # a run's store settings (its config.toml: secrets redacted, so credentials come from the environment)
    options = cfg.checkpoint.storage_options if model.run_dir is not None else None
    llm_cfg = llm_config_dict(model, serve_cfg, model_id, spec, replica_env(model.path, options), actor_cpus=share)
    key = _api_key(cfg.serve)
    max_len = serve_cfg.max_model_len or int(hf.get("max_position_embeddings", 0))
    app = build_app(llm_cfg, key_digest(key) if key else "", max_len, ingress_cpus=share)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    name = f"raysc-{model_id}"
    if name in serve.status().applications:  # a roll: Serve's own wait sees the new version come up
        serve.run(app, name=name, route_prefix="/", blocking=False)
    else:
        serve.run_many(
            [serve.RunTarget(app, name=name, route_prefix="/")],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )
        wait_ready(name, serve_cfg.ready_timeout_s, sizes, log=log)
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    dep = Deployment(name, f"http://{host}:{cfg.serve.port}/v1", model_id, model, serve_cfg, spec)
    if model.run_dir is not None:
        _record(dep)
    return dep


def _waiting_for(app) -> str:
    """What an application that is not running yet waits for, from its deployments' statuses."""
    parts = [
        f"{name}: {d.status}" + (f" ({d.message.strip()[:300]})" if d.message else "")
        for name, d in app.deployments.items()
        if d.status != "HEALTHY"
    ]
    return "; ".join(parts) or str(app.status)


def wait_ready(name: str, timeout_s: float, sizes: ServeFit, log=print, every_s: float = 15.0) -> None:
    """Until application ``name`` runs: say what it waits for every ``every_s`` (when that changes or
    a minute passed); after ``timeout_s`` (or when Serve gives up on it) remove it and raise
    ``ServeNotReady`` with that, the deployment's needs and the cluster's free resources."""
    import ray
    from ray import serve

    t0 = last_t = time.monotonic()
    last = ""
    while True:
        app = serve.status().applications.get(name)
        status = str(app.status) if app else "NOT_STARTED"
        if status.endswith("RUNNING"):
            return
        now = time.monotonic()
        waiting = _waiting_for(app) if app else status
        failed = status.endswith("DEPLOY_FAILED")
        if failed or now - t0 > timeout_s:
            serve.delete(name, _blocking=False)
            avail, total = ray.available_resources(), ray.cluster_resources()
            free = {k: round(avail.get(k, 0.0), 2) for k in ("CPU", "GPU") if k == "CPU" or total.get(k)}
            why = (
                "Serve could not deploy it"
                if failed
                else f"not answering after {timeout_s:g} s (serve.ready_timeout_s)"
            )
            raise ServeNotReady(
                f"{name}: {why}; waiting for: {waiting}. It needs {sizes.describe()}; the "
                f"cluster has {free} free. Removed what was deployed. Free resources (another run "
                f"or deployment), add nodes, or raise serve.ready_timeout_s when the engine is "
                f"only slow to start."
            )
        if now >= last_t + every_s and (waiting != last or now >= last_t + 60):
            log(f"[raysc] serve: {now - t0:.0f} s, waiting for {waiting}", flush=True)
            last, last_t = waiting, now
        time.sleep(1.0)


def _record(dep: Deployment) -> None:
    path = dep.model.run_dir / SERVING_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "app": dep.app_name,
                "url": dep.url,
                "model_id": dep.model_id,
                "step": dep.model.step,
                "checkpoint": dep.model.checkpoint,
                "export": dep.model.path,
                "pid": os.getpid(),
                "since": time.time(),
                "speculative": dep.speculative,
                "replicas": dep.serve.replicas
                if not dep.serve.autoscale_max
                else f"{dep.serve.autoscale_min}-{dep.serve.autoscale_max}",
            },
            indent=2,
        )
    )


def undeploy(dep: Deployment) -> None:
    from ray import serve

    serve.delete(dep.app_name)
    if dep.model.run_dir is not None:
        (dep.model.run_dir / SERVING_RECORD).unlink(missing_ok=True)


def follow(
    dep: Deployment,
    source: str,
    cfg: Config,
    stop: threading.Event,
    poll_s: float = 10.0,
    draft: str | None = None,
    log=print,
) -> Deployment:
    """Until ``stop`` is set: roll ``dep`` onto each newly committed, verified checkpoint of the run in
    ``source`` (Ray Serve replaces the replicas; requests in flight finish on the old weights)."""
    run_dir = Path(source)
    while not stop.wait(poll_s):
        step = newest_verified_step(run_dir)
        if step is None or (dep.model.step is not None and step <= dep.model.step):
            continue
        t0 = time.perf_counter()
        model = export_run(run_dir, step)
        dep = deploy(source, cfg, draft=draft, model=model, log=log)
        log(
            json.dumps({"serving_step": step, "export": model.path, "rolled_s": round(time.perf_counter() - t0, 1)}),
            flush=True,
        )
    return dep


def cli_settings(args: argparse.Namespace) -> Config:
    """The config ``raysc serve``'s arguments select (``--replicas``, ``--host``, ``--set`` ... onto the
    run's own config or the defaults), with the command-line mistakes refused."""
    overrides = list(args.overrides)
    if args.replicas is not None:
        overrides.append(f"serve.replicas={args.replicas}")
    if args.autoscale:
        lo, _, hi = args.autoscale.partition(",")
        if not (lo.strip().isdigit() and hi.strip().isdigit()):
            raise SystemExit(f"--autoscale takes MIN,MAX (two whole numbers), got {args.autoscale!r}")
        overrides += [f"serve.autoscale_min={lo.strip()}", f"serve.autoscale_max={hi.strip()}"]
    if args.host:
        overrides.append(f"serve.host={json.dumps(args.host)}")
    if args.port:
        overrides.append(f"serve.port={args.port}")
    if args.follow and not is_run_dir(args.source):
        raise SystemExit("--follow watches a run's checkpoints: pass a run directory (config.toml), not an export")
    return settings(args.source, overrides)


def keep_serving(
    args: argparse.Namespace, cfg: Config, dep: Deployment, stop: threading.Event, log=print
) -> Deployment:
    """After the first deployment: with ``--follow`` roll onto each new checkpoint (with ``--draft``'s
    model), else wait; until ``stop`` is set. Returns the deployment serving at that point."""
    if args.follow:
        return follow(dep, args.source, cfg, stop, args.poll_s, args.draft, log=log)
    stop.wait()
    return dep


def cmd_serve(args: argparse.Namespace) -> int:
    from raysc.cluster.connect import init_ray

    cfg = cli_settings(args)
    if cfg.serve.host not in ("127.0.0.1", "localhost", "::1") and not _api_key(cfg.serve):
        print(
            f"warning: serving on {cfg.serve.host} without an API key; anyone who can reach the port can use "
            f"the model (set serve.api_key or {API_KEY_ENV})",
            flush=True,
        )
    if args.follow and newest_verified_step(Path(args.source)) is None:
        print(f"waiting for the first verified checkpoint of {args.source} ...", flush=True)
        while newest_verified_step(Path(args.source)) is None:
            time.sleep(args.poll_s)
    init_ray(log_to_driver=False, configure_logging=False)  # a wrong RAY_ADDRESS fails within seconds
    t0 = time.perf_counter()
    dep = deploy(args.source, cfg, args.step, args.draft)
    print(
        json.dumps(
            {
                "serving": dep.url,
                "model": dep.model_id,
                "step": dep.model.step,
                "export": dep.model.path,
                "reused_export": dep.model.reused,
                "speculative": dep.speculative,
                "ready_s": round(time.perf_counter() - t0, 1),
            }
        ),
        flush=True,
    )
    if args.detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        dep = keep_serving(args, cfg, dep, stop)
    finally:
        undeploy(dep)
        print(json.dumps({"stopped": dep.app_name}), flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="a run directory (its newest verified checkpoint), a Hugging Face export folder, or an s3:// export",
    )
    p.add_argument("--step", type=int, help="serve this checkpoint step of a run (default: the newest verified)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--replicas", type=int, help="fixed number of vLLM replicas (serve.replicas)")
    group.add_argument("--autoscale", metavar="MIN,MAX", help="autoscale between MIN and MAX replicas")
    p.add_argument("--host", help="bind address (serve.host, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (serve.port, default 8000)")
    p.add_argument(
        "--draft",
        metavar="DRAFT_RUN",
        help="a draft model's run (same tokenizer) for speculative "
        "decoding; k from `raysc spec tune` or serve.num_speculative_tokens",
    )
    p.add_argument("--follow", action="store_true", help="roll onto each newly committed checkpoint of the run")
    p.add_argument("--poll-s", type=float, default=10.0, help="how often --follow looks for a new checkpoint")
    p.add_argument("--detach", action="store_true", help="deploy and return; the app stays on the cluster")
