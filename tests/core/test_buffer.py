"""Logical request buffer: cached starts, recomputation, gaps, blocks, bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_artifact.core import R3Layout, RequestRowBuffer
from vllm_artifact.core.buffer import (
    copy_blocks,
    copy_rows,
    copy_rows_into,
    gather_rows,
    join_rows,
)
from vllm_artifact.errors import BufferCapacityError, RowGapError, UnknownRequestError

from .conftest import gil_releases

LAYOUT = R3Layout(num_layers=2, top_k=2, num_experts=200, block_size=4)
BS = LAYOUT.block_size


def rows(start: int, stop: int, version: int = 0) -> np.ndarray:
    """Rows whose content encodes (token, version), to check which copy won."""
    out = np.zeros((stop - start, 2, 2), dtype=np.uint8)
    out[:, 0, 0] = np.arange(start, stop) % 200
    out[:, 1, 1] = version
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_gather_rows_is_fancy_indexing(dtype: type, index_dtype: type) -> None:
    step = np.random.default_rng(0).integers(0, 200, (9, 3, 2)).astype(dtype)
    index = np.array([8, 0, 3, 3], dtype=index_dtype)
    for rows_in in (step, step[::2]):  # contiguous, and a strided view
        got = gather_rows(rows_in, index[index < len(rows_in)])
        np.testing.assert_array_equal(got, rows_in[index[index < len(rows_in)]])
        assert got.dtype == dtype and got.flags.c_contiguous and got.base is not rows_in


def test_blocks_then_tail() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    full = buf.append("r", 0, rows(0, 6))
    assert (full.first_block, full.num_blocks) == (0, 1)
    np.testing.assert_array_equal(full.rows, rows(0, 4))
    full = buf.append("r", 6, rows(6, 11))
    assert (full.first_block, full.num_blocks) == (1, 1)
    np.testing.assert_array_equal(full.block(0, BS), rows(4, 8))
    tail = buf.take_tail("r")
    assert tail.token_start == 8
    np.testing.assert_array_equal(tail.rows, rows(8, 11))
    assert "r" not in buf and buf.nbytes == 0


def test_blocks_that_join_nothing_buffered_are_views_of_the_appended_rows() -> None:
    """A prefill chunk's completed blocks are not copied unless they join rows buffered by an
    earlier call (a step's rows are fresh every step and never written again)."""
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    chunk = rows(0, 9)
    full = buf.append("r", 0, chunk)  # blocks 0-1; row 8 stays buffered
    np.testing.assert_array_equal(full.rows, rows(0, 8))
    assert np.shares_memory(full.rows, chunk)
    chunk = rows(9, 13)
    full = buf.append("r", 9, chunk)  # block 2 joins the buffered row 8: a fresh array
    np.testing.assert_array_equal(full.rows, rows(8, 12))
    assert not np.shares_memory(full.rows, chunk)
    chunk = rows(6, 14)  # a hit that ends inside block 1, which can never be complete
    full = buf.append("s", 6, chunk)
    assert (full.first_block, full.num_blocks) == (2, 1)
    np.testing.assert_array_equal(full.rows, rows(8, 12))
    assert np.shares_memory(full.rows, chunk)


def test_prefix_hit_start_and_aligned_tail() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    full = buf.append("r", 8, rows(8, 16))  # blocks 0-1 came from the prefix cache
    assert (full.first_block, full.num_blocks) == (2, 2)
    tail = buf.take_tail("r")
    assert tail.token_start == 16 and len(tail.rows) == 0


def test_recompute_replaces_overlap_and_ignores_published_rows() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    assert buf.append("r", 0, rows(0, 6, version=1)).num_blocks == 1  # tokens 0-3 published
    assert buf.append("r", 0, rows(0, 7, version=2)).num_blocks == 0  # recomputed from 0
    assert buf.end("r") == 7
    assert buf.append("r", 1, rows(1, 3, version=3)).num_blocks == 0  # all below the floor
    assert buf.end("r") == 7
    tail = buf.take_tail("r")
    assert tail.token_start == 4
    np.testing.assert_array_equal(tail.rows, rows(4, 7, version=2))


def test_recompute_shortens() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 3))
    buf.append("r", 1, rows(1, 2, version=1))  # replaces everything from token 1 on
    assert buf.end("r") == 2
    full = buf.append("r", 2, rows(2, 5, version=2))
    np.testing.assert_array_equal(
        full.rows, np.concatenate([rows(0, 1), rows(1, 2, 1), rows(2, 4, 2)])
    )
    np.testing.assert_array_equal(buf.take_tail("r").rows, rows(4, 5, 2))


