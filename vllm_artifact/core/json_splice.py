"""The JSON text of a response whose choices carry base64 R3, without re-scanning the base64.

Starlette renders a response with ``json.dumps``, which looks at every character of every
string to see whether it needs escaping: 22-39 ms here for the 19.3 MiB of base64 of a
32K-token DeepSeek-V3 request, several times what reading and encoding the array took. A
string that needs no escaping appears in JSON as itself between two quotes, so
:func:`render_spliced` has the caller's renderer render everything else (each such string
replaced by a short placeholder) and joins the strings' bytes in. The result is byte for byte
what the renderer makes of the whole object; a string that might need escaping (a quote, a
backslash, a control character, DEL, anything not ASCII) is left to the renderer.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

#: In ASCII, JSON escapes ``"``, ``\`` and the control characters below U+0020, and
#: ``json.dumps`` with ``ensure_ascii`` (its default; Starlette turns it off) also DEL.
_QUOTE, _BACKSLASH, _DEL, _FIRST_PLAIN = b'"', b"\\", b"\x7f", 0x20


def render_spliced(
    content: Any, render: Callable[[Any], bytes], field: str = "routed_experts"
) -> bytes | None:
    """``render(content)`` for a response object whose ``choices[i][field]`` strings need no
    escaping, made without ``render`` scanning them; None when no such string is present (the
    caller renders as usual). ``render`` must keep key order and write strings as JSON does."""
    choices = content.get("choices") if type(content) is dict else None
    if type(choices) is not list:
        return None
    plain: list[tuple[int, bytes]] = []  # (choice index, the string's bytes)
    for i, choice in enumerate(choices):
        if type(choice) is dict:
            data = _unescaped_json_string(choice.get(field))
            if data is not None:
                plain.append((i, data))
    if not plain:
        return None
    token = uuid.uuid4().hex  # no response text can hold it by chance
    placed = list(choices)
    for i, _ in plain:
        placed[i] = {**choices[i], field: f"vllm-artifact-{token}-{i}"}  # same key order
    text = render({**content, "choices": placed})  # small: the long strings are not in it
    parts: list[bytes] = []
    start = 0
    for i, data in plain:
        marker = f'"vllm-artifact-{token}-{i}"'.encode()
        at = text.find(marker, start)
        if at < 0 or text.count(marker) != 1:  # the placeholder exactly once, where expected
            return None
        parts += (text[start:at], _QUOTE, data, _QUOTE)
        start = at + len(marker)
    parts.append(text[start:])
    return b"".join(parts)


def _unescaped_json_string(value: Any) -> bytes | None:
    """The UTF-8 bytes of ``value`` if it is a non-empty ``str`` that JSON writes unescaped."""
    if type(value) is not str or not value or not value.isascii():  # isascii: O(1) in CPython
        return None
    data = value.encode("ascii")
    if _QUOTE in data or _BACKSLASH in data or _DEL in data:  # memchr-fast
        return None
    if int(np.frombuffer(data, dtype=np.uint8).min()) < _FIRST_PLAIN:
        return None
    return data
