"""Where rank zero's tracker keeps each request: its cursors, keys, pending rows and fate."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_artifact.contract import TailBlock
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.keys import ObjectKey

__all__ = ["Cursors", "RequestState"]


@dataclass
class Cursors:
    """Where a request on the per-request path stands, in tokens."""

    emit: int  # first token whose row the scheduler has not received yet
    pending_start: int | None = None  # token of the first captured, unemitted row
    capture_end: int | None = None  # token after the last captured row
    scheduled_end: int = 0  # the scheduler's (possibly optimistic) end of the last step

    @classmethod
    def at(cls, token: int) -> Cursors:
        """Every cursor at ``token`` (a request leaving steady decode)."""
        return cls(emit=token, pending_start=token, capture_end=token, scheduled_end=token)


@dataclass
class RequestState:
    """One request's state on rank zero. ``cursors`` is None while the request is in steady
    decode: :class:`~vllm_artifact.core.steady_decode.SteadyDecode` then holds its one cursor
    (``RequestTracker._cursors`` brings it back), so there is never a second, stale copy."""

    cursors: Cursors | None
    slot: int = -1  # its row-buffer slot once it has captured rows
    keys: list[ObjectKey] = field(default_factory=list)  # block i -> keys[i]
    hashes: list[bytes] = field(default_factory=list)  # block i -> its KV block hash
    unkeyed: dict[int, np.ndarray] = field(default_factory=dict)  # complete blocks, no hash yet
    pending: list[np.ndarray] = field(default_factory=list)  # captured, unemitted rows
    pending_count: int = 0  # rows in ``pending``
    finished: bool = False
    tail: TailBlock | None = None  # the terminal partial block to publish at teardown
    lease: bool = False  # a keys handle names its objects: lease them at teardown
    failure: R3Failure | None = None
    failure_sent: bool = False
    #: Rows to leave room for after its first emitted rows, where those may go out as a file
    #: (``core/row_file.py``); None once they went (or where they may not).
    first_rows_room: int | None = None
