"""Hook: a keys-only handle is answered only once it resolves to exactly its request's rows.

The engine makes a keys-only request's :class:`R3Keys` handle when the request finishes; its
last objects reach the store a step later (the background publisher writes them), a failed
publication (a full store, a stalled one) leaves them absent, and a key another request
published first with other routing names that request's rows. So before the frontend answers,
it checks the handle (:meth:`vllm_artifact.client.R3Reader.verify`: waits, bounded, for the
objects; then compares their envelopes' checksums with the handle's ``objects_xxh3``, which
the engine computed from the request's rows as the store does, reading no payload; a handle
with ``rows_xxh3`` instead, or one that does not match, is read back the way a trainer reads
it, which says what is wrong). A handle
that does not resolve fails its request closed with the reason (HTTP 500 with the message;
offline ``finish_reason == "error"``); the engine and every other request go on. On the API
server the handles are read in a worker thread (``asyncio.to_thread``), so the event loop
serves everyone else meanwhile. Offline (``LLM.generate``) a handle is read at the first
engine step after its objects are all in the store, while the rest of the batch runs on the
GPU; at the run's end only the last steps' handles are left to read (an in-process engine core
is stepped once first: it publishes a finished request's last objects in its next step).
Frontend process only, patched when vLLM loads the module; registry: ``hooks/__init__.py``,
hook ``keys_answer``.

The cost is a lookup of the handle's objects in the store's index and one 64-byte envelope
each, against shipping and encoding the rows (a full read is a copy and a checksum of every
payload: a few milliseconds per 32K-token DeepSeek-V3 request).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Container, Iterable
from types import ModuleType
from typing import Any

from vllm_artifact.client.reader import default_reader
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
_LLM_ENGINE = "vllm.v1.engine.llm_engine"


def handle_failure(request_id: str, handle: R3Keys) -> R3Failure | None:
    """None if ``handle`` reads back as its request's rows, else why it does not."""
    try:
        default_reader().verify(handle)
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


def _check(output: Any, completion: Any, handle: R3Keys) -> None:
    failure = handle_failure(output.request_id, handle)
    if failure is not None:
        _fail(output, completion, failure)


def _finished_handles(outputs: Iterable[Any]) -> Iterable[tuple[Any, Any, R3Keys]]:
    """(output, completion, handle) of every keys handle of the finished ``outputs``."""
    for output in outputs:
        if getattr(output, "finished", False):
            for completion, handle in _handles(output):
                yield output, completion, handle


def check_outputs(outputs: Iterable[Any], *, read_already: Container[int] = ()) -> None:
    """Read every keys handle of finished ``outputs`` but those of the completions whose
    ``id`` is in ``read_already``; fail those that do not resolve."""
    for output, completion, handle in _finished_handles(outputs):
        if id(completion) not in read_already:
            _check(output, completion, handle)


class OfflineHandles:
    """The keys handles of one offline run, read back while it runs: at each engine step,
    those of earlier steps whose objects are all in the store by then (in finishing order; the
    first not yet published stops the pass), the rest at the run's end. A read at the end of
    a batch would otherwise wait for all of its requests' R3 at once, the GPU idle."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[Any, Any, R3Keys]] = deque()
        self._checked: set[int] = set()  # ids of completions read back (alive in the run)

    def step_done(self, step_outputs: Iterable[Any]) -> None:
        """After an engine step: read what has been published since, then queue this
        step's finished handles (their last objects come with the next step)."""
        if self._waiting:
            reader = default_reader()
            while self._waiting:
                match = reader.envelopes_match(self._waiting[0][2])
                if match is None:  # not all published yet
                    break
                output, completion, handle = self._waiting.popleft()
                self._checked.add(id(completion))
                if not match:  # a read decides, and says why it does not resolve
                    _check(output, completion, handle)
        self._waiting.extend(_finished_handles(step_outputs))

    def finish(self, outputs: Iterable[Any]) -> None:
        """Every handle of the run's ``outputs`` not read yet (waiting, bounded, for its
        objects); the outputs the steps never showed included."""
        self._waiting.clear()
        check_outputs(outputs, read_already=self._checked)


#: the offline run in progress on this thread (``LLM._run_engine`` steps its engine on the
#: calling thread); engine steps outside a run read nothing
_RUN = threading.local()


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


def _wrap_step(original: Any) -> Any:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        step_outputs = original(self, *args, **kwargs)
        handles: OfflineHandles | None = getattr(_RUN, "handles", None)
        if handles is not None:
            handles.step_done(step_outputs)
        return step_outputs

    return step


def _wrap_run_engine(original: Any) -> Any:
    @functools.wraps(original)
    def _run_engine(self: Any, *args: Any, **kwargs: Any) -> Any:
        handles, outer = OfflineHandles(), getattr(_RUN, "handles", None)
        _RUN.handles = handles
        try:
            outputs = original(self, *args, **kwargs)
        finally:
            _RUN.handles = outer
        if any(True for output in outputs for _ in _handles(output)):
            engine = self.llm_engine
            if type(engine.engine_core).__name__ == "InprocClient":
                engine.step()  # delivers the finished requests (and their tails) to the worker
            handles.finish(outputs)
        return outputs

    return _run_engine


def _patch(module: ModuleType) -> None:
    if module.__name__ == _ASYNC_LLM:
        require_attributes(_HOOK, (module, "AsyncLLM"))
        require_attributes(_HOOK, (module.AsyncLLM, "generate"))
        wrap_once(module.AsyncLLM, "generate", _wrap_generate)
    elif module.__name__ == _LLM_ENGINE:
        require_attributes(_HOOK, (module, "LLMEngine"))
        require_attributes(_HOOK, (module.LLMEngine, "step"))
        wrap_once(module.LLMEngine, "step", _wrap_step)
    else:
        require_attributes(_HOOK, (module, "OfflineInferenceMixin"))
        require_attributes(_HOOK, (module.OfflineInferenceMixin, "_run_engine"))
        wrap_once(module.OfflineInferenceMixin, "_run_engine", _wrap_run_engine)


def install() -> None:
    for name, attribute in (
        (_ASYNC_LLM, "AsyncLLM"),
        (_LLM_ENGINE, "LLMEngine"),
        (_OFFLINE, "OfflineInferenceMixin"),
    ):
        if not patch_module(name, attribute, _patch):
            logger.debug("vllm-artifact: %s is being imported; patched once it is", name)