def test_gap_rejected() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    buf.append("r", 0, rows(0, 2))
    with pytest.raises(RowGapError, match="lost"):
        buf.append("r", 3, rows(3, 4))
    assert buf.end("r") == 2  # unchanged


def test_partial_hit_mid_block() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    full = buf.append("r", 6, rows(6, 13))  # block 1 (tokens 4-7) was partly an external hit
    assert (full.first_block, full.num_blocks) == (2, 1)  # rows 6-7 cannot form block 1
    np.testing.assert_array_equal(full.rows, rows(8, 12))
    np.testing.assert_array_equal(buf.take_tail("r").rows, rows(12, 13))
    buf.append("q", 6, rows(6, 7))
    with pytest.raises(RowGapError, match="partial cache hit"):
        buf.take_tail("q")
    assert "q" not in buf
    buf.append("p", 6, rows(6, 7))
    assert buf.append("p", 7, rows(7, 9)).num_blocks == 0  # crosses into block 2
    tail = buf.take_tail("p")
    assert tail.token_start == 8
    np.testing.assert_array_equal(tail.rows, rows(8, 9))


def test_unknown_ids() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    with pytest.raises(UnknownRequestError):
        buf.take_tail("nope")
    with pytest.raises(UnknownRequestError):
        buf.end("nope")
    buf.drop("nope")  # ignored
    buf.slot("opened")  # a slot without rows has an empty tail
    assert buf.end("opened") == -1
    assert len(buf.take_tail("opened").rows) == 0


def test_memory_bound_one_block_per_request() -> None:
    buf = RequestRowBuffer(LAYOUT, max_bytes=40 * LAYOUT.block_nbytes)
    for i in range(40):
        assert buf.append(f"r{i}", 0, rows(0, 198)).num_blocks == 49  # 2 rows stay
    assert buf.nbytes == buf.max_bytes
    with pytest.raises(BufferCapacityError, match="buffer is full"):
        buf.append("b", 0, rows(0, 3))
    assert "b" not in buf  # state unchanged by the failed append
    buf.drop("r0")
    buf.append("b", 0, rows(0, 3))  # the freed slot is reused
    assert buf.nbytes == buf.max_bytes
    np.testing.assert_array_equal(buf.take_tail("r1").rows, rows(196, 198))
    np.testing.assert_array_equal(buf.take_tail("b").rows, rows(0, 3))


def test_append_one_each_matches_append() -> None:
    """The vectorized decode write equals one append per request, completed blocks included."""
    batch = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    single = RequestRowBuffer(LAYOUT, max_bytes=1 << 16)
    starts = {"a": 0, "b": 6, "c": 2, "d": 9}  # "b" began mid-block: block 1 never completes
    for rid, start in starts.items():
        batch.append(rid, start, rows(start, start + 1))
        single.append(rid, start, rows(start, start + 1))
    ends = dict.fromkeys(starts, 0) | {rid: s + 1 for rid, s in starts.items()}
    got: dict[tuple[str, int], np.ndarray] = {}
    want: dict[tuple[str, int], np.ndarray] = {}
    for step in range(9):
        ids = list(starts)[: 4 - step % 2]  # not every request decodes every step
        slots = np.array([batch.slot(rid) for rid in ids])
        tokens = np.array([ends[rid] for rid in ids])
        step_rows = np.concatenate([rows(t, t + 1, step) for t in tokens])
        done = batch.append_one_each(slots, tokens, step_rows)
        for i, index, block in zip(done.positions, done.block_indices, done.rows, strict=True):
            got[ids[i], int(index)] = block
        for rid, t, row in zip(ids, tokens, step_rows, strict=True):
            full = single.append(rid, int(t), row[None])
            for b in range(full.num_blocks):
                want[rid, full.first_block + b] = full.block(b, BS)
            ends[rid] = int(t) + 1
    assert got.keys() == want.keys() and ("b", 1) not in got and ("b", 2) in got
    for key, block in want.items():
        np.testing.assert_array_equal(got[key], block)
    for rid in starts:
        tail_b, tail_s = batch.take_tail(rid), single.take_tail(rid)
        assert tail_b.token_start == tail_s.token_start
        np.testing.assert_array_equal(tail_b.rows, tail_s.rows)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_matches_reference_model(data: st.DataObject) -> None:
    """Random appends (with overlap) equal a simple model: an append at ``lo`` replaces
    everything from ``lo`` on, except tokens already handed out as full blocks; the hand-outs
    and the tail tile the request exactly."""
    buf = RequestRowBuffer(LAYOUT, max_bytes=1 << 20)
    start = data.draw(st.integers(0, 5)) * BS
    model: dict[int, np.ndarray] = {}  # token -> newest unpublished row
    published: dict[int, np.ndarray] = {}
    floor = end = start
    buf.append("r", start, rows(start, start))  # a request with no rows yet
    for version in range(data.draw(st.integers(1, 15))):
        lo = data.draw(st.integers(max(0, floor - 6), end))
        n = data.draw(st.integers(0, 9))
        full = buf.append("r", lo, rows(lo, lo + n, version))
        if n and lo + n > floor:
            model = {t: r for t, r in model.items() if t < lo}
            for t in range(max(lo, floor), lo + n):
                model[t] = rows(t, t + 1, version)[0]
            end = lo + n
        assert full.first_block * BS == floor
        assert full.num_blocks == end // BS - floor // BS
        for i in range(full.num_blocks * BS):
            np.testing.assert_array_equal(full.rows[i], model.pop(floor + i))
            published[floor + i] = full.rows[i]
        floor += full.num_blocks * BS
        assert buf.end("r") == end
    tail = buf.take_tail("r")
    assert len(tail.rows) == len(model) < BS
    for i, row in enumerate(tail.rows):
        np.testing.assert_array_equal(row, model[tail.token_start + i])
        published[tail.token_start + i] = row
    assert sorted(published) == list(range(start, end))
    assert buf.nbytes == 0


