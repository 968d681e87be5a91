"""Run several servers' batches at once, but only one server at a time, in short turns.

Why: this machine's speed drifts from minute to minute (±30%, and it can switch between two
speeds within minutes), and a decode batch of the tiny model takes ~45 s. Batches run one
after the other therefore meet different machine speeds, and the per-round ratios of
``bench_e2e`` scattered by ~11% (log standard deviation), far more than the 3% the targets
ask to resolve. Here every configuration's batch is in flight together, and the servers take
turns of ``turn_s`` seconds: the running one is continued (``SIGCONT`` to its process group),
every other one is stopped (``SIGSTOP``), so no two servers ever share the CPUs, and every
configuration sees the same minutes of the machine. A batch's duration and its requests'
latencies are then counted in the time its server ran (:meth:`TimeSlices.active`), not in
wall time.

A stopped server does nothing at all (its sockets queue what the client sends), so resuming
costs only warm caches; a turn of 1 s is ~3 decode steps of the tiny model. Processes are
stopped as a whole group (``os.killpg``): the API server, engine core and worker stop and
resume together, so none of vLLM's internal waits sees the others stall.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Mapping

__all__ = ["TimeSlices"]


class TimeSlices:
    """Turns of ``turn_s`` seconds among process groups, with each group's running intervals
    recorded (``time.perf_counter`` clock). Use as a context manager: on entry every group is
    stopped and the turns start; :meth:`finish` takes a group out of the rotation (it stays
    stopped until exit); on exit every group runs again."""

    def __init__(self, groups: Mapping[str, int], turn_s: float) -> None:
        if turn_s <= 0:
            raise ValueError("turn_s must be positive")
        self._groups = dict(groups)  # name -> process group id
        self._turn_s = turn_s
        self._running: dict[str, list[tuple[float, float]]] = {name: [] for name in groups}
        self._current: tuple[str, float] | None = None  # (name, since) of the running group
        self._finished: set[str] = set()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._rotate, name="time-slices", daemon=True)

    def __enter__(self) -> TimeSlices:
        try:
            for pgid in self._groups.values():
                os.killpg(pgid, signal.SIGSTOP)
        except BaseException:  # never leave a server stopped
            self._continue_all()
            raise
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._finished.update(self._groups)
            self._changed.notify_all()
        self._thread.join()
        self._continue_all()

    def _continue_all(self) -> None:
        for pgid in self._groups.values():
            # A server that is gone has its batch say why.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)

    def finish(self, name: str) -> None:
        """``name``'s batch is done: end its turn now and skip it from then on."""
        with self._changed:
            self._finished.add(name)
            self._changed.notify_all()

    def active(self, name: str, start: float, end: float) -> float:
        """Seconds within ``[start, end]`` during which ``name``'s server was running."""
        with self._changed:
            spans = list(self._running[name])
            if self._current is not None and self._current[0] == name:
                spans.append((self._current[1], time.perf_counter()))
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)

    def turns(self, name: str) -> int:
        return len(self._running[name])

    def _rotate(self) -> None:
        for name in itertools.cycle(list(self._groups)):
            with self._changed:
                if self._finished >= self._groups.keys():
                    return
                if name in self._finished:
                    continue
                pgid = self._groups[name]
                try:
                    os.killpg(pgid, signal.SIGCONT)
                except ProcessLookupError:
                    self._finished.add(name)
                    continue
                since = time.perf_counter()
                self._current = (name, since)
                deadline = since + self._turn_s
                while name not in self._finished:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                until = time.perf_counter()
                # Keep a finished group stopped too: nothing but the running batch gets CPU.
                try:
                    os.killpg(pgid, signal.SIGSTOP)
                except ProcessLookupError:
                    self._finished.add(name)
                self._running[name].append((since, until))
                self._current = None
