"""The GIL switch interval of rank zero's worker process.

There the step thread (scheduling, launching forwards), MRV2's output thread (R3's per-step
tracking) and the store writer share one interpreter. A thread that asks for the GIL while
another runs Python waits up to the switch interval, CPython's 5 ms by default, and the step
thread asks for it again after every call that released it (each CUDA launch and copy): with
R3's output thread busy, the launches of the next forward waited. A shorter interval bounds
each such wait; ``--artifact-switch-interval-ms keep`` leaves the interpreter's own.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

logger = logging.getLogger(__name__)

__all__ = ["SwitchInterval"]


class SwitchInterval:
    """Set the process's switch interval while R3's output side is open; :meth:`restore`
    puts back the one it found (unless someone changed it since)."""

    def __init__(self, milliseconds: float | Literal["keep"]) -> None:
        self._before = sys.getswitchinterval()
        self._set: float | None = None
        if milliseconds == "keep":
            return
        self._set = milliseconds / 1e3
        sys.setswitchinterval(self._set)
        logger.info(
            "vllm-artifact: GIL switch interval %g ms -> %g ms (--artifact-switch-interval-ms)",
            self._before * 1e3,
            milliseconds,
        )

    def restore(self) -> None:
        if self._set is not None and sys.getswitchinterval() == self._set:
            sys.setswitchinterval(self._before)
        self._set = None
