"""A request's first rows made the data part of a ``.npy`` file with room for the rest: what
the engine sends reads back as exactly those rows, and nothing else is taken for it."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_file import (
    file_transport,
    is_file_transport,
    read_file_transport,
    room_fits,
    rows_with_room,
)
from vllm_artifact.core.schema import R3Layout

LAYOUT = R3Layout(num_layers=5, top_k=3, num_experts=16, block_size=4)


def rows_of(first: int, count: int) -> np.ndarray:
    values = np.arange(first * 15, (first + count) * 15) % 16
    return values.astype(LAYOUT.dtype).reshape(count, 5, 3)


def npy_bytes(array: np.ndarray) -> bytes:
    with io.BytesIO() as fp:
        np.save(fp, array, allow_pickle=False)
        return fp.getvalue()


@pytest.mark.parametrize("pooled", [False, True], ids=["own-memory", "pool"])
def test_the_file_sent_starts_with_the_npy_of_its_rows_and_reads_back_as_them(
    pooled: bool,
) -> None:
    arrays = RecycledArrays(min_bytes=1) if pooled else None
    file, rows = rows_with_room(40, 10, LAYOUT, arrays)
    assert file is not None and rows.shape == (40, 5, 3) and np.shares_memory(file, rows)
    rows[...] = rows_of(0, 40)
    sent = file_transport(file, rows)
    assert sent is not None and is_file_transport(sent)
    expected = npy_bytes(rows_of(0, 40))
    assert sent[: len(expected)].tobytes() == expected
    assert sent.nbytes == len(expected) + 10 * 15  # the room travels behind the rows
    header_nbytes, read = read_file_transport(sent)
    assert header_nbytes == len(expected) - 40 * 15
    np.testing.assert_array_equal(read, rows_of(0, 40))


def test_fewer_rows_than_made_are_sent_with_a_header_for_those() -> None:
    """Drafts rejected after the worker ran: the scheduler takes a prefix of the rows."""
    file, rows = rows_with_room(40, 10, LAYOUT)
    assert file is not None
    rows[...] = rows_of(0, 40)
    sent = file_transport(file, rows[:37])
    assert sent is not None
    np.testing.assert_array_equal(read_file_transport(sent)[1], rows_of(0, 37))


def test_rows_not_at_the_files_data_start_are_not_sent_as_the_file() -> None:
    file, rows = rows_with_room(40, 10, LAYOUT)
    assert file is not None
    assert file_transport(file, rows[1:]) is None
    assert file_transport(file, rows[::2]) is None
    assert file_transport(np.empty_like(file), rows) is None


@pytest.mark.parametrize(("rows", "room", "fits"), [(40, 10, True), (40, 11, False), (8, 0, True)])
def test_a_file_has_room_only_where_the_room_is_small_beside_the_rows(
    rows: int, room: int, fits: bool
) -> None:
    """The room is sent along, uninitialized: at most a quarter of the rows."""
    assert room_fits(rows, room) == fits
    file, array = rows_with_room(rows, room, LAYOUT)
    assert (file is not None) == fits
    assert array.shape == (rows, 5, 3)
    file, array = rows_with_room(rows, None, LAYOUT)
    assert file is None and array.shape == (rows, 5, 3)


def test_nothing_else_vllm_or_we_send_is_taken_for_a_file() -> None:
    """(A keys handle's transport: ``test_handoff.py``.)"""
    assert not is_file_transport(rows_of(0, 4))  # rows: 3-D
    assert not is_file_transport(np.frombuffer(b"\x93NUMPX\x01\x00" + b" " * 200, np.uint8))
    assert not is_file_transport(np.frombuffer(npy_bytes(rows_of(0, 2)), np.uint8).astype(np.int8))
    assert is_file_transport(np.frombuffer(npy_bytes(rows_of(0, 2)), np.uint8))


@pytest.mark.parametrize(
    "content",
    [
        np.zeros((3, 4), np.uint8),  # not rows: 2-D
        np.zeros((3,), np.uint8),
        np.asfortranarray(np.zeros((2, 3, 4), np.uint8)),
    ],
    ids=["2-D", "1-D", "fortran"],
)
def test_a_file_that_does_not_hold_rows_is_refused(content: np.ndarray) -> None:
    file = np.frombuffer(npy_bytes(content), np.uint8)
    with pytest.raises(ValueError, match="not rows"):
        read_file_transport(file)


def test_a_file_shorter_than_its_header_says_is_refused() -> None:
    file = np.frombuffer(npy_bytes(rows_of(0, 4)), np.uint8)
    with pytest.raises(ValueError, match="too short"):
        read_file_transport(file[:-1])
    with pytest.raises(ValueError, match="header is longer"):
        read_file_transport(file[:40])
