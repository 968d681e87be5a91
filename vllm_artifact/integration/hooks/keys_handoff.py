"""Hook: the request option ``routed_experts_format`` ("array" or "keys") in vLLM's frontend.

Our scheduler connector puts a keys-only request's :class:`R3Keys` handle into vLLM's
routed-experts transport; the ``terminal_output`` hook turns it into the object and its JSON
text. This hook validates the option where vLLM checks its own sampling parameters, so a bad
value is refused (``VLLMValidationError``: HTTP 400, offline raised) before the request
reaches the engine; the OpenAI request classes check it too (but for "is R3 on", which only
the engine knows) while building the parameters, so a streamed request gets a real HTTP 400,
not an error event inside a 200 stream. Frontend process only; registry:
``hooks/__init__.py``, hook ``keys_handoff``.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

from vllm_artifact.integration.hooks.patching import require_attributes, wrap_once
from vllm_artifact.integration.request_options import check_format_option

_REQUEST_CLASSES = (CompletionRequest, ChatCompletionRequest)
require_attributes(
    "keys_handoff",
    (InputProcessor, "_validate_params"),
    *((cls, "to_sampling_params") for cls in _REQUEST_CLASSES),
)


def _wrap_validate_params(original: Any) -> Any:
    @functools.wraps(original)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            check_format_option(
                params,
                r3_enabled=self.vllm_config.aux_output_config.enable_return_routed_experts,
            )
        return result

    return _validate_params


def _wrap_to_sampling_params(original: Any) -> Any:
    @functools.wraps(original)
    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = original(self, *args, **kwargs)
        if isinstance(params, SamplingParams) and params.extra_args:
            check_format_option(params, r3_enabled=None)
        return params

    return to_sampling_params


def install() -> None:
    for owner, name, wrap in (
        (InputProcessor, "_validate_params", _wrap_validate_params),
        *((cls, "to_sampling_params", _wrap_to_sampling_params) for cls in _REQUEST_CLASSES),
    ):
        wrap_once(owner, name, wrap)
