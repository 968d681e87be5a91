"""The R3 rows of running requests, held in the engine until each request's last step.

Sending a request's generated tokens' rows once, at its end, costs one transport frame instead
of one per step (``integration/scheduler_connector.py`` says which requests qualify). Holding
runs on the scheduler thread for every held request on every step, so it must cost next to
nothing per request. All held rows live in pages of :data:`PAGE_ROWS` rows of one shared pool
(``core/row_pages.py``). A decode step's rows of every held request, which the worker sends as
one array (:class:`~vllm_artifact.contract.StepResult`'s decode columns), are written with a
few numpy calls (:meth:`HeldRows.record_step`), with Python work only for the requests that
start a new page (one in :data:`PAGE_ROWS`); other steps' rows (several rows of one request)
are written per request (:meth:`HeldRows.add`). At a request's end its pages are gathered into
the array it is sent in (:meth:`HeldRows.take`): one copy of its rows, the only work
proportional to its length. Rows are copies, so no step array outlives its step.

Every row keeps its token index, and :meth:`HeldRows.take` checks that the rows cover the
request's tokens exactly: rows are written as steps arrive, before vLLM has looked at the
request (a step that ran ahead of the scheduler, a row recomputed after preemption), so a later
row of a token replaces an earlier one and rows past the request's end are dropped; a token
without a row is an error, never a shorter answer.

Measured with ``benchmarks/bench_connector_step.py`` (256-request decode steps, the scheduler
thread's CPU, medians): holding costs about 0.1 ms a step here against about 0.17 ms with one
list of step-array views per request, joined every 16 steps (a Python call per request and step,
and 16 joins a step); copying each step's rows into a growing array of the request's own cost
about twice as much as that.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

from vllm_artifact.core.row_pages import RowPages
from vllm_artifact.errors import InternalError

__all__ = ["PAGE_ROWS", "HeldRows"]

#: Rows per page: a held request starts a new page (Python work) once in this many steps.
PAGE_ROWS = 16


class HeldRows:
    """Rows of every held request (:meth:`hold`), in token order, until :meth:`take`."""

    def __init__(self, page_rows: int = PAGE_ROWS) -> None:
        self.pages = RowPages(page_rows)
        self.slots: dict[str, int] = {}  # held request id -> its slot (read-only for callers)
        self._free_slots: list[int] = []
        # Per slot: first token held, rows held, its last page, and all its pages in order.
        self._first = np.zeros(0, np.int64)
        self._count = np.zeros(0, np.int64)
        self._page = np.zeros(0, np.int64)
        self._pages: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.slots

    def hold(self, request_id: str, first_token: int) -> None:
        """Start holding ``request_id``'s rows from ``first_token`` on (its earlier rows went
        out already); a request held already keeps what it has."""
        if request_id in self.slots:
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._pages)
            self._pages.append([])
            if slot >= len(self._count):
                size = max(64, 2 * len(self._count))
                self._first, self._count, self._page = (
                    np.resize(array, size) for array in (self._first, self._count, self._page)
                )
        self._first[slot] = first_token
        self._count[slot] = 0
        self.slots[request_id] = slot

    def record_step(
        self, request_ids: Sequence[str], token_starts: Sequence[int], rows: np.ndarray
    ) -> np.ndarray | None:
        """Hold the held requests' rows of one step whose entry ``i`` is one row,
        ``rows[i]``, of ``request_ids[i]`` at token ``token_starts[i]``. Returns which
        entries were held (a boolean mask), or None if none was."""
        count = len(request_ids)
        if not self.slots or not count:
            return None
        slots = np.fromiter(map(self.slots.get, request_ids, repeat(-1)), np.int64, count)
        held = slots >= 0
        num_held = int(np.count_nonzero(held))
        if not num_held:
            return None
        tokens = np.asarray(token_starts, dtype=np.int64)
        if num_held < count:
            slots, rows, tokens = slots[held], rows[held], tokens[held]
        items = self.pages.items(rows)
        counts = self._count[slots]
        offsets = counts % self.pages.page_rows
        starting = np.flatnonzero(offsets == 0)
        if len(starting):
            new_pages = self.pages.take(len(starting))
            starting_slots = slots[starting]
            self._page[starting_slots] = new_pages
            for slot, page in zip(starting_slots.tolist(), new_pages, strict=True):
                self._pages[slot].append(page)
        self.pages.write(self._page[slots], offsets, items, tokens)
        self._count[slots] = counts + 1
        return held

    def add(self, request_id: str, token_start: int, rows: np.ndarray) -> None:
        """Hold ``rows`` of ``request_id`` (held) for tokens from ``token_start`` on."""
        slot = self.slots[request_id]
        total = len(rows)
        if not total:
            return
        items = self.pages.items(rows)
        page_rows = self.pages.page_rows
        count = int(self._count[slot])
        done = 0
        while done < total:
            offset = count % page_rows
            if offset == 0:
                (page,) = self.pages.take(1)
                self._page[slot] = page
                self._pages[slot].append(page)
            size = min(page_rows - offset, total - done)
            self.pages.write_run(
                int(self._page[slot]), offset, items[done : done + size], token_start + done
            )
            done += size
            count += size
        self._count[slot] = count

    def take(self, request_id: str, end_token: int) -> np.ndarray | None:
        """The rows of tokens ``[first_token, end_token)`` of ``request_id`` in one new array
        (None if that range is empty); it is no longer held after. A token without a row
        raises :class:`InternalError`."""
        slot = self.slots.pop(request_id)
        first = int(self._first[slot])
        count = int(self._count[slot])
        rows: np.ndarray | None = None
        tokens = np.zeros(0, np.int64)
        if count:
            rows, tokens = self.pages.gather(self._pages[slot])
            rows, tokens = rows[:count], tokens[:count]
        self._release(slot)
        if end_token <= first:
            return None
        wanted = np.arange(first, end_token)
        if rows is not None and np.array_equal(tokens, wanted):
            return rows  # the usual case: every row once, in order
        return _last_row_of_each_token(request_id, tokens, rows, wanted)

    def discard(self, request_id: str) -> None:
        """Forget ``request_id``'s rows (aborted, failed); nothing if it is not held."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self.pages.release(self._pages[slot])
        self._pages[slot] = []
        self._count[slot] = 0
        self._free_slots.append(slot)
        if self.pages.should_compact:
            holding = [slot for slot in self.slots.values() if self._pages[slot]]
            moved = iter(self.pages.compact([p for slot in holding for p in self._pages[slot]]))
            for slot in holding:
                pages = self._pages[slot] = [next(moved) for _ in self._pages[slot]]
                self._page[slot] = pages[-1]


def _last_row_of_each_token(
    request_id: str, tokens: np.ndarray, rows: np.ndarray | None, wanted: np.ndarray
) -> np.ndarray:
    """The rows of ``wanted`` tokens, each token's last row (a row written later replaces an
    earlier one of the same token), in token order; every wanted token must have one."""
    if rows is not None:
        found, last_from_end = np.unique(tokens[::-1], return_index=True)
        keep = (found >= wanted[0]) & (found <= wanted[-1])
        if np.array_equal(found[keep], wanted):
            return rows[len(tokens) - 1 - last_from_end[keep]]
    covered = np.intersect1d(tokens, wanted)
    raise InternalError(
        f"request {request_id}: held R3 rows cover {len(covered)} of its tokens "
        f"{int(wanted[0])}..{int(wanted[-1])}"
    )
