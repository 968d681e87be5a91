"""The GIL switch interval of rank zero's worker process.

That process's step thread launches each forward and, on one GPU, also runs R3's per-step
work (``prepare_output``, ``process_output``); it shares one interpreter with vLLM's input
thread (decoding arriving requests), R3's store writer and, with several GPUs, the worker's
output-copy thread. The step thread lets the GIL go at every CUDA launch, copy and wait, and
getting it back can take up to the switch interval, CPython's 5 ms by default, whenever
another thread runs Python meanwhile. R3 adds such points to every step, so the waits add up
(most at a round's start, while requests arrive). A shorter interval bounds each wait;
``--artifact-switch-interval-ms keep`` leaves the interpreter's own.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

logger = logging.getLogger("vllm.artifact.worker")

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
        # CPython keeps whole microseconds: 1.1 ms reads back as 0.0010999999999999998 s
        if self._set is not None and abs(sys.getswitchinterval() - self._set) < 1e-6:
            sys.setswitchinterval(self._before)
        self._set = None
