"""The Ray Serve application ``raysc serve`` deploys: Ray Serve LLM's OpenAI ingress in front of one
vLLM deployment, with an API-key check and request checks in front of the ingress.

Built like ``ray.serve.llm.build_openai_app`` (the ingress class, the LLM deployment, the model card),
except that the ingress's FastAPI app gets two ASGI middlewares of ours: ``BearerAuth`` (401 without
the key; the key itself never leaves the driver, the middleware holds its SHA-256) and
``RequestChecks`` (a 400 naming the field to change, for the values vLLM would accept or answer with
a 500). ``build_openai_app`` takes no middleware, so this uses two helpers of
``ray.llm._internal`` (``init``, ``make_fastapi_ingress``); pyproject's serve extras pin Ray to the
minor release they were read from.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_KEY_ENV = "RAYSC_API_KEY"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def _reply(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """401 for a request without ``Authorization: Bearer <key>`` (compared as SHA-256 digests, in
    constant time); ``digest`` empty = no key required."""

    def __init__(self, app: ASGIApp, digest: str = "") -> None:
        self.app, self.digest = app, digest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.digest and scope["type"] == "http":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not token or not hmac.compare_digest(key_digest(token), self.digest):
                await _reply(
                    send,
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                    "with the key the server was started with (serve.api_key / "
                    f"{API_KEY_ENV})",
                    "authentication_error",
                )
                return
        await self.app(scope, receive, send)


def check_request(body: dict, model_ids: list[str], max_model_len: int) -> str | None:
    """What is wrong with a completion or chat request that the engine would not say clearly (None if
    nothing): the message names the field and the allowed values."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    model = body.get("model")
    if model is not None and model not in model_ids:
        return f"unknown model {model!r}: this server serves {model_ids} (GET /v1/models)"
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            return f"{key} must be a positive integer (got {v!r})"
        if isinstance(v, int) and max_model_len and v > max_model_len:
            return f"{key} ({v}) exceeds the model's context of {max_model_len} tokens; ask for fewer"
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0):
        return f"temperature must be a number >= 0 (got {t!r}); 0 = greedy"
    p = body.get("top_p")
    if p is not None and (not isinstance(p, (int, float)) or not 0 < p <= 1):
        return f"top_p must be in (0, 1] (got {p!r})"
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or n < 1):
        return f"n must be a positive integer (got {n!r})"
    return None


class RequestChecks:
    """400 for a malformed JSON body or a request ``check_request`` rejects, before the ingress sees it;
    the body is buffered (requests are small) and replayed to the app unchanged."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(
        self, app: ASGIApp, model_ids: list[str] = (), max_model_len: int = 0, max_body_bytes: int = 8 << 20
    ) -> None:
        self.app, self.model_ids, self.max_model_len = app, list(model_ids), max_model_len
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            await self.app(scope, receive, send)
            return
        chunks, more, size = [], True, 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                await _reply(send, 413, f"request body over {self.max_body_bytes} bytes", "invalid_request_error")
                return
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except ValueError as e:
            await _reply(
                send, 400, f"the request body is not valid JSON ({e}); send a JSON object", "invalid_request_error"
            )
            return
        problem = check_request(body, self.model_ids, self.max_model_len)
        if problem:
            await _reply(send, 400, problem, "invalid_request_error")
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # the disconnect the streaming response waits for

        await self.app(scope, replay, send)


def build_app(llm_config: dict, api_key_digest: str = "", max_model_len: int = 0, ingress_cpus: float | None = None):
    """The Serve application: the OpenAI ingress (with our middlewares) bound to one vLLM deployment
    built from ``llm_config`` (``raysc.serve.engine.llm_config_dict``); ``ingress_cpus``: the
    ingress's CPUs when Serve's default of 1 does not fit the cluster (``raysc.serve.fit``)."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress, init, make_fastapi_ingress
    from ray.serve.llm import LLMConfig, build_llm_deployment

    cfg = LLMConfig(**llm_config)
    fastapi_app = init()
    # added last = runs first (Starlette middleware is LIFO): the key is checked before anything else
    fastapi_app.add_middleware(RequestChecks, model_ids=[cfg.model_id], max_model_len=max_model_len)
    fastapi_app.add_middleware(BearerAuth, digest=api_key_digest)
    ingress = make_fastapi_ingress(OpenAiIngress, app=fastapi_app)
    options = OpenAiIngress.get_deployment_options([cfg])
    if ingress_cpus is not None:
        options["ray_actor_options"] = {**options.get("ray_actor_options", {}), "num_cpus": ingress_cpus}
    return serve.deployment(ingress, **options).bind(
        llm_deployments={cfg.model_id: build_llm_deployment(cfg)},
        model_cards={cfg.model_id: to_model_metadata(cfg.model_id, cfg)},
        lora_paths={},
    )
