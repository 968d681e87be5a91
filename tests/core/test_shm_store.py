"""ShmStore in one process: round trips, collisions, pins, capacity, corruption,
recovery, read-only and closed handles."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_artifact.core.store.shm_read as shm_read
from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.envelope import HEADER_NBYTES
from vllm_artifact.core.store import ObjectStore, ScrubReport, ShmStore, check_shm_space
from vllm_artifact.core.store.shm_arena import ARENA_NAME
from vllm_artifact.errors import (
    CapacityError,
    KeyCollisionError,
    ObjectCorruptError,
    ObjectMissingError,
    SchemaError,
    ShmSpaceError,
    StoreClosedError,
    StoreFormatError,
    StoreNotFoundError,
    StoreReadOnlyError,
)

from .conftest import key_for, open_writer, rows_for


def test_round_trip_get_exists_read_into(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    with open_writer(shm_root, layout) as store:
        assert isinstance(store, ObjectStore)
        keys = [key_for(namespace, i) for i in range(5)]
        data = [rows_for(layout, i) for i in range(4)] + [rows_for(layout, 4, 3)]
        store.put([(k, d, 16 * i) for i, (k, d) in enumerate(zip(keys, data, strict=True))])
        assert store.exists([*keys, key_for(namespace, 99)]) == [True] * 5 + [False]
        for got, want in zip(store.get(keys), data, strict=True):
            np.testing.assert_array_equal(got, want)
        out = layout.empty(67)
        store.read_into(keys, out)
        np.testing.assert_array_equal(out, np.concatenate(data))
        part = layout.empty(32)
        store.read_into(keys[2:4], part, token_start=32)
        np.testing.assert_array_equal(part, np.concatenate(data[2:4]))
        env = store.envelope_of(keys[4])
        assert env is not None and int(env["n_tokens"]) == 3 and int(env["token_start"]) == 64
        stats = store.stats()
        assert (stats.objects, stats.pinned_objects, stats.writable) == (5, 5, True)


@pytest.mark.parametrize("n_blocks", [3, 500, 501])
def test_whole_block_reads_of_every_size_copy_the_right_slots(
    shm_root: str, layout: R3Layout, namespace: Namespace, n_blocks: int
) -> None:
    """Reads of up to 500 whole blocks copy by slot items (the GIL stays held), larger ones
    with one ``np.take``: both give each block's rows, in key order, with a tail after them."""
    with open_writer(shm_root, layout, slots=2 * n_blocks + 2) as store:
        keys = [key_for(namespace, i) for i in range(n_blocks + 1)]
        data = rows_for(layout, n_blocks, n_blocks * 16 + 5)
        # Published last block first, so the slots run against the key order.
        store.put([(keys[i], data[16 * i : 16 * i + 16], 16 * i) for i in range(n_blocks)][::-1])
        store.put([(keys[-1], data[-5:], 16 * n_blocks)])
        out = layout.empty(len(data))
        store.read_into(keys, out)
        np.testing.assert_array_equal(out, data)


