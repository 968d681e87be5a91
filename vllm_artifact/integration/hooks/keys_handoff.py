"""Hook: the keys-only handoff (``routed_experts_format="keys"``) in vLLM's frontend.

Our scheduler connector puts a keys-only request's :class:`R3Keys` handle into vLLM's
routed-experts transport (``R3Keys.to_transport``: a small uint8 array, not rows). Four
wraps, frontend process only, checked against vLLM 0.32.0:

* ``vllm.v1.engine.input_processor.InputProcessor._validate_params``: the request option
  is checked where vLLM checks its own sampling parameters, so a bad value is refused
  (``VLLMValidationError``: HTTP 400, offline raised) before the request reaches the engine;
* ``CompletionRequest.to_sampling_params`` and ``ChatCompletionRequest.to_sampling_params``:
  the same check (but for "is R3 on", which only the engine knows) while the OpenAI server
  builds the parameters, before a streaming response has started: a streamed request gets a
  real HTTP 400, not an error event inside a 200 stream;
* ``vllm.v1.engine.output_processor.RequestState._new_completion_output``: the transported
  handle becomes an :class:`R3Keys` object on the completion (offline users get it in
  ``outputs[i].routed_experts``);
* the module global ``numpy2base64`` in the completions, chat and token-in/token-out serving
  modules: a handle is sent as its JSON text in ``routed_experts`` (arrays as before).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.entrypoints.openai.chat_completion import serving as chat_serving
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion import serving as completion_serving
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out import serving as tito_serving
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import RequestState

from vllm_artifact.core.handoff import R3Keys
from vllm_artifact.integration.hooks import wrap_once
from vllm_artifact.integration.request_options import check_format_option

_SERVING_MODULES = (completion_serving, chat_serving, tito_serving)
_REQUEST_CLASSES = (CompletionRequest, ChatCompletionRequest)
for _owner, _name in (
    (InputProcessor, "_validate_params"),
    *((cls, "to_sampling_params") for cls in _REQUEST_CLASSES),
    (RequestState, "_new_completion_output"),
    *((module, "numpy2base64") for module in _SERVING_MODULES),
):
    assert hasattr(_owner, _name), (
        f"{getattr(_owner, '__qualname__', None) or getattr(_owner, '__name__', _owner)}.{_name} "
        "is gone; update vllm-artifact's keys_handoff hook"
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


def _wrap_new_completion_output(original: Any) -> Any:
    @functools.wraps(original)
    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        transported = output.routed_experts
        if transported is not None and R3Keys.is_transport(transported):
            output.routed_experts = R3Keys.from_transport(transported)
        return output

    return _new_completion_output


def _wrap_numpy2base64(original: Any) -> Any:
    @functools.wraps(original)
    def numpy2base64(array: Any) -> str:
        if isinstance(array, R3Keys):
            return array.to_json()
        result: str = original(array)
        return result

    return numpy2base64


def install() -> None:
    for owner, name, wrap in (
        (InputProcessor, "_validate_params", _wrap_validate_params),
        (RequestState, "_new_completion_output", _wrap_new_completion_output),
        *((cls, "to_sampling_params", _wrap_to_sampling_params) for cls in _REQUEST_CLASSES),
        *((module, "numpy2base64", _wrap_numpy2base64) for module in _SERVING_MODULES),
    ):
        wrap_once(owner, name, wrap)
