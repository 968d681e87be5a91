"""Hook: how a finished request's R3 leaves vLLM's frontend (keys handles, fast ``.npy``;
registry: ``hooks/__init__.py``, hook ``terminal_output``).

Four wraps, frontend process only. A request's R3 chunks are copied on arrival into the data
part of a complete ``.npy`` file (``RequestState``'s chunk list is an
:class:`~vllm_artifact.core.row_assembly.ArrivingRows`), so that at its end they are joined
already; where that list holds anything else they are concatenated then, into such a file (the
one copy vLLM's ``np.concatenate`` made: :func:`vllm_artifact.core.npy.concatenate_into_npy`).
A transported keys-only handle (``R3Keys.to_transport``: a small uint8 array, not rows) becomes
an :class:`R3Keys` on the completion (offline users get it in ``outputs[i].routed_experts``).
``numpy2base64`` sends a handle as its JSON text and encodes an array with
:func:`vllm_artifact.core.npy.encode_npy_base64` (vLLM's text without its ``BytesIO`` and
``bytes`` copies). The API routers' ``JSONResponse`` becomes a subclass that renders the same
bytes but joins each choice's base64 ``routed_experts`` in instead of having ``json.dumps``
scan it (:func:`vllm_artifact.core.json_splice.render_spliced`).

The serving and router modules are never imported here: hooks install while
``vllm.engine.arg_utils`` loads, which can be in the middle of vLLM importing one of them, and
importing another then fails (an import cycle). They are patched when vLLM loads them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any

import numpy as np
from starlette.responses import JSONResponse
from vllm.utils import serial_utils
from vllm.v1.engine import FinishReason
from vllm.v1.engine.output_processor import RequestState

from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.handoff import R3Keys
from vllm_artifact.core.json_splice import render_spliced
from vllm_artifact.core.npy import concatenate_into_npy, encode_npy_base64
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_assembly import RESERVE_ROWS_MAX, ArrivingRows, FilePool
from vllm_artifact.integration.hooks.after_import import patch_module
from vllm_artifact.integration.hooks.patching import require, require_attributes, wrap_once
from vllm_artifact.integration.hooks.request_errors import record_failure
from vllm_artifact.integration.metrics import FRONTEND_FILES

logger = logging.getLogger("vllm.artifact")

_HOOK = "terminal_output"
require_attributes(_HOOK, (serial_utils, "numpy2base64"))
#: They import ``numpy2base64`` from ``vllm.utils.serial_utils``, which we wrap at its
#: source; one that imported it before gets the wrap in its globals when it is loaded (now,
#: or when vLLM imports it). None of them is imported here: that could close an import cycle
#: vLLM is in the middle of (hooks/after_import.py).
_SERVING_MODULES = (
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.scale_out.token_in_token_out.serving",
)
#: Patched when they are loaded (or now, if they are); their ``JSONResponse`` is checked then.
_ROUTER_MODULES = (
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.openai.chat_completion.api_router",
    "vllm.entrypoints.scale_out.token_in_token_out.api_router",
)
require_attributes(_HOOK, (RequestState, "_new_completion_output"))
require(
    "routed_experts_chunks" in RequestState.__init__.__code__.co_names,
    _HOOK,
    "RequestState.__init__ no longer sets routed_experts_chunks",
)
require(
    list(inspect.signature(RequestState._new_completion_output).parameters)[:4]
    == ["self", "token_ids", "finish_reason", "stop_reason"],
    _HOOK,
    "RequestState._new_completion_output's parameters changed",
)


#: The memory of the frontend's R3 files, used again once the rows of earlier requests are
#: dropped (core/row_assembly.py says why). What it keeps is bounded; beyond that a file is
#: fresh memory, as before. Finer size classes: a caller keeping the rows keeps its file's
#: buffer (made for the prompt and token budget), at most a quarter larger than that file.
FRONTEND_FILES_MAX_BYTES = 256 * 1024 * 1024
_FILES = FilePool(RecycledArrays(max_bytes=FRONTEND_FILES_MAX_BYTES, steps_per_doubling=4))


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        chunks = getattr(self, "routed_experts_chunks", None)
        if type(chunks) is list and not chunks:
            # Rows to come: the prompt's and up to the token budget's (the last token has none)
            budget = self.max_tokens_param if isinstance(self.max_tokens_param, int) else 0
            prompt = self.prompt_len if isinstance(self.prompt_len, int) else 0
            reserve = prompt + min(budget, RESERVE_ROWS_MAX)
            self.routed_experts_chunks = ArrivingRows(reserve, _FILES)

    return __init__


def _wrap_new_completion_output(original: Any) -> Any:
    @functools.wraps(original)
    def _new_completion_output(
        self: Any, token_ids: Any, finish_reason: Any, stop_reason: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if finish_reason is None or not self.routed_experts_chunks:
            return original(self, token_ids, finish_reason, stop_reason, *args, **kwargs)
        if finish_reason == FinishReason.ERROR:
            # Failed after some of its rows arrived (R3 lost mid-request): no partial answer.
            self.routed_experts_chunks = []
            output = original(self, token_ids, finish_reason, stop_reason, *args, **kwargs)
            output.routed_experts = None
            return output
        try:
            return _finished_output(
                original, self, token_ids, finish_reason, stop_reason, *args, **kwargs
            )
        except Exception as error:
            # This runs in AsyncLLM's output handler, which serves every request: an
            # exception here would take the whole API server down. Fail this request only.
            logger.exception("vllm-artifact: R3 of request %s not assembled", self.external_req_id)
            failure = R3Failure(
                "internal",
                f"R3 (routed experts) for request {self.external_req_id} could not be "
                f"assembled: {error} (an internal error of vllm-artifact: please report it)",
            )
            record_failure(self.external_req_id, failure)
            self.routed_experts_chunks = []
            output = original(
                self, token_ids, FinishReason.ERROR, failure.as_stop_reason(), *args, **kwargs
            )
            output.routed_experts = None
            return output

    return _new_completion_output


def _finished_output(
    original: Any,
    self: Any,
    token_ids: Any,
    finish_reason: Any,
    stop_reason: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A finished request's output, its R3 chunks joined into a ``.npy`` (or its keys
    handle made an :class:`R3Keys`)."""
    chunks = self.routed_experts_chunks
    merged = chunks.joined() if isinstance(chunks, ArrivingRows) else None
    how = "adopted" if isinstance(chunks, ArrivingRows) and chunks.adopted else "copied"
    if merged is None:
        merged, how = concatenate_into_npy(chunks), "concatenated"
    if merged is None:
        output = original(self, token_ids, finish_reason, stop_reason, *args, **kwargs)
    else:
        self.routed_experts_chunks = []  # vLLM's concatenation: already done
        try:
            output = original(self, token_ids, finish_reason, stop_reason, *args, **kwargs)
        finally:
            self.routed_experts_chunks = chunks
        output.routed_experts = merged
    transported = output.routed_experts
    if transported is not None and R3Keys.is_transport(transported):
        output.routed_experts = R3Keys.from_transport(transported)
    elif merged is not None:
        FRONTEND_FILES.labels(how).inc()
    return output


