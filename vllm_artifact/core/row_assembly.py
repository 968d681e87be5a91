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

With a :class:`FilePool` the file is instead cut from memory the process touched before, once
no earlier request's rows refer to it: a file of fresh memory faults in 4 KiB at a time, on
the thread every request's outputs wait for. Such a file grows by a copy into a larger one, and
at the end the rows come as the data part of a file of exactly their size, which keeps the
pool's buffer in use for as long as anything refers to the rows.

A first chunk that arrives as a file with room (:mod:`~vllm_artifact.core.row_file`: the engine
made it so) is adopted as the file: the list holds its rows, a view of it, and only later rows
are copied, into its room (or, once that is full, with it into a larger file).
"""

from __future__ import annotations

import operator
import threading
from typing import Any, SupportsIndex

import numpy as np

from vllm_artifact.core.npy import npy_header
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_file import is_file_transport, read_file_transport

__all__ = ["RESERVE_ROWS_MAX", "ArrivingRows", "FilePool"]

#: Rows reserved past the first chunk for the rows still to come (the request's token budget
#: where it has one, at most this many; more grow the file).
RESERVE_ROWS_MAX = 4096


class FilePool:
    """:class:`RecycledArrays` for the files of every request of a process, whichever thread
    makes them (the pool itself has one owner thread)."""

    def __init__(self, arrays: RecycledArrays) -> None:
        self.arrays = arrays
        self._lock = threading.Lock()

    def file(self, nbytes: int) -> np.ndarray:
        """An uninitialized uint8 file of ``nbytes``."""
        with self._lock:
            return self.arrays.empty((nbytes,), np.uint8)


class ArrivingRows(list):
    """vLLM's list of a request's R3 chunks, each chunk also copied into one ``.npy`` file."""

    __slots__ = (
        "_adopted",
        "_dtype",
        "_error",
        "_file",
        "_header_nbytes",
        "_pool",
        "_reserve",
        "_row_shape",
        "_rows",
        "_sources",
    )

    def __init__(self, reserve_rows: int = 0, pool: FilePool | None = None) -> None:
        super().__init__()
        self._reserve = max(0, reserve_rows)  # rows the file is made for, at least
        self._pool = pool
        # uint8: header, then rows; owns its memory (it is resized), or a view of a pool's
        self._file: np.ndarray | None = None
        self._header_nbytes = 0
        self._rows = 0
        self._row_shape: tuple[int, ...] = ()
        self._dtype: np.dtype[Any] = np.dtype(np.uint8)
        self._sources: list[Any] | None = []  # the chunks copied, in order; None: given up
        self._error = ""  # why a chunk sent as a file could not be read (the request fails)
        self._adopted = False

    def append(self, chunk: Any) -> None:
        if is_file_transport(chunk):
            read = self._read(chunk)
            if read is not None:
                super().append(read[1])
                if not self._adopt(chunk, *read):
                    self._copy(read[1])
                return
        super().append(chunk)
        self._copy(chunk)

    def __setitem__(self, index: Any, value: Any) -> None:
        if is_file_transport(value):
            read = self._read(value)
            value = value if read is None else read[1]
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
        request's next end concatenates it). ``ValueError`` where a chunk sent as a file
        could not be read: the request has no rows to answer with."""
        if self._error:
            raise ValueError(self._error)
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
        nbytes = len(header) + rows * self._row_nbytes
        if file.flags.owndata:
            file.resize(nbytes, refcheck=True)
        else:
            # A file of exactly the rows that refers to the pool's buffer through a
            # memoryview: the rows' base is then this file, not the whole buffer, onto which
            # numpy collapses the base of any view of a view (npy_file_of needs the file).
            file = np.frombuffer(file[:nbytes].data, dtype=np.uint8)
        return file[len(header) :].view(self._dtype).reshape(shape)

    @property
    def adopted(self) -> bool:
        """Whether the first chunk came as a file and was taken as the request's file."""
        return self._adopted

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
        if end > self._file.nbytes:  # grow
            held_rows = (self._file.nbytes - self._header_nbytes) // max(row_nbytes, 1)
            capacity_rows = max(self._rows + len(chunk), 2 * held_rows)
            self._grow(self._header_nbytes + capacity_rows * row_nbytes, start)
        target = self._file[start:end].view(self._dtype).reshape(chunk.shape)
        np.copyto(target, chunk, casting="no")
        del target  # no view of the file outlives this call
        self._rows += len(chunk)
        sources.append(chunk)

    def _read(self, file: np.ndarray) -> tuple[int, np.ndarray] | None:
        """:func:`read_file_transport`, or None with the request failed at its end: this runs
        in vLLM's output handler, which must not raise for one request."""
        try:
            return read_file_transport(file)
        except ValueError as error:
            self._sources, self._error = None, f"R3 rows sent as a file could not be read: {error}"
            return None

    def _adopt(self, file: np.ndarray, header_nbytes: int, rows: np.ndarray) -> bool:
        """Take ``file`` (a writable file transport: header, ``rows``, room) as the file, if
        ``rows`` are the first chunk."""
        sources = self._sources
        if sources is None or sources or self._file is not None or not file.flags.writeable:
            return False
        # a view: the file is never resized in place (the list's rows refer to it)
        self._file, self._header_nbytes = file[:], header_nbytes
        self._dtype, self._row_shape = rows.dtype, rows.shape[1:]
        self._rows = len(rows)
        sources.append(rows)
        self._adopted = True
        return True

    def _grow(self, nbytes: int, used: int) -> None:
        """Make the file ``nbytes`` long, keeping its first ``used`` bytes."""
        if self._file is None:
            return
        if self._file.flags.owndata:  # resize: no other reference to the file
            self._file.resize(nbytes, refcheck=True)
            return
        grown = self._new_file(nbytes)
        grown[:used] = self._file[:used]
        self._file = grown

    def _new_file(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8) if self._pool is None else self._pool.file(nbytes)

    def _start(self, chunk: np.ndarray) -> None:
        """A file for ``chunk``'s rows and the reserve, header space first (the header is
        written at the end: its length does not change with the number of rows)."""
        self._dtype, self._row_shape = chunk.dtype, chunk.shape[1:]
        rows = max(len(chunk), self._reserve)
        header = npy_header((rows, *self._row_shape), self._dtype)
        if header is None:
            return
        self._header_nbytes = len(header)
        self._file = self._new_file(len(header) + rows * self._row_nbytes)
