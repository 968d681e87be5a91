"""A request's R3 chunks copied on arrival join into exactly the ``.npy`` that concatenating
them at the end gives; anything else in vLLM's list falls back to that concatenation."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vllm_artifact.core.npy import concatenate_into_npy, encode_npy_base64, npy_file_of
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_assembly import ArrivingRows, FilePool
from vllm_artifact.core.row_file import file_transport, rows_with_room
from vllm_artifact.core.schema import R3Layout

ROW = (5, 3)


def chunk(first: int, rows: int, dtype: type = np.uint8) -> np.ndarray:
    values = np.arange(first * 15, (first + rows) * 15) % 251
    return values.astype(dtype).reshape(rows, *ROW)


def npy_bytes(array: np.ndarray) -> bytes:
    with io.BytesIO() as fp:
        np.save(fp, array, allow_pickle=False)
        return fp.getvalue()


def _pool(max_bytes: int = 1 << 20) -> FilePool:
    return FilePool(RecycledArrays(max_bytes=max_bytes, min_bytes=1, steps_per_doubling=4))


@pytest.mark.parametrize("pooled", [False, True], ids=["own-memory", "pool"])
@pytest.mark.parametrize("reserve", [0, 3, 40, 5000])
def test_chunks_join_into_the_npy_of_their_concatenation(reserve: int, pooled: bool) -> None:
    """A prompt in two prefill chunks, decode rows one by one (the file grows past any
    reserve: by resize, or by copies into larger pool buffers) and a held chunk at the end."""
    pool = _pool() if pooled else None
    arriving = ArrivingRows(reserve_rows=reserve, pool=pool)
    chunks = [chunk(0, 7), chunk(7, 4)] + [chunk(11 + i, 1) for i in range(30)] + [chunk(41, 9)]
    for c in chunks:
        arriving.append(c)
    assert list(arriving) == chunks  # vLLM's list is what it was
    joined = arriving.joined()
    assert joined is not None
    expected = np.concatenate(chunks)
    np.testing.assert_array_equal(joined, expected)
    file = npy_file_of(joined)
    assert file is not None and file.tobytes() == npy_bytes(expected)
    assert encode_npy_base64(joined) == encode_npy_base64(expected)
    assert file.nbytes == len(npy_bytes(expected))  # shrunk to its rows
    assert file.flags.owndata == (pool is None)  # its own memory, or the pool's
    for c in chunks:  # copies: the chunks' memory is not the file's
        assert not np.shares_memory(c, joined)


def test_the_stop_string_trim_of_the_last_chunk_is_followed() -> None:
    """vLLM replaces the last chunk with a shorter one when a stop string ends a request
    inside a step of several tokens."""
    arriving = ArrivingRows(reserve_rows=8)
    first, last = chunk(0, 6), chunk(6, 5)
    arriving.append(first)
    arriving.append(last)
    arriving[-1] = last[:2]
    joined = arriving.joined()
    assert joined is not None
    np.testing.assert_array_equal(joined, np.concatenate([first, last[:2]]))
    assert npy_file_of(joined) is not None


@pytest.mark.parametrize(
    "spoil",
    [
        lambda a: a.append(chunk(9, 2, np.uint16)),  # another dtype
        lambda a: a.append(np.zeros((2, 4, 3), np.uint8)),  # another row shape
        lambda a: a.append([[1]]),  # not an array
        lambda a: a.insert(0, chunk(9, 2)),  # a list change not followed
        lambda a: a.__setitem__(0, chunk(9, 2)),  # not the last chunk
        lambda a: (a.clear(), a.append(chunk(9, 2))),
        lambda a: a.reverse(),  # the same chunks in another order
    ],
)
def test_a_list_that_is_not_the_chunks_copied_falls_back(spoil: object) -> None:
    arriving = ArrivingRows()
    arriving.append(chunk(0, 3))
    arriving.append(chunk(3, 2))
    spoil(arriving)  # type: ignore[operator]
    assert arriving.joined() is None


def test_after_its_end_a_resumable_request_falls_back_to_concatenating_everything() -> None:
    arriving = ArrivingRows()
    arriving.append(chunk(0, 3))
    first_end = arriving.joined()
    assert first_end is not None
    arriving.append(chunk(3, 2))
    assert arriving.joined() is None
    joined = concatenate_into_npy(arriving)
    assert joined is not None
    np.testing.assert_array_equal(joined, np.concatenate([chunk(0, 3), chunk(3, 2)]))
    np.testing.assert_array_equal(first_end, chunk(0, 3))  # the first end's rows kept


def test_an_empty_list_joins_to_none() -> None:
    assert ArrivingRows(reserve_rows=10).joined() is None


def test_a_pool_file_is_used_again_only_once_its_rows_are_dropped() -> None:
    """Rows a caller keeps stay as they were while later requests fill the pool's files;
    once dropped, the next request's file is the same memory (no new buffer)."""
    pool = _pool()

    def request(first: int) -> np.ndarray:
        arriving = ArrivingRows(reserve_rows=20, pool=pool)
        arriving.append(chunk(first, 12))
        arriving.append(chunk(first + 12, 8))
        joined = arriving.joined()
        assert joined is not None
        return joined

    kept = request(0)
    address = kept.__array_interface__["data"][0]
    keepers = [lambda a: a, lambda a: a[3:5], lambda a: memoryview(a), lambda a: npy_file_of(a)]
    for keep in keepers:
        view = keep(kept)
        before = np.array(view, copy=True)
        del kept
        others = [request(100 + i) for i in range(3)]
        assert all(o.__array_interface__["data"][0] != address for o in others)
        np.testing.assert_array_equal(np.asarray(view), before)
        del others, view
        kept = request(0)
    kept_bytes = pool.arrays.nbytes
    del kept
    again = request(200)
    assert pool.arrays.nbytes == kept_bytes
    np.testing.assert_array_equal(again, np.concatenate([chunk(200, 12), chunk(212, 8)]))


