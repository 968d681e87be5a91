"""Spliced JSON rendering must give exactly the renderer's own bytes (``json.dumps`` as
Starlette calls it is the oracle), and must leave to the renderer what it cannot prove safe."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_artifact.core import json_splice
from vllm_artifact.core.json_splice import render_spliced


def starlette_render(content: Any) -> bytes:
    """What ``starlette.responses.JSONResponse.render`` does (checked against it in
    tests/integration/test_json_response_hook.py)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def ascii_render(content: Any) -> bytes:
    return json.dumps(content).encode("ascii")  # another renderer: ASCII escapes, spaces


BASE64 = st.binary(min_size=1, max_size=300).map(lambda b: base64.b64encode(b).decode())
ESCAPED = ['a"b', "a\\b", "tab\there", "\x00", "line\n", "\x1f", "del\x7f", "é", "\u2028", "😀"]
NEEDS_ESCAPING = st.sampled_from(ESCAPED)
ANY_TEXT = st.text(max_size=20)
VALUES = st.one_of(
    BASE64,
    NEEDS_ESCAPING,
    ANY_TEXT,
    st.none(),
    st.integers(),
    st.just(""),
    st.lists(st.integers(), max_size=3),
)
CHOICE = st.fixed_dictionaries(
    {"index": st.integers(0, 9), "text": ANY_TEXT},
    optional={"routed_experts": VALUES, "logprobs": st.none(), "finish_reason": ANY_TEXT},
)
CONTENT = st.fixed_dictionaries(
    {"id": ANY_TEXT, "choices": st.lists(st.one_of(CHOICE, st.integers()), max_size=4)},
    optional={"usage": st.dictionaries(ANY_TEXT, st.integers(), max_size=3)},
)


@settings(max_examples=300, deadline=None)
@given(CONTENT, st.sampled_from([starlette_render, ascii_render]))
def test_spliced_rendering_is_the_renderers_own(content: dict[str, Any], render: Any) -> None:
    before = json.dumps(content)
    spliced = render_spliced(content, render)
    assert json.dumps(content) == before  # the caller's object is left as it was
    spliceable = [  # what the function must splice: ASCII that JSON writes as it is
        value
        for c in content["choices"]
        if isinstance(c, dict)
        and isinstance(value := c.get("routed_experts"), str)
        and value.isascii()
        and json.dumps(value) == f'"{value}"'
        and value
    ]
    if spliceable:
        assert spliced == render(content)
    else:
        assert spliced is None


@pytest.mark.parametrize("render", [starlette_render, ascii_render])
@pytest.mark.parametrize("value", ESCAPED)
def test_a_string_that_may_need_escaping_is_left_to_the_renderer(value: str, render: Any) -> None:
    alone = {"choices": [{"routed_experts": value}]}
    assert render_spliced(alone, render) is None
    beside = {"choices": [{"routed_experts": value}, {"routed_experts": "QUJD"}]}
    assert render_spliced(beside, render) == render(beside)


def test_a_large_payload_is_spliced_and_the_rest_escaped_as_usual() -> None:
    payload = base64.b64encode(bytes(range(256)) * 4096).decode()  # 1.4 MB of base64
    content = {
        "id": 'cmpl-"quoted"\n',
        "choices": [
            {"index": 0, "text": "naïve \\ text", "routed_experts": payload, "stop_reason": None},
            {"index": 1, "text": "", "routed_experts": None},
            {"index": 2, "text": "x", "routed_experts": payload[:12]},
        ],
        "usage": {"prompt_tokens": 3},
    }
    assert render_spliced(content, starlette_render) == starlette_render(content)


@pytest.mark.parametrize(
    "content",
    [
        {"error": {"message": "no choices"}},
        {"choices": "not a list"},
        {"choices": [{"routed_experts": '{"format": "keys"}'}]},  # a keys handle: quotes
        {"choices": [{"routed_experts": ""}]},
        {"choices": [{"text": "no field"}]},
        [1, 2],
    ],
)
def test_nothing_to_splice_is_left_to_the_renderer(content: Any) -> None:
    assert render_spliced(content, starlette_render) is None


def test_a_placeholder_met_elsewhere_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The placeholder is a random UUID; if the text held it anyway, nothing is spliced."""
    fixed = uuid.UUID(int=7)
    monkeypatch.setattr(json_splice.uuid, "uuid4", lambda: fixed)
    echo = f'x"vllm-artifact-{fixed.hex}-0'  # renders as ...\"vllm-artifact-...-0" in JSON
    content = {"id": echo, "choices": [{"routed_experts": "QUJD"}]}
    assert render_spliced(content, starlette_render) is None
    content = {"choices": [{"routed_experts": "QUJD"}], "echo": echo}
    assert render_spliced(content, starlette_render) is None