def test_put_blocks_fast_path_with_tail(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    with open_writer(shm_root, layout) as store:
        keys = [key_for(namespace, i) for i in range(4)]
        data = np.concatenate([rows_for(layout, i) for i in range(3)] + [rows_for(layout, 9, 5)])
        store.put_blocks(keys, data, 32)
        out = layout.empty(len(data))
        store.read_into(keys, out, token_start=32)
        np.testing.assert_array_equal(out, data)
        store.put_blocks(keys, data, 32)  # identical republish is accepted
        with pytest.raises(SchemaError, match="fill"):
            store.put_blocks(keys, data[:40], 32)
        with pytest.raises(SchemaError, match="boundary"):
            store.put_blocks(keys, data, 5)


@pytest.mark.parametrize("path", ["ShmStore.put_runs", "ObjectStore.put_runs"])
def test_put_runs_publish_every_block_of_every_run(
    shm_root: str, layout: R3Layout, namespace: Namespace, path: str
) -> None:
    """Several requests' runs in one batch (the fast path and the contract's default, which
    goes through ``put``): each block under its key and token range, tails included; a key
    repeated with the same content is one object; a bad run publishes nothing."""
    put_runs = ShmStore.put_runs if path == "ShmStore.put_runs" else ObjectStore.put_runs
    with open_writer(shm_root, layout) as store:
        a = [key_for(namespace, i) for i in range(3)]
        b = [key_for(namespace, 10 + i) for i in range(2)]
        rows_a = rows_for(layout, 1, 40)  # 2 full blocks + an 8-token tail, from token 32
        rows_b = rows_for(layout, 2, 32)[:, :, ::-1]  # not C-contiguous
        rows_a2 = rows_a[16:32]  # block a[1] again, same content, in another run
        put_runs(store, [(a, rows_a, 32), (b, rows_b, 0), ([a[1]], rows_a2, 48), ([], rows_a, 0)])
        out = layout.empty(40)
        store.read_into(a, out, token_start=32)
        np.testing.assert_array_equal(out, rows_a)
        np.testing.assert_array_equal(np.concatenate(store.get(b)), rows_b)
        env = store.envelope_of(a[2])
        assert env is not None and (int(env["token_start"]), int(env["n_tokens"])) == (64, 8)
        assert (store.stats().objects, store.stats().pinned_objects) == (5, 5)
        c = [key_for(namespace, 20 + i) for i in range(2)]
        with pytest.raises(SchemaError, match=r"boundary|multiple of 16"):
            put_runs(store, [(c, rows_for(layout, 3, 32), 0), (b, rows_b, 5)])
        assert store.exists(c) == [False, False]
        other = rows_a.copy()
        other[20, 0, 0] ^= 1
        with pytest.raises(KeyCollisionError):
            put_runs(store, [(c[:1], rows_for(layout, 3), 0), (a, other, 32)])


@pytest.mark.parametrize("path", ["ShmStore.put_runs", "ObjectStore.put_runs"])
def test_put_runs_of_several_runs_without_repeats_publish_each_object_whole(
    shm_root: str, layout: R3Layout, namespace: Namespace, path: str
) -> None:
    """A prefill step's batch: runs of several requests, none repeated, a run's short tail in
    the middle of the batch (each object's payload cut from its own run); a second batch
    republishing some of them around a new run."""
    put_runs = ShmStore.put_runs if path == "ShmStore.put_runs" else ObjectStore.put_runs
    with open_writer(shm_root, layout) as store:
        a = [key_for(namespace, i) for i in range(3)]
        b = [key_for(namespace, 10 + i) for i in range(4)]
        c = [key_for(namespace, 20 + i) for i in range(2)]
        rows_a = rows_for(layout, 1, 40)  # 2 full blocks + an 8-token tail, from token 0
        rows_b = rows_for(layout, 2, 64)  # 4 full blocks, from token 16
        rows_c = rows_for(layout, 3, 20)  # 1 full block + a 4-token tail, from token 32
        put_runs(store, [(a, rows_a, 0), (b, rows_b, 16), (c, rows_c, 32)])
        for keys, rows, start in ((a, rows_a, 0), (b, rows_b, 16), (c, rows_c, 32)):
            out = layout.empty(len(rows))
            store.read_into(keys, out, token_start=start)
            np.testing.assert_array_equal(out, rows)
        env = store.envelope_of(a[2])
        assert env is not None and (int(env["token_start"]), int(env["n_tokens"])) == (32, 8)
        env = store.envelope_of(b[3])
        assert env is not None and (int(env["token_start"]), int(env["n_tokens"])) == (64, 16)
        d = [key_for(namespace, 30 + i) for i in range(3)]
        rows_d = rows_for(layout, 4, 48)
        # b and c's first block republished (kept) around d's new run, the batch's second
        put_runs(store, [(b, rows_b.copy(), 16), (d, rows_d, 0), (c[:1], rows_c[:16], 32)])
        out = layout.empty(48)
        store.read_into(d, out, token_start=0)
        np.testing.assert_array_equal(out, rows_d)
        np.testing.assert_array_equal(np.concatenate(store.get(b)), rows_b)
        assert store.stats().objects == 12


def test_uint16_layout_round_trip(shm_root: str, namespace: Namespace) -> None:
    wide = R3Layout(num_layers=4, top_k=4, num_experts=300, block_size=32, dense_layers=(1,))
    with open_writer(shm_root, wide) as store:
        data = rows_for(wide, 1)
        assert data.dtype == np.uint16 and int(data.max()) > 255
        key = key_for(namespace, 1)
        store.put([(key, data, 0)])
        np.testing.assert_array_equal(store.get([key])[0], data)


def test_identical_republish_ok_different_content_collides(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    with open_writer(shm_root, layout) as store:
        key = key_for(namespace, 1)
        data = rows_for(layout, 1)
        store.put([(key, data, 16)])
        store.put([(key, data.copy(), 16)])
        other = data.copy()
        other[3, 1, 0] ^= 1
        with pytest.raises(KeyCollisionError, match="different content"):
            store.put([(key, other, 16)])
        with pytest.raises(KeyCollisionError):
            store.put([(key, data, 32)])  # same rows, other token range
        with pytest.raises(KeyCollisionError, match="twice in one batch"):
            k2 = key_for(namespace, 2)
            store.put([(k2, data, 0), (k2, other, 0)])
        store.put([(key_for(namespace, 3), data, 0)] * 2)  # repeated identical: fine
        np.testing.assert_array_equal(store.get([key])[0], data)
        assert store.exists([key_for(namespace, 2)]) == [False]


def test_put_validation(shm_root: str, layout: R3Layout, namespace: Namespace) -> None:
    with open_writer(shm_root, layout) as store:
        key = key_for(namespace, 1)
        with pytest.raises(SchemaError):
            store.put([(key, rows_for(layout, 1).astype(np.uint16), 0)])
        with pytest.raises(SchemaError):
            store.put([(key, layout.empty(17), 0)])
        with pytest.raises(SchemaError):
            store.put([(key, layout.empty(0), 0)])
        with pytest.raises(SchemaError):
            store.put([(key, layout.empty(4), 3)])
        with pytest.raises(SchemaError):
            store.read_into([key], np.empty((16, 6, 4), dtype=np.uint16))
        assert store.stats().objects == 0


def test_eviction_skips_pinned_and_capacity_error(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    with open_writer(shm_root, layout, slots=8) as store:
        n = store.geometry.slot_count
        assert n >= 8
        pinned = [key_for(namespace, i) for i in range(n - 2)]
        store.put([(k, rows_for(layout, i), 0) for i, k in enumerate(pinned)], pin=True)
        for i in range(100, 140):  # far more unpinned objects than free slots
            store.put([(key_for(namespace, i), rows_for(layout, i), 0)], pin=False)
        assert store.exists(pinned) == [True] * len(pinned)
        assert store.stats().evictions == 38  # 40 puts into 2 unpinned slots
        assert store.exists([key_for(namespace, 139)]) == [True]
        with pytest.raises(ObjectMissingError, match="Increase --artifact-capacity"):
            store.get([key_for(namespace, 100)])
        # Three new blocks cannot fit beside the pinned ones.
        with pytest.raises(CapacityError, match="pinned"):
            store.put([(key_for(namespace, 200 + i), rows_for(layout, i), 0) for i in range(3)])
        assert store.unpin(pinned[:2]) == [True, True]
        assert store.unpin([pinned[0], key_for(namespace, 999)]) == [False, False]
        store.put([(key_for(namespace, 200 + i), rows_for(layout, i), 0) for i in range(3)])
        assert store.exists(pinned[2:]) == [True] * (n - 4)
        assert store.pin([pinned[2], key_for(namespace, 998)]) == [True, False]
        assert store.stats().pinned_objects == n - 4 + 3


def test_refcounted_pins(shm_root: str, layout: R3Layout, namespace: Namespace) -> None:
    with open_writer(shm_root, layout, slots=2) as store:
        n = store.geometry.slot_count

        def churn(base: int) -> None:  # more unpinned puts than the store has slots
            for i in range(base, base + 2 * n):
                store.put([(key_for(namespace, i), rows_for(layout, i), 0)], pin=False)

        a = key_for(namespace, 1)
        store.put([(a, rows_for(layout, 1), 0)])
        store.put([(a, rows_for(layout, 1), 0)])  # second reference
        store.unpin([a])
        churn(100)
        assert store.exists([a]) == [True]  # still one pin
        store.unpin([a])
        churn(200)
        assert store.exists([a]) == [False]


def _flip(root: str, offset: int) -> None:
    fd = os.open(f"{root}/s/{ARENA_NAME}", os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("where", "error"),
    [
        ("payload", ObjectCorruptError),
        ("token_start", ObjectCorruptError),
        ("checksum", ObjectCorruptError),
        ("n_tokens", ObjectCorruptError),
        ("key", ObjectMissingError),
    ],
)
def test_flipped_byte_is_detected(
    shm_root: str, layout: R3Layout, namespace: Namespace, where: str, error: type[Exception]
) -> None:
    with open_writer(shm_root, layout) as store:
        keys = [key_for(namespace, i) for i in range(3)]
        store.put([(k, rows_for(layout, i), 16 * i) for i, k in enumerate(keys)])
        g = store.geometry
        slot = 1  # keys[1] went to the second slot of an empty store
        hdr = g.headers_offset + slot * HEADER_NBYTES
        offsets = {
            "payload": g.payload_offset + slot * g.slot_nbytes + 100,
            "key": hdr + 8 + 3,
            "token_start": hdr + 24 + 1,
            "checksum": hdr + 32 + 5,
            "n_tokens": hdr + 40,
        }
        reader = ShmStore.open_reader(shm_root, "s")
        np.testing.assert_array_equal(reader.get([keys[1]])[0], rows_for(layout, 1))
        assert reader.scrub() == ScrubReport(checked=3, corrupt=())
        _flip(shm_root, offsets[where])
        for handle in (store, reader):
            with pytest.raises(error):
                handle.read_into(keys, layout.empty(48))
            np.testing.assert_array_equal(handle.get([keys[2]])[0], rows_for(layout, 2))
            # A scrub reads every object back: the damaged one is reported (under the key
            # its slot now carries) or, if it no longer locates at all, not counted.
            report = handle.scrub()
            assert report.checked == 2 and len(report.corrupt) <= 1
            if where == "payload":
                assert report.corrupt == (keys[1],)
        reader.close()
        if error is ObjectCorruptError:
            # Republishing the block replaces a corrupt object.
            store.put([(keys[1], rows_for(layout, 1), 16)])
            np.testing.assert_array_equal(store.get([keys[1]])[0], rows_for(layout, 1))


def test_reader_is_read_only_and_closed_handles_fail(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    store = open_writer(shm_root, layout)
    key = key_for(namespace, 1)
    store.put([(key, rows_for(layout, 1), 0)])
    reader = ShmStore.open_reader(shm_root, "s")
    assert reader.layout == layout and not reader.stats().writable
    assert reader.stats().objects == 1
    for call in (
        lambda: reader.put([(key, rows_for(layout, 1), 0)]),
        lambda: reader.pin([key]),
        lambda: reader.unpin([key]),
    ):
        with pytest.raises(StoreReadOnlyError):
            call()
    store.close()
    store.close()  # idempotent
    np.testing.assert_array_equal(reader.get([key])[0], rows_for(layout, 1))  # outlives writer
    with pytest.raises(StoreClosedError):
        store.get([key])
    reader.close()
    with pytest.raises(StoreClosedError):
        reader.exists([key])
    with pytest.raises(StoreNotFoundError):
        ShmStore.open_reader(shm_root, "nope")


def test_reopen_recovers_objects_and_drops_half_written(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    store = open_writer(shm_root, layout)
    keys = [key_for(namespace, i) for i in range(4)]
    store.put([(k, rows_for(layout, i), 0) for i, k in enumerate(keys)])
    # Simulate a writer killed mid-publish: slot 2 odd (being written), payload torn.
    arena = store._live()
    arena.seq[2] += 1
    arena.payload[2 * layout.block_nbytes : 2 * layout.block_nbytes + 10] = b"\xff" * 10
    reader = ShmStore.open_reader(shm_root, "s")
    with pytest.raises(ObjectMissingError):
        reader.get([keys[2]])
    store._lock.release()  # type: ignore[union-attr]  # "crash": lock gone, no clean close
    again = open_writer(shm_root, layout)
    assert again.recovery is not None
    assert (again.recovery.recreated, again.recovery.objects, again.recovery.dropped_partial) == (
        False,
        3,
        1,
    )
    assert again.exists(keys) == [True, True, False, True]
    again.put([(keys[2], rows_for(layout, 2), 0)])
    np.testing.assert_array_equal(reader.get([keys[2]])[0], rows_for(layout, 2))
    for i, got in enumerate(again.get(keys)):
        np.testing.assert_array_equal(got, rows_for(layout, i))
    reader.close()
    again.close()
    store.close()


def test_reopen_with_other_geometry_recreates(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    with open_writer(shm_root, layout) as store:
        store.put([(key_for(namespace, 1), rows_for(layout, 1), 0)])
    with open_writer(shm_root, layout, slots=32) as store:
        assert store.recovery is not None and store.recovery.recreated
        assert store.exists([key_for(namespace, 1)]) == [False]
    # A garbage arena is replaced by the writer and refused by readers.
    with open(f"{shm_root}/s/{ARENA_NAME}", "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(StoreFormatError):
        ShmStore.open_reader(shm_root, "s")
    with open_writer(shm_root, layout, slots=32) as store:
        assert store.recovery is not None and "unreadable" in store.recovery.reason


def test_shm_space_check_names_the_fix(shm_root: str) -> None:
    check_shm_space(shm_root, 1 << 20)
    with pytest.raises(ShmSpaceError, match=r"--shm-size.*--ipc=host.*--artifact-capacity"):
        check_shm_space(shm_root, 1 << 60)


def test_capacity_must_hold_one_block(shm_root: str, layout: R3Layout) -> None:
    with pytest.raises(SchemaError, match="artifact-capacity"):
        ShmStore.create_or_open_writer(shm_root, "s", layout=layout, capacity_bytes=1000)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 16)),
        min_size=1,
        max_size=12,
        unique_by=lambda t: t[0],
    )
)
def test_property_round_trip(
    shm_root: str, layout: R3Layout, namespace: Namespace, objs: list[tuple[int, int]]
) -> None:
    """Any set of objects (full or partial) reads back exactly, in any order."""
    name = f"p{abs(hash(tuple(objs))) % 10**9}"
    with ShmStore.create_or_open_writer(
        shm_root, name, layout=layout, capacity_bytes=1 << 20
    ) as store:
        items = [(key_for(namespace, i), rows_for(layout, i, n), 16 * i) for i, n in objs]
        store.put(items, pin=False)
        got = store.get([k for k, _, _ in reversed(items)])
        for (_, want, _), arr in zip(reversed(items), got, strict=True):
            np.testing.assert_array_equal(arr, want)


def test_fragmented_reads_and_put_blocks_republish(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    """A request whose objects sit in many separate slot runs (interleaved
    publishes, eviction) reads back exactly; put_blocks handles keys that
    already exist and keys repeated within the batch."""
    with open_writer(shm_root, layout, slots=40) as store:
        n = 12
        keys = [key_for(namespace, i) for i in range(n)]
        data = np.concatenate(
            [rows_for(layout, i) for i in range(n - 1)] + [rows_for(layout, 50, 7)]
        )
        bs = layout.block_size
        for i in range(0, n, 3):  # 3 objects, then 2 unrelated ones, repeatedly
            store.put_blocks(keys[i : i + 3], data[i * bs : (i + 3) * bs], i * bs, pin=True)
            junk = [key_for(namespace, 1000 + 10 * i + j) for j in range(2)]
            store.put_blocks(junk, data[: 2 * bs], 0, pin=False)
        for i in range(30):  # force eviction of the unpinned junk, reusing its slots
            store.put([(key_for(namespace, 2000 + i), rows_for(layout, i), 0)], pin=False)
        assert store.stats().evictions > 0
        out = layout.empty(len(data))
        store.read_into(keys, out)
        np.testing.assert_array_equal(out, data)
        np.testing.assert_array_equal(np.concatenate(store.get(keys)), data)
        part = layout.empty(5 * bs)
        store.read_into(keys[4:9], part, token_start=4 * bs)
        np.testing.assert_array_equal(part, data[4 * bs : 9 * bs])
        # Republish: some keys exist, one is new; a key repeated within put_blocks
        # is at two token ranges, so it collides.
        more = [*keys[:4], key_for(namespace, 77)]
        rows = np.concatenate([data[: 4 * bs], rows_for(layout, 77)])
        store.put_blocks(more, rows, 0)
        np.testing.assert_array_equal(store.get([more[4]])[0], rows_for(layout, 77))
        with pytest.raises(KeyCollisionError, match="twice in one batch"):
            store.put_blocks([*more, more[4]], np.concatenate([rows, rows_for(layout, 77)]), 0)
        with pytest.raises(KeyCollisionError, match="different content"):
            store.put_blocks(keys[:2], data[bs : 3 * bs], 0)
        with pytest.raises(ObjectCorruptError):  # wrong order: token ranges do not tile
            store.read_into([keys[1], keys[0]], layout.empty(2 * bs))


def test_reopen_drops_duplicate_keys(shm_root: str, layout: R3Layout, namespace: Namespace) -> None:
    store = open_writer(shm_root, layout)
    keys = [key_for(namespace, i) for i in range(3)]
    store.put([(k, rows_for(layout, i), 0) for i, k in enumerate(keys)])
    arena = store._live()
    bn = layout.block_nbytes
    # A stray copy of slot 1's object in slot 5 (as if left by an interrupted replace).
    arena.headers[5] = arena.headers[1]
    arena.payload[5 * bn : 6 * bn] = arena.payload[bn : 2 * bn]
    store._lock.release()  # type: ignore[union-attr]  # "crash"
    again = open_writer(shm_root, layout)
    assert again.recovery is not None
    assert (again.recovery.objects, again.recovery.dropped_invalid) == (3, 1)
    assert again.envelope_of(keys[1]) is not None
    for i, got in enumerate(again.get(keys)):
        np.testing.assert_array_equal(got, rows_for(layout, i))
    assert again.stats().objects == 3
    again.close()
    store.close()


def test_reads_in_the_writing_process_do_not_wait_for_its_publisher(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    """Reads take no mutex: while another thread publishes (evicting and reusing slots),
    pinned objects read back exactly and evicted ones fail as missing, never as wrong rows."""
    with open_writer(shm_root, layout, slots=64) as store:
        pinned = [key_for(namespace, i) for i in range(16)]
        bs = layout.block_size
        store.put([(k, rows_for(layout, i), i * bs) for i, k in enumerate(pinned)], pin=True)
        stop = threading.Event()

        def publish() -> None:
            i = 1000
            while not stop.is_set():
                store.put([(key_for(namespace, i), rows_for(layout, i), 0)], pin=False)
                i += 1

        writer = threading.Thread(target=publish)
        writer.start()
        try:
            # The churn has begun (key 1000, the oldest, is evicted first) before reads race it.
            deadline = time.monotonic() + 30
            while store.stats().evictions == 0:
                assert time.monotonic() < deadline, "the publishing thread evicted nothing"
                time.sleep(0.001)
            out = layout.empty(len(pinned) * bs)
            want = np.concatenate([rows_for(layout, i) for i in range(len(pinned))])
            churned = 0
            for round_ in range(200):
                store.read_into(pinned, out)
                np.testing.assert_array_equal(out, want)
                key = key_for(namespace, 1000 + round_)
                try:
                    (got,) = store.get([key])
                except ObjectMissingError:
                    churned += 1  # evicted by the churn: fails closed
                else:
                    np.testing.assert_array_equal(got, rows_for(layout, 1000 + round_))
        finally:
            stop.set()
            writer.join()
        assert store.stats().evictions > 0 and churned > 0


@pytest.mark.parametrize("write_lands", [True, False])
def test_a_checksum_mismatch_is_retried_once_then_corrupt(
    shm_root: str,
    layout: R3Layout,
    namespace: Namespace,
    monkeypatch: pytest.MonkeyPatch,
    write_lands: bool,
) -> None:
    """docs/store.md: a checksum mismatch with an unchanged seq is retried once after 1 ms (a
    weakly ordered CPU may show a new header before its payload), then raised as corrupt.
    A payload byte is flipped before the read; with ``write_lands`` the right byte "arrives"
    right after the first verification saw the wrong one."""
    with open_writer(shm_root, layout) as store:
        keys = [key_for(namespace, i) for i in range(3)]
        rows = [rows_for(layout, i) for i in range(3)]
        store.put([(k, r, 16 * i) for i, (k, r) in enumerate(zip(keys, rows, strict=True))])
        g = store.geometry
        at = g.payload_offset + 1 * g.slot_nbytes + 100  # keys[1] is in slot 1
        _flip(shm_root, at)
        verify = shm_read.verify_copies
        seen: list[bool] = []
        sleeps: list[float] = []

        def observed(*args: object) -> object:
            bad = verify(*args)  # type: ignore[arg-type]
            seen.append(bad is None)
            if len(seen) == 1 and write_lands:
                _flip(shm_root, at)  # the late write lands
            return bad

        sleep = time.sleep
        monkeypatch.setattr(shm_read, "verify_copies", observed)
        monkeypatch.setattr(shm_read.time, "sleep", lambda s: (sleeps.append(s), sleep(s))[1])
        with ShmStore.open_reader(shm_root, "s") as reader:
            out = layout.empty(48)
            if write_lands:
                reader.read_into(keys, out)
                np.testing.assert_array_equal(out, np.concatenate(rows))
            else:
                with pytest.raises(ObjectCorruptError, match="checksum mismatch"):
                    reader.read_into(keys, out)
        assert seen == [False, write_lands]  # verified twice: retried exactly once
        assert sleeps == [0.001]
