"""vLLM schedulers that run the Artifact Connector's scheduler side.

Selected through vLLM's own ``SchedulerConfig.scheduler_cls`` (set at startup when routed
experts are on), so no vLLM code is patched for this: the classes subclass vLLM's
``Scheduler`` / ``AsyncScheduler`` and change two things.

* The connector is ours (:class:`ArtifactSchedulerConnector`).
* A request whose R3 cannot be delivered completely is finished with
  ``RequestStatus.FINISHED_ERROR`` (finish reason ``error``) *before* vLLM processes the step,
  so it is never answered with partial R3; the engine keeps serving every other request. The
  message travels in ``stop_reason``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_block_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from vllm_artifact.core.failure import R3Failure
from vllm_artifact.integration.hooks import require_attributes
from vllm_artifact.integration.kv_events import eviction_id
from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector

logger = logging.getLogger("vllm.artifact.scheduler")


class _ArtifactSchedulerMixin:
    """Shared by the sync and async variants (the mixin must come first in the MRO)."""

    aux_output_connector: Any
    requests: dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.aux_output_connector is not None:
            vllm_config: Any = self.vllm_config  # type: ignore[attr-defined]
            _, hash_block_size = resolve_kv_cache_block_sizes(
                self.kv_cache_config,  # type: ignore[attr-defined]
                vllm_config,
            )
            self.aux_output_connector = ArtifactSchedulerConnector(
                self.kv_cache_manager,  # type: ignore[attr-defined]
                self.connector,  # type: ignore[attr-defined]
                hash_fn=get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo),
                hash_block_size=hash_block_size,
            )
            self._forward_kv_evictions()

    def _forward_kv_evictions(self) -> None:
        """Let our connector see the KV cache's block evictions and prefix-cache resets.

        Wraps two methods of this scheduler's block pool (the instance's attributes): the
        one every eviction path of vLLM's ``BlockPool`` reports removed hashes through
        (``_emit_block_removed_events``, which queues ``BlockRemoved`` events only if the
        user configured KV events) and ``reset_prefix_cache``. vLLM's own KV events stay as
        the user configured them. (Turning the pool's events on instead makes it build a
        ``BlockStored`` event, token ids included, for every block it caches or reuses, on
        the scheduler's thread.)
        """
        pool: Any = self.kv_cache_manager.block_pool  # type: ignore[attr-defined]
        require_attributes(
            "scheduler", (pool, "_emit_block_removed_events"), (pool, "reset_prefix_cache")
        )
        emit_removed = pool._emit_block_removed_events
        reset = pool.reset_prefix_cache
        connector = self.aux_output_connector

        def emit_removed_and_observe(block_hashes: Any) -> Any:
            # one id per hash (raw hash bytes: eviction_ids' batch shortcut is for vLLM's ints)
            connector.observe_kv_evictions([eviction_id(get_block_hash(h)) for h in block_hashes])
            return emit_removed(block_hashes)

        def reset_and_observe() -> bool:
            done = bool(reset())
            if done:
                connector.observe_kv_cleared()
            return done

        pool._emit_block_removed_events = emit_removed_and_observe
        pool.reset_prefix_cache = reset_and_observe

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        connector = self.aux_output_connector
        failures = {}
        if connector is not None:
            failures = connector.observe_step(
                getattr(model_runner_output, "aux_output_connector_output", None)
            )
        failed = []
        if failures:
            failed = self.finish_requests(  # type: ignore[attr-defined]
                list(failures), RequestStatus.FINISHED_ERROR
            )
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        for request in failed:
            self._append_error_output(outputs, request, failures[request.request_id])
        if connector is not None and (late := connector.take_late_failures()):
            self._fail_late(outputs, late)
        return outputs

    def _fail_late(
        self, outputs: dict[int, EngineCoreOutputs], failures: dict[str, R3Failure]
    ) -> None:
        """Requests whose rows our connector could not take during vLLM's processing: one that
        finished in this step gets its terminal output turned into the error (never answered
        with partial R3); one still running is finished with the error."""
        pending = dict(failures)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                failure = pending.get(output.request_id)
                if failure is not None and output.finish_reason is not None:
                    output.finish_reason = FinishReason.ERROR
                    output.stop_reason = failure.as_stop_reason()
                    output.routed_experts = None
                    del pending[output.request_id]
                    _log_failed(output.request_id, failure)
        running = [rid for rid in pending if rid in self.requests]
        if running:
            for request in self.finish_requests(  # type: ignore[attr-defined]
                running, RequestStatus.FINISHED_ERROR
            ):
                self._append_error_output(outputs, request, pending[request.request_id])

    @staticmethod
    def _append_error_output(
        outputs: dict[int, EngineCoreOutputs], request: Any, failure: R3Failure
    ) -> None:
        engine_outputs = outputs.get(request.client_index)
        if engine_outputs is None:
            engine_outputs = outputs[request.client_index] = EngineCoreOutputs()
        engine_outputs.outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                stop_reason=failure.as_stop_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
        )
        _log_failed(request.request_id, failure)


def _log_failed(request_id: str, failure: R3Failure) -> None:
    logger.warning(
        "vllm-artifact: request %s finished with an error (%s); the engine goes on",
        request_id,
        failure.reason,
    )


class ArtifactScheduler(_ArtifactSchedulerMixin, Scheduler):
    """vLLM's synchronous scheduler with the Artifact Connector."""


class ArtifactAsyncScheduler(_ArtifactSchedulerMixin, AsyncScheduler):
    """vLLM's asynchronous scheduler with the Artifact Connector."""
