"""Hook: a request that failed for R3 reasons reaches the user with our message (registry:
``hooks/__init__.py``, hook ``request_errors``).

Our scheduler finishes such a request with finish reason ``error`` and the message in
``stop_reason``; vLLM's OpenAI server would answer it with a generic HTTP 500. The message is
remembered by external request id when the output is made (and counted by reason,
``vllm_artifact_failed_requests_total``; offline users read it from ``stop_reason`` with
:func:`vllm_artifact.client.r3_failure`) and raised as vLLM's ``GenerationError`` (HTTP 500)
when the serving layer checks the finish reason. Frontend process only.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from vllm.entrypoints.generate.base.serving import GenerateBaseServing
from vllm.exceptions import GenerationError
from vllm.v1.engine import FinishReason
from vllm.v1.engine.output_processor import RequestState

from vllm_artifact.core.failure import R3Failure, r3_failure
from vllm_artifact.integration.hooks.patching import require_attributes, wrap_once
from vllm_artifact.integration.metrics import FAILED_REQUESTS

require_attributes(
    "request_errors",
    (RequestState, "make_request_output"),
    (GenerateBaseServing, "_raise_if_error"),
)

_MAX_REMEMBERED = 4096


class _FailureMessages:
    """Messages of recently failed requests by external request id (bounded, thread-safe)."""

    def __init__(self) -> None:
        self._messages: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, request_id: str, message: str) -> None:
        with self._lock:
            self._messages[request_id] = message
            while len(self._messages) > _MAX_REMEMBERED:
                self._messages.popitem(last=False)

    def take(self, request_id: str, ids: _IdRule) -> str | None:
        """The message of ``request_id`` or of one of its per-prompt ids, as ``ids`` (the
        serving layer's naming) says. Never a prefix match: a client choosing
        ``X-Request-Id: job-1`` must not get the message of ``job-1-2-0``."""
        with self._lock:
            if ids.itself and request_id in self._messages:
                return self._messages.pop(request_id)
            cut = len(request_id)
            for key in self._messages:
                if key.startswith(request_id) and ids.per_prompt.fullmatch(key, cut):
                    return self._messages.pop(key)
        return None


class _IdRule(NamedTuple):
    """How a serving class names the engine requests of one HTTP request (vLLM 0.32)."""

    itself: bool  # one engine request may carry the HTTP request's own id
    per_prompt: re.Pattern[str]  # what follows the id in a per-prompt id


#: Completions: always ``<id>-<prompt index>``; chat, batch chat: ``<id>`` for one
#: conversation, else ``<id>_<index>``; token-in/token-out and the rest: ``<id>``.
_COMPLETIONS = _IdRule(itself=False, per_prompt=re.compile(r"-[0-9]+"))
_OTHERS = _IdRule(itself=True, per_prompt=re.compile(r"_[0-9]+"))


def _id_rule(serving: Any) -> _IdRule:
    names = {cls.__name__ for cls in type(serving).__mro__}
    return _COMPLETIONS if "OpenAIServingCompletion" in names else _OTHERS


FAILURES = _FailureMessages()


def record_failure(external_request_id: str, failure: R3Failure) -> None:
    """Count a request that failed for R3 reasons and keep its message for its HTTP answer."""
    FAILURES.remember(external_request_id, failure.message)
    FAILED_REQUESTS.labels(failure.reason).inc()


def _wrap_make_request_output(original: Any) -> Any:
    @functools.wraps(original)
    def make_request_output(
        self: Any,
        new_token_ids: Any,
        pooling_output: Any,
        finish_reason: Any,
        stop_reason: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if finish_reason == FinishReason.ERROR:
            failure = r3_failure(stop_reason)
            if failure is not None:
                record_failure(self.external_req_id, failure)
        return original(
            self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs
        )

    return make_request_output


def _wrap_raise_if_error(original: Any) -> Any:
    @functools.wraps(original)
    def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
        if finish_reason == "error":
            message = FAILURES.take(request_id, _id_rule(self))
            if message is not None:
                raise GenerationError(message)
        original(self, finish_reason, request_id)

    return _raise_if_error


def install() -> None:
    for owner, name, wrap in (
        (RequestState, "make_request_output", _wrap_make_request_output),
        (GenerateBaseServing, "_raise_if_error", _wrap_raise_if_error),
    ):
        wrap_once(owner, name, wrap)
