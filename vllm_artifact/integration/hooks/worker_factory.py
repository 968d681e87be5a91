"""Hook: Model Runner V2 builds our worker connector instead of vLLM's (registry:
``hooks/__init__.py``, hook ``worker_factory``).

The replacement takes the parameters of the function it replaces (checked here against the
series' seam: vLLM 0.32 passes the KV cache layout, 0.34 passes it later to
``initialize_output_storage``) and returns :class:`ArtifactWorkerConnector`, which keeps
vLLM's capturer and transport.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.v1.worker.gpu import model_runner

from vllm_artifact.integration.hooks.patching import require, require_attributes, wrap_once
from vllm_artifact.integration.seams import WORKER_FACTORY_PARAMETERS

_HOOK = "worker_factory"
require_attributes(_HOOK, (model_runner, "get_aux_output_connector"))
require(
    tuple(inspect.signature(model_runner.get_aux_output_connector).parameters)
    == WORKER_FACTORY_PARAMETERS,
    _HOOK,
    "vllm.v1.worker.gpu.model_runner.get_aux_output_connector's parameters changed",
)


def get_artifact_connector(model: Any, vllm_config: Any, kv_cache_config: Any = None) -> Any:
    from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector

    return ArtifactWorkerConnector(
        model=model, vllm_config=vllm_config, kv_cache_config=kv_cache_config
    )


def _replace(original: Any) -> Any:
    return get_artifact_connector


def install() -> None:
    wrap_once(model_runner, "get_aux_output_connector", _replace)
