"""Logical request buffer: rows not yet published, tracked by token position.

R3 is tracked per request and *logical* token index, never by physical KV slot. The buffer
holds, per request, the rows of its current partial block; rows that complete a block are
handed out at once (the caller publishes them). It follows vLLM's scheduling facts:

* a request may start at a non-zero token (prefix-cache hit: earlier rows are already in the
  store), even mid-block (a partial external hit: that block can never be complete);
* after preemption or a rejected speculative step the engine recomputes from an earlier token:
  overlapping rows *replace* what was buffered;
* rows below the last handed-out block boundary are already immutable objects, so recomputed
  copies of them are ignored (the published object wins);
* a gap (rows starting beyond the buffered end) is a bug upstream and raises.

Storage is one slot of one block per request in a shared array (``max_bytes`` bounds the
slots), so a decode step of every running request is one vectorized write
(:meth:`RequestRowBuffer.append_one_each`) instead of a Python loop over requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from itertools import repeat
from typing import NamedTuple

import numpy as np

from vllm_artifact.core.recycled_arrays import RecycledArrays, empty
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import BufferCapacityError, RowGapError, UnknownRequestError

__all__ = [
    "GIL_KEEPING_ITEMS",
    "CompletedBlocks",
    "FullBlocks",
    "RequestRowBuffer",
    "TailRows",
    "copy_blocks",
    "copy_rows",
    "copy_rows_into",
    "gather_rows",
    "join_rows",
]

_NO_ROWS = -1  # ``end`` of a slot whose request has not appended yet
_NO_SLOT = -1
_INITIAL_SLOTS = 16


class FullBlocks(NamedTuple):
    """Rows of newly completed full blocks: ``rows[i*bs:(i+1)*bs]`` is block
    ``first_block + i``. ``rows`` is the caller's to keep: a view of the rows it appended when
    none of them joins rows buffered before, else a fresh array."""

    first_block: int
    num_blocks: int
    rows: np.ndarray

    def block(self, i: int, block_size: int) -> np.ndarray:
        """View of the ``i``-th returned block."""
        return self.rows[i * block_size : (i + 1) * block_size]


class CompletedBlocks(NamedTuple):
    """Blocks completed by :meth:`RequestRowBuffer.append_one_each`: entry ``i`` of the batch
    (``positions[i]``) completed block ``block_indices[i]`` with rows ``rows[i]`` (a fresh
    array the caller owns)."""

    positions: np.ndarray
    block_indices: np.ndarray
    rows: np.ndarray


class TailRows(NamedTuple):
    """Rows of the terminal partial block, starting at ``token_start``."""

    token_start: int
    rows: np.ndarray


class RequestRowBuffer:
    """Unpublished R3 rows of every running request (single owner, not thread-safe).

    Per slot: ``block_start`` (first token of the partial block), ``end`` (token after the last
    buffered row) and ``floor`` (rows below it were handed out or came from the cache); the rows
    of tokens ``[max(floor, block_start), end)`` live at ``rows[slot, token - block_start]``.
    """

    def __init__(
        self, layout: R3Layout, *, max_bytes: int, arrays: RecycledArrays | None = None
    ) -> None:
        if max_bytes < layout.block_nbytes:
            raise ValueError("RequestRowBuffer.max_bytes must hold at least one block")
        self._layout = layout
        self._arrays = arrays  # where completed blocks' arrays come from
        self._bs = layout.block_size
        self._max_slots = max_bytes // layout.block_nbytes
        self._max_bytes = max_bytes
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        n = min(_INITIAL_SLOTS, self._max_slots)
        self._rows = layout.empty(n * self._bs).reshape(n, self._bs, *layout.row_shape)
        self._row_items = _as_items(self._rows)
        self._block_items = _as_items(self._rows, per_row=False)
        self._block_start = np.zeros(n, dtype=np.int64)
        self._end = np.full(n, _NO_ROWS, dtype=np.int64)
        self._floor = np.zeros(n, dtype=np.int64)

    # ------------------------------------------------------------------ queries

    @property
    def nbytes(self) -> int:
        """Bytes of the slots in use (bounded by max_bytes)."""
        return len(self._slots) * self._layout.block_nbytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, request_id: str) -> int:
        """The request's slot, opened on first use (batch calls address requests by slot)."""
        slot = self._slots.get(request_id)
        if slot is None:
            slot = self._slots[request_id] = self._open_slot()
        return slot

    def slots_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """Each request's slot, -1 where it has none (one C-level pass over the ids)."""
        found = map(self._slots.get, request_ids, repeat(_NO_SLOT))
        return np.fromiter(found, np.int64, len(request_ids))

    def end(self, request_id: str) -> int:
        """Token index one past the last buffered row (-1 before the first append)."""
        return int(self._end[self._get(request_id)])

    # ---------------------------------------------------------------- mutation

    def append(self, request_id: str, token_start: int, rows: np.ndarray) -> FullBlocks:
        """Add rows for tokens ``[token_start, token_start + len(rows))`` and return the full
        blocks they complete (the caller publishes them; they are no longer buffered).

        The first call for a request may start anywhere (prefix-cache hit). Later calls may
        start at or before the buffered end; rows from ``token_start`` on replace what was
        buffered there (recomputation). Rows below the last handed-out block are dropped.
        ``rows`` must not be written after the call: the blocks returned may be views of it
        (a step's rows are fresh every step; a prefill chunk's blocks are most of them).
        """
        rows = self._layout.check_rows(rows)
        if token_start < 0:
            raise ValueError(f"token_start must be >= 0, got {token_start}")
        bs = self._bs
        slot = self.slot(request_id)
        end = int(self._end[slot])
        if end == _NO_ROWS:
            end = token_start
            self._floor[slot] = token_start
            self._block_start[slot] = token_start - token_start % bs
        elif token_start > end:
            raise RowGapError(
                f"request {request_id!r}: rows start at token {token_start} but only "
                f"tokens < {end} are buffered; a step's R3 rows were lost. The request "
                "cannot return complete R3 and fails; report this as a bug."
            )
        floor = int(self._floor[slot])
        block_start = int(self._block_start[slot])
        skip = max(0, floor - token_start)
        if skip >= len(rows):
            self._end[slot] = end
            return FullBlocks(-(-floor // bs), 0, self._layout.empty(0))
        rows = rows[skip:]
        start = token_start + skip
        new_end = start + len(rows)
        new_block_start = new_end - new_end % bs
        self._end[slot] = new_end
        if new_block_start == block_start:  # still inside the partial block
            self._rows[slot, start - block_start : new_end - block_start] = rows
            return FullBlocks(-(-floor // bs), 0, self._layout.empty(0))
        # Blocks [first, last) are complete; a block the request began inside never is.
        first, last = -(-floor // bs), new_block_start // bs
        lo = first * bs
        held = max(start - lo, 0)  # rows of block ``first`` buffered by earlier calls
        if last <= first:
            out = self._layout.empty(0)
        elif not held:  # nothing to join: the caller's rows as they are (C-contiguous)
            out = rows[lo - start : last * bs - start]
        else:
            out = self._layout.empty((last - first) * bs, self._arrays)
            # Copies that keep the GIL (copy_rows_into).
            copy_rows_into(out[:held], self._rows[slot, lo - block_start : start - block_start])
            copy_rows_into(out[held:], rows[lo + held - start : last * bs - start])
        remainder = rows[new_block_start - start :]
        self._rows[slot, : len(remainder)] = remainder
        self._block_start[slot] = new_block_start
        self._floor[slot] = max(floor, new_block_start)
        return FullBlocks(first, max(last - first, 0), out)

    def append_one_each(
        self, slots: np.ndarray, token_starts: np.ndarray, rows: np.ndarray
    ) -> CompletedBlocks:
        """One row per slot (a decode step), vectorized: ``rows[i]`` is token
        ``token_starts[i]`` of slot ``slots[i]``. The caller guarantees each slot's buffered end
        is exactly ``token_starts[i]`` (no gap, no recomputation) and slots are distinct.
        Returns the blocks this completed."""
        bs = self._bs
        offsets = token_starts - self._block_start[slots]
        self._row_items[slots * bs + offsets] = _as_items(rows)
        self._end[slots] = token_starts + 1
        positions = np.flatnonzero(offsets == bs - 1)
        if not len(positions):
            return CompletedBlocks(positions, positions, self._rows[:0])
        done = slots[positions]
        block_starts = self._block_start[done]
        whole = self._floor[done] <= block_starts  # a block begun mid-way is never complete
        self._block_start[done] = block_starts + bs
        self._floor[done] = np.maximum(self._floor[done], block_starts + bs)
        positions, done, block_starts = positions[whole], done[whole], block_starts[whole]
        blocks = _from_items(self._block_items[done], self._rows)
        return CompletedBlocks(positions, block_starts // bs, blocks)

    def take_tail(self, request_id: str) -> TailRows:
        """Remove the request and return its rows after the last full block.

        If the request began mid-block (a partial external hit) and never crossed a boundary,
        its tail block lacks rows and this raises.
        """
        slot = self._get(request_id)
        end = int(self._end[slot])
        if end == _NO_ROWS:
            self.drop(request_id)
            return TailRows(0, self._layout.empty(0))
        block_start, floor = int(self._block_start[slot]), int(self._floor[slot])
        start = block_start
        if start < floor:  # only possible when the request began mid-block
            if end > floor:
                self.drop(request_id)
                raise RowGapError(
                    f"request {request_id!r}: its last block starts at token {start} but "
                    f"rows before token {floor} were never buffered (partial cache hit)."
                )
            start = floor
        # As row items: a copy of rows element by element releases the GIL (_as_items).
        at = slot * self._bs - block_start
        rows = _from_items(self._row_items[at + start : at + end].copy(), self._rows[slot])
        self.drop(request_id)
        return TailRows(start, rows)

    def drop(self, request_id: str) -> None:
        """Forget a request's unpublished rows (abort); unknown ids are ignored."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._end[slot] = _NO_ROWS
            self._free.append(slot)

    # ----------------------------------------------------------------- helpers

    def _get(self, request_id: str) -> int:
        try:
            return self._slots[request_id]
        except KeyError:
            raise UnknownRequestError(
                f"request {request_id!r} has no buffered R3 rows (never appended or dropped)"
            ) from None

    def _open_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot = len(self._slots)
        if slot >= len(self._end):
            self._grow()
        return slot

    def _grow(self) -> None:
        n = len(self._end)
        if n >= self._max_slots:
            raise BufferCapacityError(
                f"R3 request buffer is full ({self.nbytes} of {self._max_bytes} bytes, one "
                f"block per request) and cannot hold another request; raise the buffer limit "
                "or lower max_num_seqs."
            )
        new = min(2 * n, self._max_slots)
        rows = self._layout.empty(new * self._bs).reshape(new, self._bs, *self._layout.row_shape)
        rows[:n] = self._rows
        self._rows = rows
        self._row_items = _as_items(rows)
        self._block_items = _as_items(rows, per_row=False)
        self._block_start = np.concatenate([self._block_start, np.zeros(new - n, np.int64)])
        self._end = np.concatenate([self._end, np.full(new - n, _NO_ROWS, np.int64)])
        self._floor = np.concatenate([self._floor, np.zeros(new - n, np.int64)])


def gather_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``rows[index]`` (a fresh array) for a step's ``[tokens, layers, top_k]`` rows, moved
    as whole-row items; see :func:`_as_items`."""
    # An index of another integer type than intp is converted inside the indexing, which
    # releases the GIL (see _as_items); converting it first does not.
    return _from_items(_as_items(rows)[index.astype(np.intp, copy=False)], rows)


def copy_blocks(out: np.ndarray, rows: np.ndarray, block_size: int) -> None:
    """``out[:] = rows`` for rows of whole blocks, moved as one item per block: a plain copy of
    more than about 60 KB releases the GIL (see :func:`_as_items`), a copy of up to a few
    hundred block items keeps it."""
    if out.shape != rows.shape or len(out) % block_size:
        raise ValueError(f"copy_blocks: {rows.shape} into {out.shape}, blocks of {block_size}")
    if not (out.flags.c_contiguous and rows.flags.c_contiguous):
        out[:] = rows
        return
    shape = (-1, block_size, *out.shape[1:])
    items = _as_items(rows.reshape(shape), per_row=False)
    _as_items(out.reshape(shape), per_row=False)[:] = items


def _as_items(rows: np.ndarray, *, per_row: bool = True) -> np.ndarray:
    """``rows`` (``[..., layers, top_k]``) as a flat array of one opaque item per token row, or
    per entry of its first axis with ``per_row=False`` (a view when ``rows`` is C-contiguous).

    numpy then moves a whole row (or block) per index, a memcpy, not element by element, which
    makes the vectorized decode writes several times faster. And fancy indexing of a few
    hundred items keeps the GIL, where ``take``, ``copy`` and fancy indexing of as many bytes
    element by element release it: on the step thread a release hands the GIL to the store's
    publisher thread, and getting it back can take up to the interpreter's switch interval
    (5 ms), a wait added to the engine step (benchmarks/bench_connector_step.py, wall time).
    """
    item_shape = rows.shape[-2:] if per_row else rows.shape[1:]
    item_nbytes = math.prod(item_shape) * rows.itemsize
    if not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows)
    return rows.reshape(-1).view(_item_dtype(item_nbytes))


#: numpy keeps the GIL in a copy or fancy indexing of at most this many items and releases it
#: above (measured, numpy 2.3: 500 keep it, 501 release it); ``np.take`` always releases it.
GIL_KEEPING_ITEMS = 500


def copy_rows(rows: np.ndarray, arrays: RecycledArrays | None = None) -> np.ndarray:
    """A fresh copy of ``[tokens, layers, top_k]`` rows that keeps the GIL (see
    :func:`copy_rows_into`): ``np.array(rows)`` of a 256-request decode step's 119 KB
    releases it. With ``arrays``, in its reused memory."""
    out = empty(rows.shape, rows.dtype, arrays)
    copy_rows_into(out, rows)
    return out


def join_rows(parts: Sequence[np.ndarray], arrays: RecycledArrays | None = None) -> np.ndarray:
    """``np.concatenate(parts)`` of ``[tokens, layers, top_k]`` rows, keeping the GIL (with
    ``arrays``, in its reused memory)."""
    if len(parts) == 1:
        return parts[0]
    shape = (sum(len(part) for part in parts), *parts[0].shape[1:])
    out = empty(shape, parts[0].dtype, arrays)
    at = 0
    for part in parts:
        copy_rows_into(out[at : at + len(part)], part)
        at += len(part)
    return out


def copy_rows_into(out: np.ndarray, rows: np.ndarray) -> None:
    """``out[:] = rows`` for ``[tokens, layers, top_k]`` rows, moved as at most 500 items of
    whole rows, so that the copy keeps the GIL at any size. A plain copy of more than 500
    elements releases it, and on the engine's step thread a release hands the GIL to the
    publisher thread, which may keep it for the interpreter's switch interval (5 ms): a wait
    many times the copy's cost (see :func:`_as_items`)."""
    if out.shape != rows.shape:
        raise ValueError(f"copy_rows_into: {rows.shape} into {out.shape}")
    n = len(rows)
    if not n:
        return
    if not out.flags.c_contiguous:
        out[:] = rows
        return
    rows = np.ascontiguousarray(rows)
    per = -(-n // GIL_KEEPING_ITEMS)  # rows per item
    whole = n - n % per
    if whole:
        shape = (whole // per, per, *rows.shape[1:])
        items = _as_items(rows[:whole].reshape(shape), per_row=False)
        _as_items(out[:whole].reshape(shape), per_row=False)[:] = items
    if whole < n:  # the rest as one item
        _as_items(out[whole:][None], per_row=False)[:] = _as_items(
            rows[whole:][None], per_row=False
        )


def _from_items(items: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Items made by :func:`_as_items` of ``like`` back as its dtype, ``len(items)`` entries of
    ``like``'s first axis."""
    return items.view(like.dtype).reshape(len(items), *like.shape[1:])


@lru_cache(maxsize=64)
def _item_dtype(item_nbytes: int) -> np.dtype[np.void]:
    return np.dtype((np.void, item_nbytes))
