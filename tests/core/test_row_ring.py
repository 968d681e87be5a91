"""The shared-memory ring between the engine and the tracker process: rows in, answers' bytes
out, seen by a second mapping of the same memory (as the tracker process maps it)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_ring import RowRing
from vllm_artifact.core.step_facts import HashRun


@pytest.fixture
def rings() -> tuple[RowRing, RowRing]:
    engine = RowRing.create(slots=3, slot_bytes=4096)
    process = RowRing(os.dup(engine.fd), engine.slots, engine.slot_bytes)
    yield engine, process
    process.close()
    engine.close()


def test_rows_written_by_one_side_are_read_by_the_other(rings: tuple[RowRing, RowRing]) -> None:
    engine, process = rings
    rows = np.random.default_rng(0).integers(0, 255, (20, 4, 8), dtype=np.uint8)
    engine.write(1, rows[::2])  # not contiguous: copied as rows
    engine.write(2, rows)
    np.testing.assert_array_equal(process.read(1, (10, 4, 8), np.uint8), rows[::2])
    np.testing.assert_array_equal(process.read(2, (20, 4, 8), np.uint8), rows)
    with pytest.raises(ValueError, match="do not fit"):
        engine.write(0, np.zeros((4097,), np.uint8))


def test_an_answers_buffers_come_back_as_copies_in_reused_memory(
    rings: tuple[RowRing, RowRing],
) -> None:
    engine, process = rings
    arrays = [np.arange(300, dtype=np.uint16), np.full((7, 3), 9, np.uint8)]
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(arrays, protocol=5, buffer_callback=buffers.append)
    spans = process.write_buffers(2, [buffer.raw() for buffer in buffers])
    assert spans is not None and spans[0][0] == 2 * 4096
    pool = RecycledArrays(min_bytes=0)
    copies = engine.copy_out(spans, pool)
    back = pickle.loads(data, buffers=copies)
    for got, want in zip(back, arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    process.write_buffers(2, [memoryview(b"\0" * 600)])  # the slot is used again
    np.testing.assert_array_equal(back[0], arrays[0])  # the copy is the engine's own
    too_big = [memoryview(b"x" * 3000), memoryview(b"y" * 1100)]
    assert process.write_buffers(0, too_big) is None


def test_hash_runs_iterate_and_pickle_as_the_hashes_they_pack() -> None:
    hashes = [bytes([i]) * 32 for i in range(5)]
    run = HashRun(b"".join(hashes), 32)
    assert list(run) == hashes
    assert list(pickle.loads(pickle.dumps(run))) == hashes


def test_a_leased_slot_stays_leased_while_anything_made_from_its_arrays_lives() -> None:
    engine = RowRing.create(slots=2, slot_bytes=1000)  # rounded up to whole pages
    process = RowRing(os.dup(engine.fd), engine.slots, engine.slot_bytes)
    try:
        assert engine.slot_bytes % 4096 == 0
        sent = [np.arange(600, dtype=np.uint16)]
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(sent, protocol=5, buffer_callback=buffers.append)
        spans = process.write_buffers(1, [buffer.raw() for buffer in buffers])
        assert spans is not None
        assert not engine.leased(1)
        (got,) = pickle.loads(data, buffers=engine.lease(1, spans))
        np.testing.assert_array_equal(got, sent[0])
        assert engine.leased(1) and not engine.leased(0)
        derived = memoryview(got[10:20].reshape(2, 5))
        del got
        assert engine.leased(1)  # a memoryview of a slice of a reshape keeps it
        process.write_buffers(1, [memoryview(np.zeros(1200, np.uint8))])
        assert derived[0, 0] == 0  # read in place: the slot's memory, not a copy
        del derived
        assert not engine.leased(1)
        with pytest.raises(ValueError, match="not in slot 0"):
            engine.lease(0, spans)
    finally:
        process.close()
        engine.close()