def _wrap_numpy2base64(original: Any) -> Any:
    @functools.wraps(original)
    def numpy2base64(array: Any) -> str:
        if isinstance(array, R3Keys):
            return array.to_json()
        if isinstance(array, np.ndarray):
            return encode_npy_base64(array)
        result: str = original(array)
        return result

    return numpy2base64


def _wrap_json_response(original: type[JSONResponse]) -> type[JSONResponse]:
    class R3JSONResponse(original):  # type: ignore[valid-type,misc]
        """vLLM's JSON response; base64 R3 is joined into the text, not scanned by json."""

        def render(self, content: Any) -> bytes:
            spliced = render_spliced(content, super().render)
            if spliced is not None:
                return spliced
            rendered: bytes = super().render(content)
            return rendered

    R3JSONResponse.__qualname__ = R3JSONResponse.__name__
    return R3JSONResponse


def _install_json_response(router: ModuleType) -> None:
    current = router.__dict__.get("JSONResponse")
    require(
        isinstance(current, type) and issubclass(current, JSONResponse),
        _HOOK,
        f"{router.__name__}.JSONResponse is no longer Starlette's JSONResponse",
    )
    wrap_once(router, "JSONResponse", _wrap_json_response)
    logger.info(
        "vllm-artifact: %s renders R3 with the base64 joined into the JSON", router.__name__
    )


def _install_numpy2base64(serving: ModuleType) -> None:
    """A serving module's copy of ``numpy2base64``: ours already if it was imported after
    the source was wrapped (recorded then), else wrapped now."""
    wrap_once(serving, "numpy2base64", _wrap_numpy2base64)


def install() -> None:
    wrap_once(RequestState, "__init__", _wrap_init)
    wrap_once(RequestState, "_new_completion_output", _wrap_new_completion_output)
    wrap_once(serial_utils, "numpy2base64", _wrap_numpy2base64)
    for name in _SERVING_MODULES:
        if not patch_module(name, "numpy2base64", _install_numpy2base64):
            logger.debug("vllm-artifact: %s is being imported; patched once it is", name)
    for name in _ROUTER_MODULES:
        if not patch_module(name, "JSONResponse", _install_json_response):
            logger.debug("vllm-artifact: %s is being imported; patched once it is", name)
