"""The object-store settings a vLLM replica needs to mirror an ``s3://`` export onto its own node.

Ray Serve LLM downloads ``model_source = {bucket_uri: ...}`` inside each replica, with boto3 (or
pyarrow), which read the endpoint and credentials from the replica's environment only. A replica on
another node of a cluster sees neither the driver's environment nor its disk, so ``raysc serve``
hands each replica's download what the driver itself used to reach the store (through
``raysc.serve.replica_setup``, a Ray Serve LLM callback; not the deployment's ``runtime_env``,
which Ray writes into its logs):

- the endpoint (``AWS_ENDPOINT_URL_S3``) and region of an S3-compatible store: the run's
  ``checkpoint.storage_options`` (``endpoint_url``, ``region_name``, also inside ``client_kwargs``),
  else the driver's ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` / ``AWS_DEFAULT_REGION``;
- credentials only when the driver has them explicitly: storage options that are not redacted
  (``key``, ``secret``, ``token``), else ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``. A driver that relies on an instance role or a profile file forwards none,
  and each node uses its own role (on a cluster started by ``ray up``, the nodes' IAM role).

No library does this mapping (Ray Serve LLM leaves the replica's environment to the user); it is a
dictionary of names, nothing more. Forwarded credentials are part of the deployment's ``LLMConfig``,
which Ray Serve keeps in the cluster's control store: anyone who can run code on the cluster can read
them. Use an instance role where the cluster has one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from raysc.config.secrets import REDACTED

# storage option (s3fs's name) -> the environment variable boto3 reads
_OPTION_ENV = {
    "endpoint_url": "AWS_ENDPOINT_URL_S3",
    "region_name": "AWS_DEFAULT_REGION",
    "key": "AWS_ACCESS_KEY_ID",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "token": "AWS_SESSION_TOKEN",
}
# the driver's environment variable(s) for each, first found wins
_DRIVER_ENV = {
    "AWS_ENDPOINT_URL_S3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "AWS_DEFAULT_REGION": ("AWS_DEFAULT_REGION", "AWS_REGION"),
    "AWS_ACCESS_KEY_ID": ("AWS_ACCESS_KEY_ID",),
    "AWS_SECRET_ACCESS_KEY": ("AWS_SECRET_ACCESS_KEY",),
    "AWS_SESSION_TOKEN": ("AWS_SESSION_TOKEN",),
}


def replica_env(
    uri: str, storage_options: Mapping | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment variables a replica needs to read ``uri`` (empty unless it is an ``s3://`` URI):
    from ``storage_options`` (a run's ``checkpoint.storage_options``; redacted values are unset),
    else from ``environ`` (default: this process's environment)."""
    if not uri.startswith(("s3://", "s3a://")):
        return {}
    environ = os.environ if environ is None else environ
    options = dict(storage_options or {})
    options = {**options, **dict(options.pop("client_kwargs", None) or {})}
    out: dict[str, str] = {}
    for option, name in _OPTION_ENV.items():
        value = options.get(option)
        if value is not None and value != REDACTED and str(value):
            out[name] = str(value)
    for name, sources in _DRIVER_ENV.items():
        if name not in out:
            value = next((environ[s] for s in sources if environ.get(s)), None)
            if value:
                out[name] = value
    if "AWS_ACCESS_KEY_ID" not in out or "AWS_SECRET_ACCESS_KEY" not in out:
        # half a key pair is worse than none (boto3 would not fall back to the node's role)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            out.pop(name, None)
    return out
