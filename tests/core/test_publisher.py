"""Publisher: ordered, durable after flush, and a collision loses only its block."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from vllm_artifact.core.keys import Namespace
from vllm_artifact.core.publisher import BlockRun, Lease, PinChange, Publisher
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import StoreError

from .conftest import key_for, rows_for


@pytest.fixture
def store(shm_root: str, layout: R3Layout) -> Iterator[ShmStore]:
    store = ShmStore.create_or_open_writer(
        shm_root, "s", layout=layout, capacity_bytes=128 * layout.block_nbytes
    )
    yield store
    store.close()


@pytest.fixture(params=[None, 1], ids=["thread", "inline"])
def publisher(store: ShmStore, request: pytest.FixtureRequest) -> Iterator[Publisher]:
    """Each test that takes it runs with every batch on the publishing thread, and with
    every batch of blocks written inline (pin changes alone too while the thread is idle)."""
    publisher = Publisher(store, inline_from_blocks=request.param)
    yield publisher
    publisher.close()


@pytest.fixture
def threaded(store: ShmStore) -> Iterator[Publisher]:
    publisher = Publisher(store)
    yield publisher
    publisher.close()


def test_flush_makes_submitted_blocks_readable(
    store: ShmStore, publisher: Publisher, layout: R3Layout, namespace: Namespace
) -> None:
    bs = layout.block_size
    keys = [key_for(namespace, i) for i in range(4)]
    rows = np.concatenate([rows_for(layout, i) for i in range(4)])
    publisher.submit([BlockRun(keys, rows, 0)])
    publisher.flush()
    out = layout.empty(4 * bs)
    store.read_into(keys, out)
    np.testing.assert_array_equal(out, rows)
    assert publisher.published_objects == 4 and publisher.failures == 0


def test_collision_keeps_first_object_and_publishes_the_rest(
    store: ShmStore, publisher: Publisher, layout: R3Layout, namespace: Namespace
) -> None:
    keys = [key_for(namespace, i) for i in range(3)]
    store.put([(keys[0], rows_for(layout, 0), 0)], pin=False)
    different = np.concatenate([rows_for(layout, 9), rows_for(layout, 1), rows_for(layout, 2)])
    publisher.submit([BlockRun(keys, different, 0)])
    publisher.flush()
    assert publisher.collisions == 1
    first, second, third = store.get(keys)
    np.testing.assert_array_equal(first, rows_for(layout, 0))
    np.testing.assert_array_equal(second, rows_for(layout, 1))
    np.testing.assert_array_equal(third, rows_for(layout, 2))


def test_pins_follow_the_pin_change_exactly(
    store: ShmStore, publisher: Publisher, layout: R3Layout, namespace: Namespace
) -> None:
    """A step's blocks and a pin on each of them go to the store as one pinned put; a pin
    change naming only some blocks, or a collided block, pins exactly those keys once."""
    bs = layout.block_size
    keys = [key_for(namespace, i) for i in range(9)]

    def run(first: int, count: int, *, rows_seed: int | None = None) -> BlockRun:
        rows = [rows_for(layout, rows_seed or i) for i in range(first, first + count)]
        return BlockRun(keys[first : first + count], np.concatenate(rows), first * bs)

    store.put([(keys[6], rows_for(layout, 6), 6 * bs)], pin=False)
    publisher.submit([run(0, 2), run(2, 2), PinChange(keys[:4], pin=True)])
    publisher.submit([run(4, 2), PinChange([keys[4]], pin=True)])
    # Key 6 collides, and key 7 comes twice (two requests completed the same block).
    publisher.submit(
        [run(6, 3, rows_seed=99), run(7, 1, rows_seed=99), PinChange(keys[6:9], pin=True)]
    )
    publisher.flush()
    assert publisher.collisions == 1 and publisher.failures == 0
    assert store.stats().pinned_objects == 8
    assert store.unpin(keys) == [True] * 5 + [False] + [True] * 3
    assert store.unpin(keys) == [False] * 9  # each key was pinned once


class _StalledStore:
    """A store whose publications hang until released (a stalled /dev/shm, a stuck page)."""

    def __init__(self, store: ShmStore) -> None:
        self._store = store
        self.release = threading.Event()
        self.layout = store.layout

    def put_blocks(self, *args: Any, **kwargs: Any) -> None:
        self.release.wait()
        self._store.put_blocks(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _in_thread(call: Any, bound: float = 10.0) -> Any:
    """``call()`` in a thread; fails the test if it has not returned within ``bound``."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(_outcome(call)), daemon=True)
    worker.start()
    worker.join(bound)
    assert result, f"blocked for more than {bound} s"
    return result[0]


