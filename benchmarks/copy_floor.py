"""The machine's floor printed beside absolute figures: a plain numpy copy of a given size.

Machines here drift by up to 3x in speed; a figure in ms means something only next to what a
memory copy of comparable size took in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np


def median_seconds(run: Callable[[], object], repetitions: int = 20) -> float:
    """Median seconds of one call of ``run``."""
    times = []
    for _ in range(repetitions):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_floor_seconds(shape: tuple[int, ...], repetitions: int = 20) -> float:
    """Median seconds of copying a uint8 array of ``shape`` into a new array (the allocation's
    page faults included, as for the arrays R3 is returned in)."""
    source = np.ones(shape, np.uint8)
    return median_seconds(source.copy, repetitions)
