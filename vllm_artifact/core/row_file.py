"""A request's first R3 rows sent to the frontend as a ``.npy`` file with room for the rest.

The frontend answers each request with its R3 as one ``.npy`` file, filled as the rows arrive
(:mod:`~vllm_artifact.core.row_assembly`). A request's first rows (its prompt's: the bulk of a
prefill-heavy request) would be copied there from the frame they arrived in, on the thread
every request's outputs wait for. Where the engine assembles those rows into a new array anyway
(a prefix hit: the store's rows and the computed ones), it makes that array the data part of
such a file: header space in front, room behind for the rows still to come. It sends the whole
file, header written for the rows so far, as one 1-D uint8 array (R3 rows are 3-D and a keys
handle's transport is 2-D, so none is taken for another), and the frontend adopts the frame it
arrived in as the request's file: the first rows are not copied again, later rows go into the
room.

The room is sent too, uninitialized: files are made only where it is small beside the rows
(:func:`room_fits`).
"""

from __future__ import annotations

import io
import math

import numpy as np

from vllm_artifact.core.npy import byte_offset, npy_header
from vllm_artifact.core.recycled_arrays import RecycledArrays, empty
from vllm_artifact.core.schema import R3Layout

__all__ = [
    "HEADER_NBYTES",
    "ROOM_SHARE_MAX",
    "file_transport",
    "is_file_transport",
    "read_file_transport",
    "room_fits",
    "rows_with_room",
]

#: Room for later rows is made only up to this share of the first rows: it travels with them.
ROOM_SHARE_MAX = 0.25
#: The header's space: what ``np.save`` writes for rows of any shape R3 has (format 1.0, the
#: shape's digits well within the room numpy leaves for the first axis to grow).
#: :func:`file_transport` checks it against the header it writes.
HEADER_NBYTES = 128
_MAGIC = b"\x93NUMPY\x01\x00"  # format 1.0, the one npy_header writes
_PREAMBLE = len(_MAGIC) + 2  # then the header's length, little-endian uint16


def room_fits(first_rows: int, room_rows: int) -> bool:
    """Whether a file for ``first_rows`` should have ``room_rows`` more (it is sent along)."""
    return 0 <= room_rows <= ROOM_SHARE_MAX * first_rows


def rows_with_room(
    num_rows: int, room_rows: int | None, layout: R3Layout, arrays: RecycledArrays | None = None
) -> tuple[np.ndarray | None, np.ndarray]:
    """An uninitialized array for ``num_rows`` rows and, where ``room_rows`` is given and
    :func:`room_fits`, the uint8 file it is the data part of (header space, the rows,
    ``room_rows`` more); else None and an array of its own."""
    if room_rows is None or not room_fits(num_rows, room_rows):
        return None, layout.empty(num_rows, arrays)
    row_nbytes = layout.row_nbytes
    file = empty((HEADER_NBYTES + (num_rows + room_rows) * row_nbytes,), np.uint8, arrays)
    rows = file[HEADER_NBYTES : HEADER_NBYTES + num_rows * row_nbytes]
    return file, rows.view(layout.dtype).reshape(num_rows, layout.num_layers, layout.top_k)


def file_transport(file: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """``file`` with the header written for ``rows``, the rows at its data part's start (those
    :func:`rows_with_room` made, or fewer of them); None where ``rows`` are not there or the
    header does not fit the space before them (send ``rows`` instead)."""
    if not rows.flags.c_contiguous or file.dtype != np.uint8 or file.ndim != 1:
        return None
    start = byte_offset(rows, file)
    header = npy_header(rows.shape, rows.dtype)
    if header is None or start != len(header) or start + rows.nbytes > file.nbytes:
        return None
    file[:start] = np.frombuffer(header, dtype=np.uint8)
    return file


def is_file_transport(value: object) -> bool:
    """Whether ``value`` is what :func:`file_transport` sends (cheap: a type and prefix check)."""
    return (
        type(value) is np.ndarray
        and value.ndim == 1
        and value.dtype == np.uint8
        and len(value) > _PREAMBLE
        and value[: len(_MAGIC)].tobytes() == _MAGIC
    )


def read_file_transport(file: np.ndarray) -> tuple[int, np.ndarray]:
    """The header's length and the rows of a file :func:`is_file_transport` accepts, as a view
    of it; ``ValueError`` where the header does not describe 3-D rows that fit the file."""
    header_nbytes = _PREAMBLE + int.from_bytes(file[len(_MAGIC) : _PREAMBLE].tobytes(), "little")
    if header_nbytes > len(file):
        raise ValueError("an R3 file's header is longer than the file")
    stream = io.BytesIO(file[len(_MAGIC) : header_nbytes].tobytes())
    shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
    if fortran_order or dtype.hasobject or len(shape) != 3:
        raise ValueError(f"an R3 file holds {dtype} of shape {shape}, not rows")
    nbytes = dtype.itemsize * math.prod(shape)
    if header_nbytes + nbytes > len(file):
        raise ValueError(f"an R3 file of {len(file)} bytes is too short for rows of {shape}")
    rows = file[header_nbytes : header_nbytes + nbytes].view(dtype).reshape(shape)
    return header_nbytes, rows