def _wait_for(done: Callable[[], bool], what: str) -> None:
    """Poll ``done`` until it holds; fails the test after 10 s."""
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, f"not within 10 s: {what}"
        time.sleep(0.01)


def _outcome(call: Any) -> Any:
    try:
        return call()
    except Exception as error:  # the test inspects it
        return error


def test_a_stalled_store_never_blocks_the_step_thread_without_a_bound(
    store: ShmStore, layout: R3Layout, namespace: Namespace
) -> None:
    """The engine's step thread submits and flushes; with the publisher stuck in a store
    call, a full queue drops the submission after the bound and a flush fails after it
    (then at once), instead of hanging the engine."""
    stalled = _StalledStore(store)
    publisher = Publisher(stalled, max_pending_batches=1, stall_timeout=0.3)  # type: ignore[arg-type]
    keys = [key_for(namespace, i) for i in range(3)]
    try:
        runs = [BlockRun([key], rows_for(layout, i), 0) for i, key in enumerate(keys)]
        assert publisher.submit([runs[0]])  # taken by the thread, which hangs in the store
        time.sleep(0.1)
        assert publisher.submit([runs[1]])  # fills the queue
        assert _in_thread(lambda: publisher.submit([runs[2]])) is False
        assert publisher.dropped_submissions == 1
        error = _in_thread(lambda: publisher.flush([keys[0]]))
        assert isinstance(error, StoreError) and "did not finish within" in str(error)
        error = _in_thread(lambda: publisher.flush([keys[1]]), bound=0.2)
        assert isinstance(error, StoreError) and "stalled" in str(error)
        assert publisher.flush([keys[2]]) is None  # dropped: nothing to wait for
    finally:
        stalled.release.set()
    _wait_for(lambda: publisher.published_objects >= 2, "unstuck, it goes on")
    publisher.flush()
    publisher.close()
    assert store.exists(keys) == [True, True, False]


def test_leases_keep_objects_readable_under_pressure_then_expire(
    store: ShmStore, threaded: Publisher, layout: R3Layout, namespace: Namespace
) -> None:
    """Objects a keys handle names stay stored while leased although publications keep
    evicting (the store holds 128 blocks; 300 more are published), and become evictable
    when the lease ends. A lease on an absent key pins nothing, so its expiry cannot drop
    another holder's pin."""
    bs = layout.block_size
    leased = [key_for(namespace, i) for i in range(4)]
    rows = np.concatenate([rows_for(layout, i) for i in range(4)])
    absent = key_for(namespace, 10_000)
    threaded.submit([BlockRun(leased, rows, 0), Lease([*leased, absent], 0.5)])
    threaded.flush()
    assert threaded.leased_objects == 4 and store.stats().pinned_objects == 4
    ten_blocks = np.concatenate([rows_for(layout, j) for j in range(10)])
    for i in range(100, 400, 10):
        batch = [key_for(namespace, j) for j in range(i, i + 10)]
        threaded.submit([BlockRun(batch, ten_blocks, 0)])
    threaded.flush()
    assert threaded.failures == 0 and store.stats().evictions > 0
    out = layout.empty(4 * bs)
    store.read_into(leased, out)  # every other block of the first 100 evicted
    np.testing.assert_array_equal(out, rows)
    _wait_for(lambda: not threaded.leased_objects, "the lease ends")
    assert threaded.leased_objects == 0 and store.stats().pinned_objects == 0
    for i in range(400, 700, 10):  # no pin left: the old objects go
        batch = [key_for(namespace, j) for j in range(i, i + 10)]
        threaded.submit([BlockRun(batch, ten_blocks, 0)])
    threaded.flush()
    assert not any(store.exists(leased))