@pytest.mark.parametrize("num_blocks", [1, 16, 248])
def test_copy_blocks_copies_and_keeps_the_gil(num_blocks: int) -> None:
    """A plain copy of 64 DeepSeek-V3-sized blocks released the GIL; as block items, up to
    248 blocks (what a store read keeps it for) do not."""
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
    rows = np.random.default_rng(num_blocks).integers(
        0, 256, (num_blocks * 16, *layout.row_shape), dtype=np.uint8
    )
    out = layout.empty(len(rows))
    with gil_releases() as count:
        before = count[0]
        for _ in range(100):
            copy_blocks(out, rows, 16)
        releases = count[0] - before
    np.testing.assert_array_equal(out, rows)
    assert releases == 0
    with pytest.raises(ValueError, match="blocks of 16"):
        copy_blocks(out[:-1], rows[:-1], 16)
    strided = layout.empty(2 * len(rows))[::2]  # not contiguous: a plain copy, still right
    copy_blocks(strided, rows, 16)
    np.testing.assert_array_equal(strided, rows)


@pytest.mark.parametrize("num_rows", [1, 256, 500, 501, 2049, 8192])
def test_copy_rows_copies_a_step_and_keeps_the_gil(num_rows: int) -> None:
    """The worker copies a GPU step's rows out of pinned memory on the step thread: a
    256-request decode step or an 8,192-token prefill step, a copy that keeps the GIL where
    ``np.array`` releases it (more than 500 items)."""
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
    rows = np.random.default_rng(3).integers(0, 256, (num_rows, *layout.row_shape), dtype=np.uint8)
    # (The spinner catches a release only if it takes the GIL within it: a plain copy's short
    # release is caught when the machine is idle, so only the absence is asserted.)
    with gil_releases() as count:
        before = count[0]
        for _ in range(100):
            copied = copy_rows(rows)
        releases = count[0] - before
    assert releases == 0
    np.testing.assert_array_equal(copied, rows)
    assert not np.shares_memory(copied, rows)


@pytest.mark.parametrize("sizes", [[513], [1536, 513], [8192, 1], [499, 2, 1000]])
def test_copy_rows_into_and_join_rows_keep_the_gil(sizes: list[int]) -> None:
    """Copies into part of a row array (a prompt's rows joined after its prefix hit) and
    joins of parts, of any size, keep the GIL; a copy into a strided target is still right."""
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
    rng = np.random.default_rng(sum(sizes))
    parts = [rng.integers(0, 256, (n, *layout.row_shape), dtype=np.uint8) for n in sizes]
    out = layout.empty(sum(sizes) + 7)
    with gil_releases() as count:
        before = count[0]
        for _ in range(20):
            at = 7
            for part in parts:
                copy_rows_into(out[at : at + len(part)], part)
                at += len(part)
            joined = join_rows(parts)
        releases = count[0] - before
    assert releases == 0
    np.testing.assert_array_equal(out[7:], np.concatenate(parts))
    np.testing.assert_array_equal(joined, np.concatenate(parts))
    strided = layout.empty(2 * sizes[0])[::2]
    copy_rows_into(strided, parts[0])
    np.testing.assert_array_equal(strided, parts[0])
    with pytest.raises(ValueError, match="into"):
        copy_rows_into(out[:1], parts[0][:2])
