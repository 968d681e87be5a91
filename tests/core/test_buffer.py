"""Logical request buffer: cached starts, recomputation, gaps, blocks, bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_artifact.core import R3Layout, RequestRowBuffer
from vllm_artifact.errors import BufferCapacityError, RowGapError, UnknownRequestError

LAYOUT = R3Layout(num_layers=2, top_k=2, num_experts=200, block_size=4)
BS = LAYOUT.block_size


def rows(start: int, stop: int, version: int = 0) -> np.ndarray:
    """Rows whose content encodes (token, version), to check which copy won."""
    out = np.zeros((stop - start, 2, 2), dtype=np.uint8)
    out[:, 0, 0] = np.arange(start, stop) % 200
    out[:, 1, 1] = version
    return out


def test_blocks_then_tail() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 6))
    full = buf.take_full_blocks("r")
    assert (full.first_block, full.num_blocks) == (0, 1)
    np.testing.assert_array_equal(full.rows, rows(0, 4))
    assert buf.take_full_blocks("r").num_blocks == 0
    buf.append("r", 6, rows(6, 11))
    full = buf.take_full_blocks("r")
    assert (full.first_block, full.num_blocks) == (1, 1)
    np.testing.assert_array_equal(full.block(0, BS), rows(4, 8))
    tail = buf.take_tail("r")
    assert tail.token_start == 8
    np.testing.assert_array_equal(tail.rows, rows(8, 11))
    assert "r" not in buf and buf.nbytes == 0


def test_prefix_hit_start_and_aligned_tail() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 8, rows(8, 16))  # blocks 0-1 came from the prefix cache
    full = buf.take_full_blocks("r")
    assert (full.first_block, full.num_blocks) == (2, 2)
    tail = buf.take_tail("r")
    assert tail.token_start == 16 and len(tail.rows) == 0


def test_recompute_replaces_overlap_and_ignores_published_rows() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 6, version=1))
    assert buf.take_full_blocks("r").num_blocks == 1  # tokens 0-3 published
    buf.append("r", 0, rows(0, 7, version=2))  # preempted, recomputed from 0
    assert buf.end("r") == 7
    tail = buf.take_tail("r")
    assert tail.token_start == 4
    np.testing.assert_array_equal(tail.rows, rows(4, 7, version=2))


def test_spec_decode_overlap_and_truncate() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 3))
    buf.append("r", 3, rows(3, 6, version=1))  # 3 draft tokens
    buf.truncate("r", 4)  # two rejected
    buf.append("r", 4, rows(4, 5, version=2))
    full = buf.take_full_blocks("r")
    np.testing.assert_array_equal(full.rows, np.concatenate([rows(0, 3), rows(3, 4, 1)]))
    np.testing.assert_array_equal(buf.take_tail("r").rows, rows(4, 5, 2))


def test_gap_rejected() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 2))
    with pytest.raises(RowGapError, match="lost"):
        buf.append("r", 3, rows(3, 4))
    assert buf.end("r") == 2  # unchanged


def test_partial_hit_mid_block() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 6, rows(6, 13))  # block 1 (tokens 4-7) was partly an external hit
    full = buf.take_full_blocks("r")
    assert (full.first_block, full.num_blocks) == (2, 1)  # rows 6-7 cannot form block 1
    np.testing.assert_array_equal(full.rows, rows(8, 12))
    np.testing.assert_array_equal(buf.take_tail("r").rows, rows(12, 13))
    buf.append("q", 6, rows(6, 7))
    with pytest.raises(RowGapError, match="partial cache hit"):
        buf.take_tail("q")
    assert "q" not in buf


def test_tail_requires_blocks_taken_and_unknown_ids() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 5))
    with pytest.raises(ValueError, match="take_full_blocks"):
        buf.take_tail("r")
    with pytest.raises(UnknownRequestError):
        buf.take_full_blocks("nope")
    buf.drop("nope")  # ignored
    with pytest.raises(ValueError, match="published"):
        buf.take_full_blocks("r")
        buf.truncate("r", 2)


def test_memory_bound() -> None:
    row = LAYOUT.row_nbytes
    buf = RequestRowBuffer(LAYOUT, max_bytes=240 * row)
    buf.append("a", 0, rows(0, 198))
    with pytest.raises(BufferCapacityError, match="buffer is full"):
        buf.append("b", 0, rows(0, 60))
    assert "b" in buf and buf.end("b") == 0  # state unchanged by the failed append
    assert buf.take_full_blocks("a").num_blocks == 49  # 2 rows stay; storage shrinks
    assert buf.nbytes <= 16 * row
    buf.append("b", 0, rows(0, 60))
    assert buf.nbytes <= buf.max_bytes
    buf.drop("a")
    buf.drop("b")
    assert buf.nbytes == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_matches_reference_model(data: st.DataObject) -> None:
    """Random appends (with overlap), truncations and takes equal a simple model:
    an append at ``lo`` replaces everything from ``lo`` on, except tokens
    already handed out as full blocks; the hand-outs tile the request exactly."""
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 20)
    start = data.draw(st.integers(0, 5)) * BS
    model: dict[int, np.ndarray] = {}  # token -> newest unpublished row
    published: dict[int, np.ndarray] = {}
    floor = end = start
    buf.append("r", start, rows(start, start))  # a request with no rows yet
    for version in range(data.draw(st.integers(1, 15))):
        action = data.draw(st.sampled_from(["append", "append", "truncate", "take"]))
        if action == "append":
            lo = data.draw(st.integers(max(0, floor - 6), end))
            n = data.draw(st.integers(0, 9))
            buf.append("r", lo, rows(lo, lo + n, version))
            if n and lo + n > floor:
                model = {t: r for t, r in model.items() if t < lo}
                for t in range(max(lo, floor), lo + n):
                    model[t] = rows(t, t + 1, version)[0]
                end = lo + n
        elif action == "truncate":
            cut = data.draw(st.integers(floor, end))
            buf.truncate("r", cut)
            model = {t: r for t, r in model.items() if t < cut}
            end = cut
        else:
            full = buf.take_full_blocks("r")
            assert full.first_block * BS == floor
            assert full.num_blocks == end // BS - floor // BS
            for i in range(full.num_blocks * BS):
                t = floor + i
                np.testing.assert_array_equal(full.rows[i], model.pop(t))
                published[t] = full.rows[i]
            floor += full.num_blocks * BS
        assert buf.end("r") == end
    full = buf.take_full_blocks("r")
    for i in range(full.num_blocks * BS):
        published[floor + i] = full.rows[i]
        np.testing.assert_array_equal(full.rows[i], model.pop(floor + i))
    tail = buf.take_tail("r")
    assert len(tail.rows) == len(model) < BS
    for i, row in enumerate(tail.rows):
        np.testing.assert_array_equal(row, model[tail.token_start + i])
        published[tail.token_start + i] = row
    assert sorted(published) == list(range(start, end))
    assert buf.nbytes == 0