def test_a_flush_of_keys_waits_for_their_batch_across_pruning(
    store: ShmStore, layout: R3Layout, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's record of queued keys drops written entries now and then (kept small
    without the publishing thread touching it); a flush of keys still waits for exactly
    their batch, before and after pruning, and a key submitted again waits for the later."""
    monkeypatch.setattr("vllm_artifact.core.publisher._MIN_PRUNE_AT", 8)
    release = threading.Event()
    writes: list[int] = []

    class GatedStore:
        layout = store.layout

        def put_blocks(self, keys: Any, rows: Any, token_start: int, *, pin: bool) -> None:
            release.wait(10)
            writes.append(token_start)
            store.put_blocks(keys, rows, token_start, pin=pin)

    publisher = Publisher(GatedStore())  # type: ignore[arg-type]
    try:
        keys = [key_for(namespace, i) for i in range(20)]
        for i in range(12):  # past the first pruning point
            publisher.submit([BlockRun([keys[i]], rows_for(layout, i), i * layout.block_size)])
        # keys[5] was queued before the record was pruned (at 8 entries), and is not written.
        waiter = threading.Thread(target=publisher.flush, args=([keys[5]],))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # its batch is not written: the flush waits
        release.set()
        waiter.join(10)
        assert not waiter.is_alive() and store.exists([keys[5]]) == [True]
        assert len(publisher._queued) <= 12
        # Pruned of written entries as it grows; a key queued again waits for its new batch.
        release.clear()
        for i in range(12, 20):
            publisher.submit([BlockRun([keys[i]], rows_for(layout, i), i * layout.block_size)])
        assert len(publisher._queued) < 20
        publisher.submit([BlockRun([keys[3]], rows_for(layout, 3), 3 * layout.block_size)])
        waiter = threading.Thread(target=publisher.flush, args=([keys[3]],))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
        release.set()
        waiter.join(10)
        assert not waiter.is_alive() and writes[-1] == 3 * layout.block_size
    finally:
        release.set()
        publisher.close()


class _RecordingStore:
    """Records which thread writes each batch of blocks, and how many blocks."""

    def __init__(self, store: ShmStore) -> None:
        self._store = store
        self.layout = store.layout
        self.writes: list[tuple[str, int]] = []

    def put_blocks(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        self.writes.append((threading.current_thread().name, len(keys)))
        return self._store.put_blocks(keys, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_large_batches_are_stored_inline_in_order_and_small_ones_on_the_thread(
    store: ShmStore, layout: R3Layout, namespace: Namespace
) -> None:
    """With ``inline_from_blocks`` (the engine's /dev/shm store) a batch of that many blocks
    is in the store when ``submit`` returns, written on the caller's thread; a smaller one
    goes to the publishing thread; and an inline batch never overtakes a queued one (it waits
    for it, so pins and unpins keep their order)."""
    recording = _StalledStore(store)
    recording.release.set()
    recorder = _RecordingStore(recording)  # type: ignore[arg-type]
    publisher = Publisher(recorder, inline_from_blocks=4)  # type: ignore[arg-type]
    keys = [key_for(namespace, i) for i in range(12)]
    rows = np.concatenate([rows_for(layout, i) for i in range(12)])
    bs = layout.block_size
    try:
        assert publisher.submit([BlockRun(keys[:2], rows[: 2 * bs], 0)])
        assert publisher.submit([BlockRun(keys[2:6], rows[2 * bs : 6 * bs], 2 * bs)])
        assert store.exists(keys[:6]) == [True] * 6  # the queued pair went first
        assert recorder.writes == [("vllm-artifact-publisher", 2), ("MainThread", 4)]
        # A queued batch stuck in the store holds the next inline one back until it is done.
        recording.release.clear()
        assert publisher.submit([BlockRun(keys[6:7], rows[6 * bs : 7 * bs], 6 * bs)])
        time.sleep(0.1)
        inline = threading.Thread(
            target=publisher.submit, args=([BlockRun(keys[7:12], rows[7 * bs :], 7 * bs)],)
        )
        inline.start()
        time.sleep(0.2)
        assert store.exists(keys[6:12]) == [False] * 6
        recording.release.set()
        inline.join(10)
        assert store.exists(keys) == [True] * 12
        assert [count for _, count in recorder.writes] == [2, 4, 1, 5]
        assert publisher.inline_batches == 2 and publisher.failures == 0
    finally:
        recording.release.set()
        publisher.close()


class _FailingStore:
    """A store whose block writes fail (an arena that cannot take them)."""

    def __init__(self, store: ShmStore) -> None:
        self._store = store
        self.layout = store.layout

    def put_blocks(self, *args: Any, **kwargs: Any) -> None:
        raise StoreError("the arena refused the write")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_an_inline_publication_that_fails_is_counted_not_raised(
    store: ShmStore, layout: R3Layout, namespace: Namespace
) -> None:
    """The step thread writing a batch inline never sees a store error: the batch is counted
    as failed and its keys stay absent (a later hit on them fails closed)."""
    failing = Publisher(_FailingStore(store), inline_from_blocks=1)  # type: ignore[arg-type]
    key = key_for(namespace, 0)
    try:
        assert failing.submit([BlockRun([key], rows_for(layout, 0), 0)])
        assert failing.inline_batches == 1
        assert failing.failures == 1 and store.exists([key]) == [False]
    finally:
        failing.close()


def test_a_batch_with_a_lease_goes_to_the_thread_which_ends_the_lease(
    store: ShmStore, layout: R3Layout, namespace: Namespace
) -> None:
    """A lease is never written inline: the publishing thread times its expiry."""
    publisher = Publisher(store, inline_from_blocks=1)
    leased = [key_for(namespace, i) for i in range(2)]
    rows = np.concatenate([rows_for(layout, i) for i in range(2)])
    try:
        publisher.submit([BlockRun(leased, rows, 0), Lease(leased, 0.05)])
        publisher.flush()
        assert publisher.inline_batches == 0 and store.exists(leased) == [True, True]
        _wait_for(lambda: not publisher.leased_objects, "the lease ends")
        assert publisher.leased_objects == 0 and store.stats().pinned_objects == 0
    finally:
        publisher.close()


def test_an_inline_batch_behind_a_stalled_store_is_dropped_after_the_bound(
    store: ShmStore, layout: R3Layout, namespace: Namespace
) -> None:
    """The step thread never waits longer than ``stall_timeout`` for the batches queued before
    an inline one: with the publishing thread stuck in the store, the inline batch is dropped
    (counted, its keys absent) and the next one is dropped at once, until the store moves."""
    stalled = _StalledStore(store)
    publisher = Publisher(stalled, inline_from_blocks=2, stall_timeout=0.3)  # type: ignore[arg-type]
    keys = [key_for(namespace, i) for i in range(5)]
    rows = np.concatenate([rows_for(layout, i) for i in range(5)])
    bs = layout.block_size
    try:
        assert publisher.submit([BlockRun(keys[:1], rows[:bs], 0)])  # the thread hangs in it
        time.sleep(0.1)
        started = time.monotonic()
        inline = [BlockRun(keys[1:3], rows[bs : 3 * bs], bs)]
        assert _in_thread(lambda: publisher.submit(inline)) is False
        assert 0.25 < time.monotonic() - started < 5
        later = [BlockRun(keys[3:5], rows[3 * bs :], 3 * bs)]
        assert _in_thread(lambda: publisher.submit(later), bound=0.2) is False
        assert publisher.dropped_submissions == 2 and publisher.inline_batches == 0
    finally:
        stalled.release.set()
    _wait_for(lambda: publisher.published_objects >= 1, "unstuck, it goes on")
    assert publisher.submit([BlockRun(keys[3:5], rows[3 * bs :], 3 * bs)])  # inline again
    assert publisher.inline_batches == 1
    publisher.close()
    assert store.exists(keys) == [True, False, False, True, True]


def test_pin_changes_alone_go_inline_only_while_the_thread_is_idle(
    store: ShmStore, layout: R3Layout, namespace: Namespace
) -> None:
    """A pin change with no blocks (a step's unpins) is written on the caller's thread when
    the publishing thread has nothing to do, instead of waking it; behind a busy thread it is
    queued (the caller never waits for it); a store without inline writes never does so."""
    stalled = _StalledStore(store)
    publisher = Publisher(stalled, inline_from_blocks=64)  # type: ignore[arg-type]
    key = key_for(namespace, 0)
    try:
        assert publisher.submit([BlockRun([key], rows_for(layout, 0), 0), PinChange([key], True)])
        time.sleep(0.1)  # the thread hangs in the write
        assert _in_thread(lambda: publisher.submit([PinChange([key], False)]), bound=0.2)
        assert publisher.inline_batches == 0 and publisher.thread_batches == 2
    finally:
        stalled.release.set()
    publisher.flush()
    assert store.stats().pinned_objects == 0
    assert publisher.submit([PinChange([key], True)])
    assert publisher.inline_batches == 1 and store.stats().pinned_objects == 1  # no flush
    publisher.close()
    threaded = Publisher(store)  # a network store's: every batch on the thread
    try:
        assert threaded.submit([PinChange([key], False)])
        threaded.flush()
        assert threaded.inline_batches == 0 and store.stats().pinned_objects == 0
    finally:
        threaded.close()
