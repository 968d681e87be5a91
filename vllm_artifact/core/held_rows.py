"""A running request's R3 rows, held in the engine until its last step.

Sending a request's generated tokens' rows once, at its end, costs one transport frame instead
of one per step (``integration/scheduler_connector.py`` says which requests qualify). Holding
them runs on the scheduler thread for every request on every step, so it costs a list append;
the rows stay views of the step arrays they came in (a step's rows of every request
together). So that a long request among many short ones does not keep every
step's array alive, the newest views are joined into one array of the request's own every
:data:`JOIN_EVERY` steps. At its end the parts are joined once more, into the array it is sent
in: one copy of its rows (memcpy speed), the only work there proportional to its length.
The scheduler connector sends a request's first rows (its prompt's, usually the bulk) at once
and holds only the rest, so that copy is of its generated tokens' rows.

Alternatives measured with ``benchmarks/bench_connector_step.py`` (one run each, against its
"ours, per step" configuration): copying each step's rows into a growing array of the
request's own cost the scheduler thread about twice as much (a numpy slice assignment per
request and step); joining every 64 steps instead of 16 kept four times as many step arrays
alive, and the worker's steps, sharing the CPU's cache, were slower by about as much as the
scheduler's.
"""

from __future__ import annotations

import numpy as np

__all__ = ["JOIN_EVERY", "HeldRows"]

#: Views joined into one array at a time: at most this many step arrays stay alive for a
#: running request, and it costs one ``np.concatenate`` this many steps.
JOIN_EVERY = 16


class HeldRows:
    """The rows of a request's steps so far, in order (:meth:`add`, :meth:`take`)."""

    __slots__ = ("_joined", "_recent", "first_out")

    def __init__(self) -> None:
        self._joined: list[np.ndarray] = []  # arrays of the request's own rows
        self._recent: list[np.ndarray] = []  # the newest steps' rows (views of step arrays)
        self.first_out = False  # the holder's user sent the request's first rows at once

    def add(self, rows: np.ndarray) -> None:
        """Append one step's rows (rows along axis 0; the same row shape and dtype each time)."""
        recent = self._recent
        recent.append(rows)
        if len(recent) >= JOIN_EVERY:
            self._joined.append(np.concatenate(recent))
            self._recent = []

    def take(self) -> np.ndarray | None:
        """Every row added, in one array (None if none was); the holder is empty after."""
        parts = self._joined + self._recent
        self._joined, self._recent = [], []
        if len(parts) <= 1:
            return parts[0] if parts else None
        return np.concatenate(parts)
