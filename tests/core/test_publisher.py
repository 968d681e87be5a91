"""BackgroundPublisher: ordered, durable after flush, and a collision loses only its block."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from vllm_artifact.core.keys import Namespace
from vllm_artifact.core.publisher import BackgroundPublisher, BlockRun, PinChange
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore

from .conftest import key_for, rows_for


@pytest.fixture
def store(shm_root: str, layout: R3Layout) -> Iterator[ShmStore]:
    store = ShmStore.create_or_open_writer(
        shm_root, "s", layout=layout, capacity_bytes=128 * layout.block_nbytes
    )
    yield store
    store.close()


@pytest.fixture
def publisher(store: ShmStore) -> Iterator[BackgroundPublisher]:
    publisher = BackgroundPublisher(store)
    yield publisher
    publisher.close()


def test_flush_makes_submitted_blocks_readable(
    store: ShmStore, publisher: BackgroundPublisher, layout: R3Layout, namespace: Namespace
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
    store: ShmStore, publisher: BackgroundPublisher, layout: R3Layout, namespace: Namespace
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
    store: ShmStore, publisher: BackgroundPublisher, layout: R3Layout, namespace: Namespace
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
