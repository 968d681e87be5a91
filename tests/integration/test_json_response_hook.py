"""vLLM's completion, chat and token-in/token-out routers render with our JSONResponse, which
gives Starlette's bytes for vLLM's real response models, R3 or not (no engine is started)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from starlette.responses import JSONResponse
from vllm.entrypoints.openai.chat_completion import api_router as chat_router
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.openai.completion import api_router as completion_router
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
)
from vllm.entrypoints.scale_out.token_in_token_out import api_router as tito_router
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

from vllm_artifact.client import decode_routed_experts
from vllm_artifact.core.npy import encode_npy_base64
from vllm_artifact.integration.plugin import register

ROUTERS = [completion_router, chat_router, tito_router]
USAGE = UsageInfo(prompt_tokens=5, completion_tokens=3, total_tokens=8)


def rows(tokens: int) -> np.ndarray:
    return np.random.default_rng(tokens).integers(0, 254, (tokens, 4, 2), dtype=np.uint8)


def payload(tokens: int) -> str:
    return encode_npy_base64(rows(tokens))


def responses(r3: str | None) -> list[Any]:
    """One response of each endpoint, as vLLM's serving layer builds it."""
    return [
        CompletionResponse(
            model="m",
            choices=[
                CompletionResponseChoice(index=0, text='say "hi"\n', routed_experts=r3),
                CompletionResponseChoice(
                    index=1, text="é", routed_experts=r3, finish_reason="stop"
                ),
            ],
            usage=USAGE,
        ),
        ChatCompletionResponse(
            model="m",
            choices=[
                ChatCompletionResponseChoice(
                    index=0,
                    message=ChatMessage(role="assistant", content="\\ok\t"),
                    routed_experts=r3,
                )
            ],
            usage=USAGE,
        ),
        GenerateTokensResponse(
            choices=[GenerateTokensChoice(index=0, token_ids=[1, 2], routed_experts=r3)],
        ),
    ]


@pytest.fixture(scope="module", autouse=True)
def hooks() -> None:
    register()


def test_each_router_renders_with_our_subclass_of_starlettes_json_response() -> None:
    for router in ROUTERS:
        ours = router.JSONResponse
        assert ours is not JSONResponse and issubclass(ours, JSONResponse)
        assert ours.__name__ == "R3JSONResponse"


@pytest.mark.parametrize(
    "r3",
    [payload(3000), payload(1), None, '{"format":"r3-keys","keys":["ab"]}'],
    ids=["large-array", "one-row", "none", "keys-handle-json"],
)
def test_bytes_and_headers_are_starlettes(r3: str | None) -> None:
    for router in ROUTERS:
        for response in responses(r3):
            content = response.model_dump()
            ours, theirs = router.JSONResponse(content=content), JSONResponse(content=content)
            assert ours.body == theirs.body
            assert ours.headers == theirs.headers


def test_the_rendered_json_decodes_to_the_rows() -> None:
    body = completion_router.JSONResponse(content=responses(payload(3000))[0].model_dump()).body
    choices = json.loads(body)["choices"]
    assert len(choices) == 2
    for choice in choices:
        np.testing.assert_array_equal(decode_routed_experts(choice["routed_experts"]), rows(3000))


def test_error_responses_render_as_before() -> None:
    error = ErrorResponse(error=ErrorInfo(message='bad "x"', type="BadRequestError", code=400))
    content = error.model_dump()
    for router in ROUTERS:
        ours = router.JSONResponse(content=content, status_code=400)
        assert ours.body == JSONResponse(content=content, status_code=400).body
        assert ours.status_code == 400


FIRST_IMPORT = """
import {module}
import vllm_artifact.integration.hooks as hooks
from vllm.entrypoints.openai.chat_completion import serving as chat
from vllm.entrypoints.openai.completion import api_router
from vllm.utils import serial_utils
assert hooks._started, "the platform plugin did not install the hooks"
assert api_router.JSONResponse.__name__ == "R3JSONResponse"
assert getattr(chat.numpy2base64, hooks.WRAPPED_MARK, False)
assert getattr(serial_utils.numpy2base64, hooks.WRAPPED_MARK, False)
print("hooked")
"""


@pytest.mark.parametrize(
    "module",
    [
        "vllm.entrypoints.openai.chat_completion.api_router",
        "vllm.entrypoints.openai.completion.serving",
    ],
)
def test_importing_a_serving_module_first_works_and_is_hooked(module: str) -> None:
    """Our hooks install while ``vllm.engine.arg_utils`` loads, which can be in the middle of
    importing a serving module: importing another one then failed with an ImportError."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT.format(module=module)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("hooked")