def test_past_the_pools_bound_files_are_fresh_memory() -> None:
    pool = _pool(max_bytes=4096)
    held = []
    for first in range(0, 400, 40):
        arriving = ArrivingRows(reserve_rows=40, pool=pool)  # 40 rows of 15 bytes: 728 bytes
        arriving.append(chunk(first, 40))
        joined = arriving.joined()
        assert joined is not None
        held.append(joined)
    assert pool.arrays.nbytes <= 4096
    assert any(npy_file_of(h) is not None and npy_file_of(h).flags.owndata for h in held)  # type: ignore[union-attr]
    for first, rows in zip(range(0, 400, 40), held, strict=True):
        np.testing.assert_array_equal(rows, chunk(first, 40))


def sent_as_file(rows: np.ndarray, room: int, writeable: bool = True) -> np.ndarray:
    """What the engine sends for ``rows`` made with ``room`` more (core/row_file.py), as the
    frontend's decoder hands it over: a 1-D view of the frame it arrived in."""
    layout = R3Layout(num_layers=ROW[0], top_k=ROW[1], num_experts=256, block_size=4)
    file, made = rows_with_room(len(rows), room, layout)
    assert file is not None
    made[...] = rows
    sent = file_transport(file, made)
    assert sent is not None
    frame = bytearray(sent.tobytes()) if writeable else sent.tobytes()
    return np.frombuffer(frame, np.uint8)


@pytest.mark.parametrize("pooled", [False, True], ids=["own-memory", "pool"])
@pytest.mark.parametrize("tail", [0, 1, 10, 11, 40], ids=lambda n: f"tail{n}")
def test_a_first_chunk_sent_as_a_file_is_adopted_and_the_rest_goes_into_its_room(
    tail: int, pooled: bool
) -> None:
    """The prompt's rows are not copied; the held rest fills the room (10 rows) or, past
    it, moves with them into a larger file."""
    prompt, rest = chunk(0, 40), chunk(40, tail)
    sent = sent_as_file(prompt, room=10)
    arriving = ArrivingRows(reserve_rows=50, pool=_pool() if pooled else None)
    arriving.append(sent)
    if tail:
        arriving.append(rest)
    assert len(arriving) == 1 + bool(tail) and arriving[0].shape == prompt.shape  # rows listed
    joined = arriving.joined()
    assert joined is not None
    expected = np.concatenate([prompt, rest])
    np.testing.assert_array_equal(joined, expected)
    file = npy_file_of(joined)
    assert file is not None and file.tobytes() == npy_bytes(expected)
    assert encode_npy_base64(joined) == encode_npy_base64(expected)
    assert np.shares_memory(joined, sent) == (tail <= 10)  # adopted while the room lasts
    assert arriving.adopted


@pytest.mark.parametrize(
    "arrive",
    [
        lambda a, sent: a.append(sent),  # read-only: copied, not adopted
        lambda a, sent: (a.append(chunk(100, 2)), a.append(sent)),  # not the first chunk
    ],
    ids=["read-only-frame", "second-chunk"],
)
def test_a_file_that_cannot_be_adopted_is_copied_like_any_chunk(arrive: object) -> None:
    prompt = chunk(0, 40)
    read_only = sent_as_file(prompt, room=10, writeable=False)
    arriving = ArrivingRows(reserve_rows=50)
    arrive(arriving, read_only)  # type: ignore[operator]
    joined = arriving.joined()
    assert joined is not None
    expected = np.concatenate([np.asarray(c) for c in arriving])
    np.testing.assert_array_equal(joined[-40:], prompt)
    assert npy_file_of(joined) is not None and npy_file_of(joined).tobytes() == npy_bytes(expected)  # type: ignore[union-attr]
    assert not np.shares_memory(joined, read_only) and not arriving.adopted


def test_a_file_in_a_list_that_falls_back_is_concatenated_as_its_rows() -> None:
    """vLLM's own concatenation (or ours, after a list change we do not follow) sees rows."""
    prompt = chunk(0, 40)
    arriving = ArrivingRows()
    arriving.append(sent_as_file(prompt, room=10))
    arriving.append(chunk(40, 3))
    arriving.insert(0, chunk(90, 1))
    assert arriving.joined() is None
    joined = concatenate_into_npy(arriving)
    assert joined is not None
    np.testing.assert_array_equal(joined, np.concatenate([chunk(90, 1), prompt, chunk(40, 3)]))
    arriving[-1] = sent_as_file(chunk(50, 2), room=0)  # a replaced last chunk, as rows
    np.testing.assert_array_equal(arriving[-1], chunk(50, 2))


def test_a_file_that_cannot_be_read_fails_the_request_at_its_end_not_the_frontend() -> None:
    """vLLM's output handler serves every request: a file whose header claims more rows than
    it holds is listed as it came, and the request's end raises (the hook fails it)."""
    sent = sent_as_file(chunk(0, 40), room=0)
    arriving = ArrivingRows()
    arriving.append(sent[:-1])
    arriving.append(chunk(40, 2))
    arriving[-1] = sent[:-15]
    assert len(arriving) == 2
    with pytest.raises(ValueError, match="too short"):
        arriving.joined()
