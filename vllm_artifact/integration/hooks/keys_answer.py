"""Hook: a keys-only handle is answered only once it resolves to exactly its request's rows.

The engine makes a keys-only request's :class:`R3Keys` handle when the request finishes; its
last objects reach the store a step later (the background publisher writes them), a failed
publication (a full store, a stalled one) leaves them absent, and a key another request
published first with other routing names that request's rows. So before the frontend answers,
it reads the handle the way a trainer will (:func:`vllm_artifact.client.read_r3_keys`: waits,
bounded, for the objects, checks every object and the rows' digest ``rows_xxh3``). A handle
that does not resolve fails its request closed with the reason (HTTP 500 with the message;
offline ``finish_reason == "error"``); the engine and every other request go on. On the API
server the handles are read in a worker thread (``asyncio.to_thread``), so the event loop
serves everyone else meanwhile; offline (``LLM.generate``) an in-process engine core is
stepped once first (it publishes a finished request's last objects in its next step).
Frontend process only, patched when vLLM loads the module; registry: ``hooks/__init__.py``,
hook ``keys_answer``.

The cost is one read of the handle's objects in the frontend (the store's read path: a few
milliseconds per 32K-token DeepSeek-V3 request), against shipping and encoding the rows.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Iterable
from types import ModuleType
from typing import Any

from vllm_artifact.client.reader import read_r3_keys
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.handoff import R3Keys
from vllm_artifact.errors import ArtifactError
from vllm_artifact.integration.hooks.after_import import patch_module
from vllm_artifact.integration.hooks.patching import require_attributes, wrap_once
from vllm_artifact.integration.hooks.request_errors import record_failure

logger = logging.getLogger("vllm.artifact")

_HOOK = "keys_answer"
_ASYNC_LLM = "vllm.v1.engine.async_llm"
_OFFLINE = "vllm.entrypoints.common.offline"


def handle_failure(request_id: str, handle: R3Keys) -> R3Failure | None:
    """None if ``handle`` reads back as its request's rows, else why it does not."""
    try:
        read_r3_keys(handle)
    except Exception as error:  # a reader must never take the frontend down
        reason = error.reason if isinstance(error, ArtifactError) else "internal"
        if not isinstance(error, ArtifactError):
            logger.exception("vllm-artifact: reading the keys handle of %s failed", request_id)
        return R3Failure(
            reason,
            f"R3 (routed experts) for request {request_id} is unavailable ({reason}): its keys "
            f"handle does not resolve to the request's rows: {error}",
        )
    return None


def _handles(output: Any) -> Iterable[tuple[Any, R3Keys]]:
    for completion in getattr(output, "outputs", None) or ():
        handle = getattr(completion, "routed_experts", None)
        if isinstance(handle, R3Keys):
            yield completion, handle


def _fail(output: Any, completion: Any, failure: R3Failure) -> None:
    """Turn a completion whose handle does not resolve into an R3 failure (as the engine's
    own failures look: finish reason ``error``, the message in ``stop_reason``)."""
    completion.finish_reason = "error"
    completion.stop_reason = failure.as_stop_reason()
    completion.routed_experts = None
    record_failure(output.request_id, failure)
    logger.error("vllm-artifact: %s", failure.message)


def check_outputs(outputs: Iterable[Any]) -> None:
    """Read every keys handle of finished ``outputs``; fail those that do not resolve."""
    for output in outputs:
        if getattr(output, "finished", False):
            for completion, handle in _handles(output):
                failure = handle_failure(output.request_id, handle)
                if failure is not None:
                    _fail(output, completion, failure)


async def check_output_async(output: Any) -> None:
    """:func:`check_outputs` for one output, reading in a worker thread."""
    for completion, handle in _handles(output):
        failure = await asyncio.to_thread(handle_failure, output.request_id, handle)
        if failure is not None:
            _fail(output, completion, failure)


def _wrap_generate(original: Any) -> Any:
    @functools.wraps(original)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        outputs = original(self, *args, **kwargs)
        try:
            async for output in outputs:
                if output.finished:
                    await check_output_async(output)
                yield output
        finally:
            await outputs.aclose()

    return generate


def _wrap_run_engine(original: Any) -> Any:
    @functools.wraps(original)
    def _run_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original(self, *args, **kwargs)
        if any(True for output in outputs for _ in _handles(output)):
            engine = self.llm_engine
            if type(engine.engine_core).__name__ == "InprocClient":
                engine.step()  # delivers the finished requests (and their tails) to the worker
            check_outputs(outputs)
        return outputs

    return _run_engine


def _patch(module: ModuleType) -> None:
    if module.__name__ == _ASYNC_LLM:
        require_attributes(_HOOK, (module, "AsyncLLM"))
        require_attributes(_HOOK, (module.AsyncLLM, "generate"))
        wrap_once(module.AsyncLLM, "generate", _wrap_generate)
    else:
        require_attributes(_HOOK, (module, "OfflineInferenceMixin"))
        require_attributes(_HOOK, (module.OfflineInferenceMixin, "_run_engine"))
        wrap_once(module.OfflineInferenceMixin, "_run_engine", _wrap_run_engine)


def install() -> None:
    for name, attribute in ((_ASYNC_LLM, "AsyncLLM"), (_OFFLINE, "OfflineInferenceMixin")):
        if not patch_module(name, attribute, _patch):
            logger.debug("vllm-artifact: %s is being imported; patched once it is", name)
