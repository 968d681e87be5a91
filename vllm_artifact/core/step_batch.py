"""One finished engine step as rank zero's tracker takes it: column-wise, as MRV2 has it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["StepBatch", "StepRows"]


class StepRows(NamedTuple):
    """One request's share of an engine step."""

    request_id: str
    token_start: int  # the scheduler's first token of this step (may be optimistic)
    num_scheduled: int  # tokens scheduled this step (drafts included)
    rows: np.ndarray  # captured rows with rejected draft tokens already cut off
    sampled: bool  # the step sampled a token for this request (the scheduler takes rows)


class StepBatch(NamedTuple):
    """One finished engine step, column-wise: entry ``i`` is request ``request_ids[i]``, which
    ran from token ``token_starts[i]`` (possibly optimistic) with ``num_scheduled[i]`` tokens
    (drafts included); its kept rows (rejected drafts cut) are
    ``rows[row_starts[i]:row_ends[i]]``; ``sampled[i]`` says the scheduler takes rows."""

    request_ids: Sequence[str]
    token_starts: np.ndarray
    num_scheduled: np.ndarray
    row_starts: np.ndarray
    row_ends: np.ndarray
    sampled: np.ndarray
    rows: np.ndarray

    def entry(self, i: int) -> StepRows:
        """Entry ``i`` as one request's :class:`StepRows`."""
        return StepRows(
            self.request_ids[i],
            int(self.token_starts[i]),
            int(self.num_scheduled[i]),
            self.rows[int(self.row_starts[i]) : int(self.row_ends[i])],
            bool(self.sampled[i]),
        )
