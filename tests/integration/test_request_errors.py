"""A failed request's message reaches exactly that request's HTTP answer (the request_errors
hook), whatever request ids clients choose."""

from __future__ import annotations

import pytest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.exceptions import GenerationError

from vllm_artifact.integration.hooks import apply_all, request_errors

apply_all()


def raised(serving_cls: type, request_id: str) -> str | None:
    """The message ``_raise_if_error`` raises for an errored request, as vLLM calls it."""
    serving = object.__new__(serving_cls)
    try:
        serving._raise_if_error("error", request_id)
    except GenerationError as error:
        return str(error)
    return None


@pytest.fixture(autouse=True)
def fresh_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_errors, "FAILURES", request_errors._FailureMessages())


def test_completions_never_take_another_clients_message() -> None:
    """X-Request-Id "job-1" and "job-1-2": vLLM names their prompts cmpl-job-1-<n> and
    cmpl-job-1-2-<n>; a prefix match gave job-1 the other client's message."""
    request_errors.FAILURES.remember("cmpl-job-1-2-0", "R3 of job-1-2 is missing")
    assert raised(OpenAIServingCompletion, "cmpl-job-1") == "Internal server error"
    request_errors.FAILURES.remember("cmpl-job-1-1", "R3 of job-1's second prompt is corrupt")
    assert raised(OpenAIServingCompletion, "cmpl-job-1") == "R3 of job-1's second prompt is corrupt"
    assert raised(OpenAIServingCompletion, "cmpl-job-1-2") == "R3 of job-1-2 is missing"


def test_a_completions_id_is_never_matched_whole() -> None:
    """cmpl-job-1-2 is prompt 2 of client job-1; client job-1-2's prompts are cmpl-job-1-2-<n>."""
    request_errors.FAILURES.remember("cmpl-job-1-2", "R3 of job-1's third prompt is missing")
    assert raised(OpenAIServingCompletion, "cmpl-job-1-2") == "Internal server error"
    assert raised(OpenAIServingCompletion, "cmpl-job-1") == "R3 of job-1's third prompt is missing"


def test_chat_ids() -> None:
    request_errors.FAILURES.remember("chatcmpl-a-b", "not a's")
    assert raised(OpenAIServingChat, "chatcmpl-a") == "Internal server error"
    request_errors.FAILURES.remember("chatcmpl-a", "a's")
    assert raised(OpenAIServingChat, "chatcmpl-a") == "a's"
    request_errors.FAILURES.remember("chatcmpl-c_1", "c's second conversation")
    assert raised(OpenAIServingChat, "chatcmpl-c") == "c's second conversation"
    assert raised(OpenAIServingChat, "chatcmpl-a-b") == "not a's"
