"""Inside a vLLM replica's model download: the object-store settings ``raysc serve`` hands it.

A Ray Serve LLM callback (``LLMConfig.callback_config``): before a node mirrors an ``s3://`` export,
``on_before_download_model_files_distributed`` puts the endpoint and credentials
(``raysc.serve.store_env.replica_env``) into the download task's environment, where boto3 reads them.
A callback and not the deployment's ``runtime_env``: Ray writes every runtime environment, its
environment variables included, into ``runtime_env_agent.log`` on each node, and credentials must not
land in logs; a callback's arguments travel inside the ``LLMConfig`` (a task argument, not logged).
``CallbackBase`` is a ``ray.llm._internal`` class (the serve extras pin Ray to the minor release it was
read from, as for ``raysc.serve.app``).
"""

from __future__ import annotations

import os

from ray.llm._internal.common.callbacks.base import CallbackBase

CALLBACK_CLASS = "raysc.serve.replica_setup:StoreSettings"  # how LLMConfig names it (imported on the node)


class StoreSettings(CallbackBase):
    """``callback_kwargs = {"env": {NAME: value}}``: set before the model files are downloaded."""

    def on_before_download_model_files_distributed(self) -> None:
        os.environ.update({str(k): str(v) for k, v in (self.kwargs.get("env") or {}).items()})
