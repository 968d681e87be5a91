"""Logical request buffer: rows not yet published, tracked by token position.

R3 is tracked per request and *logical* token index, never by physical KV
slot. The buffer holds, per request, the rows since the last published block
boundary. It follows vLLM's scheduling facts:

* a request may start at a non-zero token (prefix-cache hit: earlier rows are
  already in the store);
* after preemption or a rejected speculative step the engine recomputes from
  an earlier token: overlapping rows *replace* what was buffered;
* rows below the last published block boundary are already immutable objects,
  so recomputed copies of them are ignored (the published object wins);
* a gap (rows starting beyond the buffered end) is a bug upstream and raises.

Memory is bounded by ``max_bytes`` over all requests; the integration takes
full blocks every step, so each request normally holds < one block of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import BufferCapacityError, RowGapError, UnknownRequestError

__all__ = ["FullBlocks", "RequestRowBuffer", "TailRows"]

_MIN_ROWS = 16


class FullBlocks(NamedTuple):
    """Rows of newly completed full blocks: ``rows[i*bs:(i+1)*bs]`` is block
    ``first_block + i``. ``rows`` is a fresh array the caller owns."""

    first_block: int
    num_blocks: int
    rows: np.ndarray

    def block(self, i: int, block_size: int) -> np.ndarray:
        """View of the ``i``-th returned block."""
        return self.rows[i * block_size : (i + 1) * block_size]


class TailRows(NamedTuple):
    """Rows of the terminal partial block, starting at ``token_start``."""

    token_start: int
    rows: np.ndarray


@dataclass
class _Request:
    base: int  # token index of data[0]
    count: int  # rows held
    floor: int  # rows below this token are published (or came from the cache)
    data: np.ndarray

    @property
    def end(self) -> int:
        return self.base + self.count


class RequestRowBuffer:
    """Uncommitted R3 rows of every running request (single owner, not thread-safe)."""

    def __init__(self, layout: R3Layout, *, max_bytes: int) -> None:
        if max_bytes < layout.block_nbytes:
            raise ValueError("RequestRowBuffer.max_bytes must hold at least one block")
        self._layout = layout
        self._max_bytes = max_bytes
        self._requests: dict[str, _Request] = {}
        self._allocated = 0

    # ------------------------------------------------------------------ queries

    @property
    def nbytes(self) -> int:
        """Bytes currently allocated for buffered rows (bounded by max_bytes)."""
        return self._allocated

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def end(self, request_id: str) -> int:
        """Token index one past the last buffered row."""
        return self._get(request_id).end

    # ---------------------------------------------------------------- mutation

    def append(self, request_id: str, token_start: int, rows: np.ndarray) -> None:
        """Add rows for tokens ``[token_start, token_start + len(rows))``.

        The first call for a request may start anywhere (prefix-cache hit).
        Later calls may start at or before the buffered end; rows from
        ``token_start`` on replace what was buffered there (recomputation).
        Rows below the last taken block boundary are dropped.
        """
        rows = self._layout.check_rows(rows)
        if token_start < 0:
            raise ValueError(f"token_start must be >= 0, got {token_start}")
        req = self._requests.get(request_id)
        if req is None:
            req = _Request(base=token_start, count=0, floor=token_start, data=self._alloc(0))
            self._requests[request_id] = req
        elif token_start > req.end:
            raise RowGapError(
                f"request {request_id!r}: rows start at token {token_start} but only "
                f"tokens < {req.end} are buffered; a step's R3 rows were lost. The request "
                "cannot return complete R3 and fails; report this as a bug."
            )
        skip = max(0, req.floor - token_start)
        if skip >= len(rows):
            return
        rows = rows[skip:]
        at = token_start + skip - req.base
        need = at + len(rows)
        if need > len(req.data):
            self._grow(req, need)
        req.data[at:need] = rows
        req.count = need

    def truncate(self, request_id: str, end: int) -> None:
        """Forget rows at or beyond token ``end`` (e.g. rejected draft tokens)."""
        req = self._get(request_id)
        if end < req.floor:
            raise ValueError(
                f"request {request_id!r}: cannot truncate to {end}, tokens < {req.floor} "
                "are already published"
            )
        req.count = min(req.count, end - req.base)

    def take_full_blocks(self, request_id: str) -> FullBlocks:
        """Remove and return the rows of every complete, unpublished block."""
        req = self._get(request_id)
        bs = self._layout.block_size
        first = -(-req.floor // bs)  # blocks before this were (partially) cache hits
        last = req.end // bs
        if last <= first:
            return FullBlocks(first, 0, self._layout.empty(0))
        lo = first * bs - req.base
        hi = last * bs - req.base
        out = req.data[lo:hi].copy()
        self._compact(req, hi, last * bs)
        return FullBlocks(first, last - first, out)

    def take_tail(self, request_id: str) -> TailRows:
        """Remove the request and return its rows after the last full block.

        Call after :meth:`take_full_blocks`. The tail starts at a block
        boundary; if the request began mid-block (a partial external hit) and
        never crossed a boundary, its tail block lacks rows and this raises.
        """
        req = self._get(request_id)
        bs = self._layout.block_size
        start = (req.end // bs) * bs
        if req.end // bs > -(-req.floor // bs):
            raise ValueError(
                f"request {request_id!r}: full blocks up to token {start} were not taken; "
                "call take_full_blocks before take_tail"
            )
        if start < req.floor:  # only possible when the request began mid-block
            if req.end > req.floor:
                self.drop(request_id)
                raise RowGapError(
                    f"request {request_id!r}: its last block starts at token {start} but "
                    f"rows before token {req.floor} were never buffered (partial cache hit)."
                )
            start = req.floor
        rows = req.data[start - req.base : req.count].copy()
        self.drop(request_id)
        return TailRows(start, rows)

    def drop(self, request_id: str) -> None:
        """Forget a request's unpublished rows (abort); unknown ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._allocated -= req.data.nbytes

    # ----------------------------------------------------------------- helpers

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(
                f"request {request_id!r} has no buffered R3 rows (never appended or dropped)"
            ) from None

    def _alloc(self, num_rows: int) -> np.ndarray:
        return self._layout.empty(num_rows)

    def _grow(self, req: _Request, need: int) -> None:
        row = self._layout.row_nbytes
        old = req.data.nbytes
        target = max(need, 2 * len(req.data), _MIN_ROWS)
        if self._allocated - old + target * row > self._max_bytes:
            target = need
        if self._allocated - old + target * row > self._max_bytes:
            raise BufferCapacityError(
                f"R3 request buffer is full ({self._allocated} of {self._max_bytes} bytes) "
                f"and cannot grow for request; raise the buffer limit or lower "
                "max_num_batched_tokens / max_num_seqs."
            )
        data = self._alloc(target)
        data[: req.count] = req.data[: req.count]
        req.data = data
        self._allocated += data.nbytes - old

    def _compact(self, req: _Request, cut: int, new_base: int) -> None:
        """Drop rows before index ``cut``; they are published now."""
        keep = req.count - cut
        data = req.data
        if len(data) > 4 * max(keep, _MIN_ROWS):
            new = self._alloc(max(2 * keep, _MIN_ROWS))
            self._allocated += new.nbytes - data.nbytes
            req.data = new
        req.data[:keep] = data[cut : cut + keep]
        req.base = new_base
        req.floor = new_base
        req.count = keep
