"""Recognize a completion that failed because its R3 could not be delivered.

Offline (``LLM.generate``) such a completion has ``finish_reason == "error"`` and a
``stop_reason`` of the form ``vllm-artifact[<reason>] <message>``; :func:`r3_failure` parses it.
``reason`` is the short error reason (``missing``, ``corrupt``, ...), ``message`` says what
happened and what to do.
"""

from __future__ import annotations

from typing import NamedTuple

_PREFIX = "vllm-artifact["


class R3Failure(NamedTuple):
    reason: str
    message: str

    def as_stop_reason(self) -> str:
        return f"{_PREFIX}{self.reason}] {self.message}"


def r3_failure(stop_reason: object) -> R3Failure | None:
    """The R3 failure carried in a completion's ``stop_reason``; None for anything else."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(_PREFIX):
        return None
    reason, _, message = stop_reason[len(_PREFIX) :].partition("] ")
    return R3Failure(reason, message)
