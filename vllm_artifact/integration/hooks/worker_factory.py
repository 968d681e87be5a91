"""Hook: MRV2 builds our worker connector instead of vLLM's AuxOutput worker connector.

Replaces the module global ``vllm.v1.worker.gpu.model_runner.get_aux_output_connector``,
which ``GPUModelRunner.initialize_kv_cache`` calls (after KV sizing, before warm-up) when
routed experts are on. Checked against vLLM 0.32.0. The replacement has the same signature
and returns :class:`ArtifactWorkerConnector`, which keeps vLLM's capturer and transport.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu import model_runner

from vllm_artifact.integration.hooks import require_attributes

require_attributes("worker_factory", (model_runner, "get_aux_output_connector"))


def get_artifact_connector(model: Any, vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector

    return ArtifactWorkerConnector(
        model=model, vllm_config=vllm_config, kv_cache_config=kv_cache_config
    )


def install() -> None:
    model_runner.get_aux_output_connector = get_artifact_connector
