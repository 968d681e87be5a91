"""Hook: how a finished request's R3 leaves vLLM's frontend (keys handles, fast ``.npy``).

Two wraps, frontend process only, checked against vLLM 0.32.0:

* ``vllm.v1.engine.output_processor.RequestState._new_completion_output``: at a request's
  end vLLM concatenates its per-step R3 chunks (``np.concatenate``); we concatenate them into
  the data part of a complete ``.npy`` file instead (same array, same single copy:
  :func:`vllm_artifact.core.npy.concatenate_into_npy`), and a transported keys-only handle
  (``R3Keys.to_transport``: a small uint8 array, not rows) becomes an :class:`R3Keys` object on
  the completion (offline users get it in ``outputs[i].routed_experts``);
* the module global ``numpy2base64`` in the completions, chat and token-in/token-out serving
  modules: a handle is sent as its JSON text; an array is encoded by
  :func:`vllm_artifact.core.npy.encode_npy_base64` (the same text as vLLM's ``np.save`` +
  base64, without its ``BytesIO`` and ``bytes`` copies; no copy at all for an array from the
  wrap above).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np
from vllm.entrypoints.openai.chat_completion import serving as chat_serving
from vllm.entrypoints.openai.completion import serving as completion_serving
from vllm.entrypoints.scale_out.token_in_token_out import serving as tito_serving
from vllm.v1.engine.output_processor import RequestState

from vllm_artifact.core.handoff import R3Keys
from vllm_artifact.core.npy import concatenate_into_npy, encode_npy_base64
from vllm_artifact.integration.hooks import wrap_once

_SERVING_MODULES = (completion_serving, chat_serving, tito_serving)
for _module in _SERVING_MODULES:
    assert hasattr(_module, "numpy2base64"), (
        f"{_module.__name__}.numpy2base64 is gone; update vllm-artifact's terminal_output hook"
    )
assert list(inspect.signature(RequestState._new_completion_output).parameters)[:4] == [
    "self",
    "token_ids",
    "finish_reason",
    "stop_reason",
], "RequestState._new_completion_output changed; update vllm-artifact's terminal_output hook"


def _wrap_new_completion_output(original: Any) -> Any:
    @functools.wraps(original)
    def _new_completion_output(
        self: Any, token_ids: Any, finish_reason: Any, stop_reason: Any, *args: Any, **kwargs: Any
    ) -> Any:
        chunks = self.routed_experts_chunks
        merged = concatenate_into_npy(chunks) if finish_reason is not None and chunks else None
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
        return output

    return _new_completion_output


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


def install() -> None:
    wrap_once(RequestState, "_new_completion_output", _wrap_new_completion_output)
    for module in _SERVING_MODULES:
        wrap_once(module, "numpy2base64", _wrap_numpy2base64)
