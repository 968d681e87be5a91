"""A running request's R3 rows, held in the engine until its last step.

Sending a request's rows once, at its end, costs one transport frame instead of one per step
(``integration/scheduler_connector.py`` says which requests qualify). Holding them runs on the
scheduler thread for every request on every step, so it costs a list append; the rows stay
views of the step arrays they came in (a step's rows of every request together). So that a
long request among many short ones does not keep every step's array alive, the newest views
are joined into one array of the request's own every :data:`JOIN_EVERY` steps: a request keeps
at most that many step arrays alive. At its end the parts are joined once more, into the array
it is sent in: one copy of its rows (memcpy speed), the only work there proportional to its
length.
"""

from __future__ import annotations

import numpy as np

__all__ = ["JOIN_EVERY", "HeldRows"]

#: Steps whose views are joined into one array at a time: the step arrays a running request
#: can keep alive, and one ``np.concatenate`` per request this many steps.
JOIN_EVERY = 64


class HeldRows:
    """The rows of a request's steps so far, in order (:meth:`add`, :meth:`take`)."""

    __slots__ = ("_joined", "_recent")

    def __init__(self) -> None:
        self._joined: list[np.ndarray] = []  # arrays of the request's own rows
        self._recent: list[np.ndarray] = []  # the newest steps' rows (views of step arrays)

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
