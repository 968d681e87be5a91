"""Requests in steady decode: a whole decode batch in a few numpy calls.

A request is in steady decode while each step brings exactly one new, sampled row right where
its last one ended, with nothing waiting to be emitted. Rank zero's tracker then keeps a single
number for it, per row-buffer slot: the token its next step must start at. A batch of such
steps is one buffer write, and its rows go to the scheduler column-wise in the
:class:`~vllm_artifact.contract.StepResult`, so a big decode batch costs far less than a GPU
step. Any other step takes the request out (:meth:`SteadyDecode.leave`) and back to the
tracker's per-request path.
"""

from __future__ import annotations

import numpy as np

from vllm_artifact.contract import StepResult
from vllm_artifact.core.buffer import CompletedBlocks, RequestRowBuffer, gather_rows
from vllm_artifact.core.step_batch import StepBatch

__all__ = ["SteadyDecode"]

_NONE = -1


class SteadyDecode:
    """Buffer slot -> the token a steady-decode step of its request starts at (-1: the slot's
    request is not in steady decode). While a slot holds a token, that token is the request's
    only cursor: the tracker keeps none of its own until :meth:`leave` hands it back."""

    def __init__(self, buffer: RequestRowBuffer) -> None:
        self._buffer = buffer
        self._next_token = np.full(64, _NONE, dtype=np.int64)

    def reserve(self, slot: int) -> None:
        """Make room for ``slot`` (the buffer hands out small slot numbers as it needs them)."""
        size = len(self._next_token)
        if slot >= size:
            grown = np.full(max(2 * size, slot + 1), _NONE, np.int64)
            grown[:size] = self._next_token
            self._next_token = grown

    def enter(self, slot: int, next_token: int) -> None:
        """The slot's request is in steady decode; its next step starts at ``next_token``."""
        self._next_token[slot] = next_token

    def leave(self, slot: int) -> int | None:
        """Take the slot's request out of steady decode: the token it held, or None."""
        token = int(self._next_token[slot])
        if token == _NONE:
            return None
        self._next_token[slot] = _NONE
        return token

    def select(self, step: StepBatch, slots: np.ndarray) -> np.ndarray:
        """Which entries of ``step`` are steady-decode steps (``slots[i]``: entry ``i``'s
        buffer slot, -1 for none)."""
        return (
            (slots >= 0)
            & (self._next_token[slots] == step.token_starts)
            & (step.row_ends - step.row_starts == 1)
            & (step.num_scheduled == 1)
            & step.sampled
        )

    def write(
        self, step: StepBatch, entries: np.ndarray, slots: np.ndarray, result: StepResult
    ) -> CompletedBlocks:
        """Buffer the one row of each of ``entries`` (selected by :meth:`select`; ``slots``
        as there), hand them to ``result`` column-wise, and advance their next tokens; returns
        the blocks these rows completed."""
        slots = slots[entries]
        # int64 like the buffer's arrays: writing MRV2's int32 positions into them would cast
        # in a loop that releases the GIL (see buffer._as_items).
        tokens = step.token_starts[entries].astype(np.int64)
        rows = gather_rows(step.rows, step.row_starts[entries])  # a copy: does not pin the step
        completed = self._buffer.append_one_each(slots, tokens, rows)
        self._next_token[slots] = tokens + 1
        ids = step.request_ids
        result.decode_ids = (
            list(ids) if len(entries) == len(ids) else [ids[i] for i in entries.tolist()]
        )
        result.decode_token_starts = tokens.tolist()
        result.decode_rows = rows
        return completed
