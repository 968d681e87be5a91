"""The ``routed_experts_format`` request option: every refusal says what to send instead."""

from __future__ import annotations

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams

from vllm_artifact.integration.request_options import check_format_option


def params(value: object, **fields: object) -> SamplingParams:
    return SamplingParams(extra_args={"routed_experts_format": value}, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["array", "keys"])
def test_valid_values_pass(value: str) -> None:
    check_format_option(params(value), r3_enabled=True)
    check_format_option(SamplingParams(), r3_enabled=False)  # no option: nothing to check


@pytest.mark.parametrize(
    "sampling, enabled, says",
    [
        (params("npz"), True, "must be one of 'array', 'keys', got 'npz'"),
        (params(["keys"]), None, "must be one of"),
        (params("keys"), False, "start the server with --enable-routed-experts"),
        (params("array"), False, "start the server with --enable-routed-experts"),
        (params("keys", stop=["</answer>"]), True, "stop on token ids (stop_token_ids)"),
        (params("keys", output_kind=RequestOutputKind.DELTA), True, '"stream": false'),
    ],
)
def test_refusals_name_the_fix(sampling: SamplingParams, enabled: bool | None, says: str) -> None:
    with pytest.raises(VLLMValidationError, match="routed_experts_format") as err:
        check_format_option(sampling, r3_enabled=enabled)
    assert says in str(err.value)
