"""Pages of R3 rows, each row with its token index, for rows held until a request's end.

One array of pages, so a step's rows of every held request go in with one numpy call. A row
is one item of a ``void`` dtype: numpy copies those with the GIL held, and three times faster
than rows of their own dtype, whose copies release the GIL and let the engine core's other
Python threads (the store's publisher) take it in the middle of the scheduler's step.

The pool doubles when full (copying what it holds, a few times in a process's life) and is
compacted into a smaller one once it has stayed at a quarter or less in use while half its size
in pages was released: a batch of requests that ends (an RL rollout's) and the next one of the
same size keep the pool as it is, instead of shrinking and growing it again by copies; a
server whose load fell gives the memory back. Its memory is a ``bytearray``'s,
zeroed in small pages when the pool is made: for arrays of 4 MiB and more numpy asks the kernel
for huge pages, and the scattered first writes into a fresh pool then fault in and zero 2 MiB
each (0.2 s for 256 rows into a fresh 30 MB array on a 2-vCPU VM, on the scheduler thread).
"""

from __future__ import annotations

import numpy as np

from vllm_artifact.errors import InternalError

__all__ = ["MIN_PAGES", "RowPages"]

#: Pages the pool starts with and is never compacted below.
MIN_PAGES = 64


class RowPages:
    """Pages of ``page_rows`` rows; the row shape and dtype are those of the first rows."""

    def __init__(self, page_rows: int) -> None:
        self.page_rows = page_rows
        self._row_shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None
        self._item: np.dtype = np.dtype(np.uint8)  # a row as one void item, after the first rows
        self._rows = np.zeros(0, np.uint8)  # one void item per row, page after page
        self._tokens = np.zeros(0, np.int64)  # each row's token
        self._free: list[int] = []  # a stack; the lowest page on top after a resize
        self._released_while_low = 0  # pages released since more than a quarter was in use

    @property
    def capacity(self) -> int:
        return len(self._tokens) // self.page_rows

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def should_compact(self) -> bool:
        """A quarter or less of a pool bigger than :data:`MIN_PAGES` is in use, and half its
        size in pages was released since more was (module docstring)."""
        capacity = self.capacity
        return (
            capacity > MIN_PAGES
            and 4 * self.in_use <= capacity
            and 2 * self._released_while_low >= capacity
        )

    def items(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` as one item each (a view when they are contiguous); they must have the
        first rows' shape and dtype."""
        if self._row_shape is None:
            self._row_shape, self._dtype = rows.shape[1:], rows.dtype
            self._item = np.dtype((np.void, rows.dtype.itemsize * int(np.prod(rows.shape[1:]))))
        elif rows.shape[1:] != self._row_shape or rows.dtype != self._dtype:
            raise InternalError(
                f"held rows changed shape: {rows.shape[1:]} {rows.dtype}, held so far "
                f"{self._row_shape} {self._dtype}"
            )
        return np.ascontiguousarray(rows).reshape(len(rows), -1).view(self._item).reshape(-1)

    def take(self, count: int) -> list[int]:
        """``count`` free pages (the pool doubles if it has fewer)."""
        if len(self._free) < count:
            self._resize(max(MIN_PAGES, 2 * self.capacity, self.capacity + count), None)
        free = self._free
        taken = free[-count:]
        del free[-count:]
        if 4 * self.in_use > self.capacity:
            self._released_while_low = 0
        return taken

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)
        if 4 * self.in_use <= self.capacity:
            self._released_while_low += len(pages)

    def compact(self, live: list[int]) -> list[int]:
        """Move the ``live`` pages (every page in use) to the front of a pool of twice their
        number; returns their new numbers, in the same order."""
        if len(live) != self.in_use:
            raise InternalError(f"compacting {len(live)} held pages, {self.in_use} are in use")
        self._resize(max(MIN_PAGES, 2 * len(live)), live)
        return list(range(len(live)))

    def write(
        self, pages: np.ndarray, offsets: np.ndarray, items: np.ndarray, tokens: np.ndarray
    ) -> None:
        """Row ``i`` (:meth:`items`; of token ``tokens[i]``) at ``offsets[i]`` of page
        ``pages[i]``."""
        positions = pages * self.page_rows + offsets
        self._rows[positions] = items
        self._tokens[positions] = tokens

    def write_run(self, page: int, offset: int, items: np.ndarray, first_token: int) -> None:
        """Consecutive rows, of tokens from ``first_token`` on, into one page from ``offset``."""
        start = page * self.page_rows + offset
        end = start + len(items)
        self._rows[start:end] = items
        self._tokens[start:end] = np.arange(first_token, first_token + len(items))

    def gather(self, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The rows and tokens of ``pages``, in that order, in new arrays."""
        if self._row_shape is None or self._dtype is None:
            raise InternalError("held rows were gathered before any was written")
        size = self.page_rows
        rows = self._rows.reshape(-1, size)[pages]
        tokens = self._tokens.reshape(-1, size)[pages].reshape(-1)
        return rows.view(self._dtype).reshape(-1, *self._row_shape), tokens

    def _resize(self, capacity: int, live: list[int] | None) -> None:
        """A pool of ``capacity`` pages holding every page (``live`` None: growing, page
        numbers kept) or the ``live`` pages at its front."""
        if self._row_shape is None or self._dtype is None:
            raise InternalError("held rows need a page before any row was checked")
        size = self.page_rows
        rows = _small_page_zeros((capacity * size,), self._item)
        tokens = _small_page_zeros((capacity * size,), np.dtype(np.int64))
        if live is None:
            kept = self.capacity
            if kept:
                rows[: kept * size] = self._rows
                tokens[: kept * size] = self._tokens
        else:
            kept = len(live)
            rows[: kept * size] = self._rows.reshape(-1, size)[live].reshape(-1)
            tokens[: kept * size] = self._tokens.reshape(-1, size)[live].reshape(-1)
            self._free = []
        self._rows, self._tokens = rows, tokens
        self._released_while_low = 0
        self._free.extend(range(capacity - 1, kept - 1, -1))


def _small_page_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array in memory the kernel maps in small pages (module docstring)."""
    count = int(np.prod(shape))
    return np.frombuffer(bytearray(count * dtype.itemsize), dtype).reshape(shape)
