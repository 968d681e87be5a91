"""Per-request options of the Artifact Connector (``SamplingParams.extra_args``; over HTTP
``vllm_xargs``), checked where vLLM checks its own sampling parameters.

``routed_experts_format``: ``"array"`` (default: the rows in the response) or ``"keys"`` (an
``R3Keys`` handle naming the store objects; see ``vllm_artifact.core.handoff``).
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams

from vllm_artifact.core.handoff import R3_FORMAT_OPTION
from vllm_artifact.integration.options import ENABLE_FLAG

FORMATS = ("array", "keys")


def check_format_option(params: SamplingParams, *, r3_enabled: bool | None) -> None:
    """Refuse a bad ``routed_experts_format`` with a message that says what to send
    (``r3_enabled=None``: not known here, not checked)."""
    value = (params.extra_args or {}).get(R3_FORMAT_OPTION)
    if value is None:
        return
    if value not in FORMATS:
        raise VLLMValidationError(
            f"{R3_FORMAT_OPTION} must be one of {', '.join(map(repr, FORMATS))}, got {value!r} "
            f'(HTTP: "vllm_xargs": {{"{R3_FORMAT_OPTION}": "keys"}})',
            parameter=R3_FORMAT_OPTION,
            value=value,
        )
    if r3_enabled is False:
        raise VLLMValidationError(
            f"{R3_FORMAT_OPTION} needs routed experts: start the server with {ENABLE_FLAG} "
            "(offline: LLM(..., enable_routed_experts=True))",
            parameter=R3_FORMAT_OPTION,
            value=value,
        )
    if value == "keys" and params.stop:
        # vLLM matches stop strings in the frontend and aborts the request in the engine,
        # which then never finishes it normally: no handle, no terminal object.
        raise VLLMValidationError(
            f'{R3_FORMAT_OPTION}="keys" cannot be combined with stop strings (vLLM matches them '
            "outside the engine): stop on token ids (stop_token_ids) instead, or use "
            f'{R3_FORMAT_OPTION}="array"',
            parameter="stop",
            value=params.stop,
        )
    if value == "keys" and params.output_kind == RequestOutputKind.DELTA:
        raise VLLMValidationError(
            f'{R3_FORMAT_OPTION}="keys" needs a non-streaming request (streamed chunks carry '
            'no routed experts): send "stream": false',
            parameter=R3_FORMAT_OPTION,
            value=value,
        )
