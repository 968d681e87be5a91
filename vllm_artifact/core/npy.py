"""R3's wire format, base64 of an ``.npy`` file, made and read in as few passes as possible.

vLLM's serving layer encodes with ``np.save`` into a growing ``BytesIO``, then
``pybase64.b64encode`` and ``.decode("ascii")``: three passes over a payload of many MiB, the
last two into fresh ``bytes`` and ``str`` (each page faults on first touch). Here:

* the frontend concatenates a request's per-step R3 chunks once, straight into the data part
  of a complete ``.npy`` file (:func:`concatenate_into_npy`; vLLM concatenates them anyway),
  and :func:`encode_npy_base64` base64-encodes such a file as it is, straight to ``str``. Any
  other array costs one copy into such a file. The text is byte for byte what ``np.save`` plus
  base64 gives (``tests/core/test_npy.py`` compares), so clients see no change;
* the client decodes in slices into one numpy buffer (:func:`decode_npy_base64`): numpy asks
  the kernel for huge pages on big buffers, so the time does not depend on what the process
  allocated and freed before (a fresh multi-MiB ``bytearray`` can cost 4x more in page faults).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import pybase64

__all__ = [
    "byte_offset",
    "concatenate_into_npy",
    "decode_npy_base64",
    "empty_npy_file",
    "encode_npy_base64",
    "npy_file_of",
    "npy_header",
]

#: Base64 characters decoded per slice (a multiple of 4): large enough that the per-slice
#: Python cost vanishes, small enough that the slices stay in cache.
_DECODE_SLICE = 1 << 20


def npy_header(shape: Sequence[int], dtype: np.dtype[Any]) -> bytes | None:
    """The header ``np.save`` writes for a C-ordered array of ``shape`` and ``dtype``, or None
    where ``np.save`` would write another format version or refuse (object dtypes)."""
    return _npy_header(tuple(int(n) for n in shape), dtype)


@functools.lru_cache(maxsize=1024)
def _npy_header(shape: tuple[int, ...], dtype: np.dtype[Any]) -> bytes | None:
    """(Kept for the shapes seen last: a request's header is made on the engine's step
    thread and on the frontend's output thread, 5 us each, and lengths often repeat.)"""
    if dtype.hasobject:
        return None
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": shape,
    }
    fp = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(fp, header)
    except (ValueError, UnicodeError):  # too long for format 1.0, or non-ASCII field names
        return None
    return fp.getvalue()


def byte_offset(view: np.ndarray, buffer: np.ndarray) -> int:
    """Where ``view``'s data starts in ``buffer``'s, in bytes (outside ``[0, buffer.nbytes)``
    where it lies elsewhere)."""
    return int(view.__array_interface__["data"][0] - buffer.__array_interface__["data"][0])


def empty_npy_file(
    shape: Sequence[int], dtype: np.dtype[Any]
) -> tuple[np.ndarray, np.ndarray] | None:
    """A complete ``.npy`` file with an uninitialized data part, and that part as an array
    (None where :func:`npy_header` is None)."""
    header = npy_header(shape, dtype)
    if header is None:
        return None
    count = int(np.prod(shape, dtype=np.int64))
    file = np.empty(len(header) + count * dtype.itemsize, dtype=np.uint8)
    file[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    return file, file[len(header) :].view(dtype).reshape(shape)


def npy_file_of(array: np.ndarray) -> np.ndarray | None:
    """The complete ``.npy`` file (a uint8 array) whose data part ``array`` is, or None.

    True only when the bytes right before ``array`` are exactly the header ``np.save`` would
    write for it, so encoding the file gives ``np.save``'s bytes whatever made the array.
    """
    file = array.base
    if (
        type(array) is not np.ndarray
        or not isinstance(file, np.ndarray)
        or file.dtype != np.uint8
        or file.ndim != 1
        or not file.flags.c_contiguous
        or not array.flags.c_contiguous
    ):
        return None
    header_nbytes = file.nbytes - array.nbytes
    if header_nbytes <= 0 or byte_offset(array, file) != header_nbytes:
        return None
    header = npy_header(array.shape, array.dtype)
    if header is None or len(header) != header_nbytes or file[:header_nbytes].tobytes() != header:
        return None
    return file


def concatenate_into_npy(chunks: Sequence[np.ndarray]) -> np.ndarray | None:
    """``np.concatenate(chunks, axis=0)``, written into the data part of a new ``.npy`` file
    (so :func:`encode_npy_base64` needs no copy); None if the chunks are not plain arrays of
    one dtype and row shape (the caller leaves those to numpy, which explains the problem)."""
    if not chunks:
        return None
    first = chunks[0]
    if not all(
        type(c) is np.ndarray
        and c.ndim >= 1
        and c.ndim == first.ndim
        and c.dtype == first.dtype
        and c.shape[1:] == first.shape[1:]
        for c in chunks
    ):
        return None
    made = empty_npy_file((sum(len(c) for c in chunks), *first.shape[1:]), first.dtype)
    if made is None:
        return None
    _, data = made
    np.concatenate(chunks, axis=0, out=data)
    return data


def encode_npy_base64(array: np.ndarray) -> str:
    """Base64 of ``np.save(array, allow_pickle=False)``'s bytes, with no copy for arrays from
    :func:`concatenate_into_npy` and one copy for other plain arrays."""
    file = npy_file_of(array)
    if file is None:
        fortran_only = array.flags.f_contiguous and not array.flags.c_contiguous
        made = (
            None
            if type(array) is not np.ndarray or fortran_only
            else empty_npy_file(array.shape, array.dtype)
        )
        if made is None:  # subclasses, Fortran order, object dtypes: numpy's own writer
            with io.BytesIO() as fp:
                np.save(fp, array, allow_pickle=False)
                return pybase64.b64encode_as_string(fp.getbuffer())
        file, data = made
        np.copyto(data, array, casting="no")
    return pybase64.b64encode_as_string(file.data)


def decode_npy_base64(payload: str | bytes) -> np.ndarray:
    """The ``.npy`` file carried by base64 ``payload``, as a writable uint8 array.

    Strict: characters outside the base64 alphabet, misplaced padding and a length that is not
    a multiple of 4 raise ``ValueError``.
    """
    if isinstance(payload, str) and not payload.isascii():
        raise ValueError("routed_experts is not base64: non-ASCII characters")
    size = len(payload)
    if size % 4:
        raise ValueError(f"routed_experts is not base64: length {size} is not a multiple of 4")
    tail = payload[-2:]
    padding = tail.count("=") if isinstance(tail, str) else tail.count(b"=")
    file = np.empty(size // 4 * 3 - padding, dtype=np.uint8)
    view = memoryview(payload) if isinstance(payload, bytes) else payload
    at = 0
    for start in range(0, size, _DECODE_SLICE):
        piece = pybase64.b64decode(view[start : start + _DECODE_SLICE], validate=True)
        end = at + len(piece)
        if end > len(file) or (
            start + _DECODE_SLICE < size and len(piece) * 4 != _DECODE_SLICE * 3
        ):
            raise ValueError("routed_experts is not base64: padding inside the payload")
        file[at:end] = np.frombuffer(piece, dtype=np.uint8)
        at = end
    if at != len(file):
        raise ValueError("routed_experts is not base64: malformed padding")
    return file
