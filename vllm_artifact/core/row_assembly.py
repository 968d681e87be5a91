"""A request's R3 rows joined in the frontend as they arrive, not all at once at its end.

vLLM's frontend keeps each request's R3 chunks in a list and concatenates them when the request
finishes. Most of a request's rows are its prompt's, which arrive with its prefill steps; at its
end only its generated tokens' rows come (held in the engine, one chunk). Concatenating at the
end copies the prompt's rows then, into fresh memory that page-faults on first touch, on the
thread that turns every request's step output into results: where many requests finish
together (a prefill-heavy batch finishing in groups, a decode batch at once) that copy is the
round's tail, with the engine idle. :class:`ArrivingRows` is that list, and also copies each
chunk on arrival into one growing ``.npy`` file, while the frontend waits for the next step;
at the end :meth:`ArrivingRows.joined` gives the rows as the data part of that file (what
:func:`~vllm_artifact.core.npy.concatenate_into_npy` would have made) with no copy.

The file grows by ``ndarray.resize`` (``realloc``: large blocks are remapped, not copied) and
is shrunk to its rows at the end. ``resize`` refuses while any view of the file exists, so no
view outlives a call here. The list itself is untouched: vLLM reads and rewrites it as before
(its stop-string trim replaces the last chunk with a shorter one), and where the list holds
anything other than the chunks copied, in order, ``joined`` returns None and the caller
concatenates the list as before.
"""

from __future__ import annotations

import operator
from typing import Any, SupportsIndex

import numpy as np

from vllm_artifact.core.npy import empty_npy_file, npy_header

__all__ = ["RESERVE_ROWS_MAX", "ArrivingRows"]

#: Rows reserved past the first chunk for the rows still to come (the request's token budget
#: where it has one, at most this many; more grow the file).
RESERVE_ROWS_MAX = 4096


class ArrivingRows(list):
    """vLLM's list of a request's R3 chunks, each chunk also copied into one ``.npy`` file."""

    __slots__ = ("_dtype", "_file", "_header_nbytes", "_reserve", "_row_shape", "_rows", "_sources")

    def __init__(self, reserve_rows: int = 0) -> None:
        super().__init__()
        self._reserve = max(0, reserve_rows)  # rows the file is made for, at least
        self._file: np.ndarray | None = None  # uint8: header, then rows; owns its memory
        self._header_nbytes = 0
        self._rows = 0
        self._row_shape: tuple[int, ...] = ()
        self._dtype: np.dtype[Any] = np.dtype(np.uint8)
        self._sources: list[Any] | None = []  # the chunks copied, in order; None: given up

    def append(self, chunk: Any) -> None:
        super().append(chunk)
        self._copy(chunk)

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        sources = self._sources
        if sources is None:
            return
        last = isinstance(index, SupportsIndex) and operator.index(index) in (-1, len(self) - 1)
        if not last or len(sources) != len(self):
            self._sources = None
            return
        self._rows -= len(sources.pop())  # vLLM's trim: the last chunk, shorter
        self._copy(value)

    def joined(self) -> np.ndarray | None:
        """The rows of every chunk, in order, as the data part of a complete ``.npy`` file (no
        copy), or None where the list is not exactly the chunks copied (then concatenate
        it). The file is handed over: later chunks only go into the list (a resumable
        request's next end concatenates it)."""
        sources, rows = self._sources, self._rows
        self._sources, self._rows = None, 0
        if (
            self._file is None
            or sources is None
            or len(sources) != len(self)
            or not all(map(operator.is_, self, sources))
        ):
            self._file = None
            return None
        shape = (rows, *self._row_shape)
        header = npy_header(shape, self._dtype)
        # numpy's header leaves room for the first axis to grow, so it keeps its length
        if header is None or len(header) != self._header_nbytes:
            self._file = None
            return None
        file, self._file = self._file, None  # one reference, for resize's check
        file[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        file.resize(len(header) + rows * self._row_nbytes, refcheck=True)
        return file[len(header) :].view(self._dtype).reshape(shape)

    @property
    def _row_nbytes(self) -> int:
        return self._dtype.itemsize * int(np.prod(self._row_shape, dtype=np.int64))

    def _copy(self, chunk: Any) -> None:
        """Copy ``chunk`` in after the rows so far; give up (``_sources`` None) on a chunk
        that is not a plain array of the first one's dtype and row shape, or after
        :meth:`joined` handed the file over."""
        sources = self._sources
        if sources is None:
            return
        if type(chunk) is not np.ndarray or chunk.ndim < 1 or chunk.dtype.hasobject:
            self._sources = None
            return
        if self._file is None:
            self._start(chunk)
            if self._file is None:  # no .npy header for this dtype
                self._sources = None
                return
        elif chunk.dtype != self._dtype or chunk.shape[1:] != self._row_shape:
            self._sources = None
            return
        row_nbytes = self._row_nbytes
        start = self._header_nbytes + self._rows * row_nbytes
        end = start + len(chunk) * row_nbytes
        if end > self._file.nbytes:  # grow (resize: no other reference to the file)
            held_rows = (self._file.nbytes - self._header_nbytes) // max(row_nbytes, 1)
            capacity_rows = max(self._rows + len(chunk), 2 * held_rows)
            self._file.resize(self._header_nbytes + capacity_rows * row_nbytes, refcheck=True)
        target = self._file[start:end].view(self._dtype).reshape(chunk.shape)
        np.copyto(target, chunk, casting="no")
        del target  # no view of the file outlives this call
        self._rows += len(chunk)
        sources.append(chunk)

    def _start(self, chunk: np.ndarray) -> None:
        """A file for ``chunk``'s rows and the reserve, header space first."""
        self._dtype, self._row_shape = chunk.dtype, chunk.shape[1:]
        made = empty_npy_file((max(len(chunk), self._reserve), *self._row_shape), self._dtype)
        if made is None:
            return
        file, data = made
        self._header_nbytes = file.nbytes - data.nbytes
        del data  # no view of the file outlives this call
        self._file = file
