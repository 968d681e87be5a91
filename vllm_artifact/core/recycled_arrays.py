"""Row arrays whose memory is used again once nothing refers to it any more.

A prefill step makes several megabytes of new row arrays on the engine's step thread: the
step's rows copied out of the GPU copy's page-locked buffer, a prompt chunk's completed blocks
for the store, and each prompt's rows (its prefix hit, then what it computed) sent to the
frontend. Fresh memory of that size comes from ``mmap`` and is faulted in page by page on
first touch, so filling it costs several times a copy into memory touched before (measured:
on the CI machine, a 713 KB copy 0.16-0.28 ms into fresh memory, 0.027 ms into reused; on
an H100 host whose allocator hardly faulted, no measurable difference: docs/benchmarks.md).

:class:`RecycledArrays` hands out arrays as views of buffers it keeps, one buffer per array, in
size classes (powers of two, or finer steps where the arrays are kept a long time by their
users: each array then keeps less unused memory alive behind it). A buffer is free again once
no array refers to it: every view of it, however derived (a slice, a reshape, a view of a
view), keeps a reference to the buffer itself, as numpy collapses a view's ``base`` onto the
array that owns the memory; a memoryview or a tensor made from a view keeps the view, and so
the buffer. So a buffer whose only reference is this pool's is one nothing can read or write,
whichever thread dropped the last view (the engine's output thread, the publisher); it is
checked with ``sys.getrefcount`` before reuse, on the owner's thread. The pool keeps at most
``max_bytes`` of buffers; beyond that an array is a plain ``np.empty``, as it is below
``min_bytes``.
"""

from __future__ import annotations

import math
import sys

import numpy as np

__all__ = ["RecycledArrays", "empty"]

#: Below this an array is a plain ``np.empty``: the allocator's heap serves it from memory
#: touched before.
MIN_RECYCLED_BYTES = 64 * 1024
#: What a pool keeps by default: a few prefill steps' arrays of a DeepSeek-V3-sized model.
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

# ``sys.getrefcount(buffers[i])`` of a buffer referenced by the list alone: the list's
# reference and the call's argument.
_ONLY_THE_POOLS = 2


class RecycledArrays:
    """``empty(shape, dtype)`` that reuses the memory of arrays no longer referred to.

    One owner thread calls :meth:`empty`; the arrays it hands out may be dropped anywhere.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_bytes: int = MIN_RECYCLED_BYTES,
        steps_per_doubling: int = 1,
    ) -> None:
        if steps_per_doubling not in (1, 2, 4, 8):
            raise ValueError(f"steps_per_doubling must be 1, 2, 4 or 8, not {steps_per_doubling}")
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        # 1: buffers of 2**k bytes; 4: of 2**k * (1.25, 1.5, 1.75, 2), at most 25% unused
        self.steps_per_doubling = steps_per_doubling
        self._buffers: dict[int, list[np.ndarray]] = {}  # size class (bytes) -> buffers
        self.nbytes = 0  # of all buffers kept
        self.reused = 0  # arrays handed out in memory used before

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized array; its memory is this pool's to reuse once it is dropped."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype)
        buffer = self._free_buffer(self.size_class(nbytes))
        if buffer is None:
            return np.empty(shape, dtype)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def size_class(self, nbytes: int) -> int:
        """The size of the buffers that serve arrays of ``nbytes`` (bytes, at least 1)."""
        doubling = 1 << (nbytes - 1).bit_length()  # the next power of two
        step = max(1, doubling // (2 * self.steps_per_doubling))
        return -(-nbytes // step) * step

    def _free_buffer(self, size_class: int) -> np.ndarray | None:
        """A buffer of the class that nothing refers to, else a new one if the pool has
        room (made by dropping free buffers of other classes if need be), else None."""
        buffers = self._buffers.setdefault(size_class, [])
        for i in range(len(buffers)):
            if sys.getrefcount(buffers[i]) == _ONLY_THE_POOLS:
                buffer = buffers[i]
                # The next search starts after it: the buffers just handed out are the ones
                # most likely still in use.
                buffers.append(buffers.pop(i))
                self.reused += 1
                return buffer
        if self.nbytes + size_class > self.max_bytes and not self._make_room(size_class):
            return None
        buffer = np.empty(size_class, np.uint8)
        buffers.append(buffer)
        self.nbytes += size_class
        return buffer

    def _make_room(self, size: int) -> bool:
        """Drop free buffers (of any class, largest first) until ``size`` more bytes fit."""
        for size_class in sorted(self._buffers, reverse=True):
            buffers = self._buffers[size_class]
            i = 0
            while i < len(buffers) and self.nbytes + size > self.max_bytes:
                if sys.getrefcount(buffers[i]) == _ONLY_THE_POOLS:
                    del buffers[i]
                    self.nbytes -= size_class
                else:
                    i += 1
        return self.nbytes + size <= self.max_bytes


def empty(
    shape: tuple[int, ...], dtype: np.dtype | type, arrays: RecycledArrays | None = None
) -> np.ndarray:
    """``np.empty(shape, dtype)``, in ``arrays``' reused memory if given."""
    return np.empty(shape, dtype) if arrays is None else arrays.empty(shape, dtype)
