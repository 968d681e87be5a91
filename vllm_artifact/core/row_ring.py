"""Fixed slots of shared memory that carry each step's rows from the engine to the tracker
process, and the arrays of its answer back: one copy in, no pickling of rows, no name in any
filesystem (an anonymous ``memfd`` the child inherits), freed when both sides close it. A slot
serves one step at a time: its rows, then (once the process has copied them out) the answer's
arrays, which the engine reads in place (:meth:`RowRing.lease`) or copies out
(:meth:`RowRing.copy_out`).

A leased slot is in use for as long as anything refers to an array read from it: each slot has
an anchor array of its own (a mapping of the slot alone), every view of the slot's arrays,
however derived, refers to that anchor (numpy collapses a view's ``base`` onto it), so a slot
whose anchor only the ring refers to is one nothing can read any more (:meth:`RowRing.leased`,
checked as :mod:`~vllm_artifact.core.recycled_arrays` checks its buffers)."""

from __future__ import annotations

import contextlib
import mmap
import os
import sys

import numpy as np

from vllm_artifact.core.buffer import copy_rows_into
from vllm_artifact.core.recycled_arrays import RecycledArrays, empty

__all__ = ["RowRing"]

# ``sys.getrefcount(anchors[i])`` of an anchor referenced by the list alone: the list's
# reference and the call's argument.
_ONLY_THE_RINGS = 2


class RowRing:
    """``slots`` buffers of ``slot_bytes`` each in one shared mapping."""

    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.fd = fd
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._map = mmap.mmap(fd, slots * slot_bytes)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._anchors: list[np.ndarray | None] = [None] * slots  # made on a slot's first lease
        self._slot_maps: list[mmap.mmap] = []

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> RowRing:
        """A new ring in fresh anonymous shared memory (pages are taken as they are touched);
        ``slot_bytes`` is rounded up to whole pages, so that each slot can be mapped alone."""
        slot_bytes = -(-slot_bytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        fd = os.memfd_create("vllm-artifact-rows", 0)
        os.ftruncate(fd, slots * slot_bytes)
        return cls(fd, slots, slot_bytes)

    def write(self, slot: int, rows: np.ndarray) -> None:
        """Copy ``[tokens, layers, top_k]`` rows (C-contiguous or not) into ``slot``, keeping
        the GIL (core/buffer.py: a release on the engine's step thread can cost it 5 ms)."""
        nbytes = rows.nbytes
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes of rows do not fit a {self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        target = self._bytes[start : start + nbytes].view(rows.dtype).reshape(rows.shape)
        copy_rows_into(target, rows)

    def read(self, slot: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A view of ``slot`` as an array (valid until the slot is written again)."""
        start = slot * self.slot_bytes
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self._bytes[start : start + nbytes].view(dtype).reshape(shape)

    def write_buffers(self, slot: int, buffers: list[memoryview]) -> list[tuple[int, int]] | None:
        """Copy ``buffers`` (contiguous bytes) into ``slot`` end to end; their ``(offset,
        nbytes)``, or None if they do not fit (nothing written)."""
        sizes = [buffer.nbytes for buffer in buffers]
        if sum(sizes) > self.slot_bytes:
            return None
        spans, at = [], slot * self.slot_bytes
        for buffer, nbytes in zip(buffers, sizes, strict=True):
            self._bytes[at : at + nbytes] = np.frombuffer(buffer.cast("B"), dtype=np.uint8)
            spans.append((at, nbytes))
            at += nbytes
        return spans

    def copy_out(
        self, spans: list[tuple[int, int]], arrays: RecycledArrays | None = None
    ) -> list[np.ndarray]:
        """Copies of the byte ranges ``spans`` (as :meth:`write_buffers` gave them), in
        ``arrays``' reused memory if given (a prefill step's answer is tens of megabytes:
        fresh memory would be faulted in page by page), keeping the GIL (core/buffer.py)."""
        copies = []
        for at, nbytes in spans:
            out = empty((nbytes,), np.uint8, arrays)
            source = self._bytes[at : at + nbytes]
            copy_rows_into(out.reshape(nbytes, 1, 1), source.reshape(nbytes, 1, 1))
            copies.append(out)
        return copies

    def lease(self, slot: int, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """The byte ranges ``spans`` of ``slot`` (as :meth:`write_buffers` gave them), read in
        place: the slot is :meth:`leased` until nothing refers to them any more."""
        anchor = self._anchors[slot]
        if anchor is None:
            if self.slot_bytes % mmap.ALLOCATIONGRANULARITY:
                raise ValueError("a slot of a ring not made by RowRing.create cannot be leased")
            mapping = mmap.mmap(self.fd, self.slot_bytes, offset=slot * self.slot_bytes)
            self._slot_maps.append(mapping)
            anchor = self._anchors[slot] = np.frombuffer(mapping, dtype=np.uint8)
        start = slot * self.slot_bytes
        views = []
        for at, nbytes in spans:
            if not start <= at <= at + nbytes <= start + self.slot_bytes:
                raise ValueError(f"bytes {at}+{nbytes} are not in slot {slot}")
            views.append(anchor[at - start : at - start + nbytes])
        return views

    def leased(self, slot: int) -> bool:
        """Whether an array read in place from ``slot`` (:meth:`lease`) may still be read."""
        anchor = self._anchors[slot]
        # The list's reference, this name's and the call's argument: nothing else.
        return anchor is not None and sys.getrefcount(anchor) > _ONLY_THE_RINGS + 1

    def close(self) -> None:
        """Unmap and close; memory of views still held stays valid until they go."""
        del self._bytes
        self._anchors = []
        for mapping in [self._map, *self._slot_maps]:
            with contextlib.suppress(BufferError):  # a view still refers to it: it goes with it
                mapping.close()
        os.close(self.fd)
