"""NodeStores: R3 of KV another engine of the node computed, read key by key from its store."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from vllm_artifact.core.keys import Namespace, full_block_keys
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.node_stores import NodeStores
from vllm_artifact.core.store.shm_arena import ArenaGeometry
from vllm_artifact.errors import (
    NotOnNodeError,
    ObjectCorruptError,
    WeightVersionMismatchError,
)

from .conftest import rows_for

FAMILY = "r3-0123456789ab-dp"


def writer(root: str, name: str, layout: R3Layout, slots: int = 64) -> ShmStore:
    capacity = ArenaGeometry(layout, slots).file_nbytes
    return ShmStore.create_or_open_writer(root, name, layout=layout, capacity_bytes=capacity)


@pytest.fixture
def stores(shm_root: str, layout: R3Layout) -> Iterator[tuple[ShmStore, ShmStore, NodeStores]]:
    """This engine's store (``…-dp0``) and a producer's (``…-dp0-2``) of one family."""
    own = writer(shm_root, f"{FAMILY}0", layout)
    producer = writer(shm_root, f"{FAMILY}0-2", layout)
    for store in (own, producer):
        store.record_weight_version("v1")
    node = NodeStores(own, FAMILY)
    yield own, producer, node
    node.close()
    own.close()
    producer.close()


def blocks(namespace: Namespace, tag: str, n: int) -> tuple[list, np.ndarray]:
    keys = full_block_keys(namespace, [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)])
    return keys, rows_for(namespace.layout, sum(tag.encode()), n * namespace.layout.block_size)


def test_own_store_first_then_the_producers_key_by_key(
    stores: tuple[ShmStore, ShmStore, NodeStores], namespace: Namespace
) -> None:
    own, producer, node = stores
    bs = namespace.layout.block_size
    keys, rows = blocks(namespace, "p", 4)
    own.put_blocks(keys[:1], rows[:bs], 0)
    producer.put_blocks(keys[1:3], rows[bs : 3 * bs], bs)
    own.put_blocks(keys[3:], rows[3 * bs :], 3 * bs)
    out = namespace.layout.empty(4 * bs)
    assert node.read_into(keys, out, token_start=0, weight_version="v1") == [(1, 3)]
    np.testing.assert_array_equal(out, rows)
    assert node.others == [f"{FAMILY}0-2"]
    # Everything in this engine's store: nothing adopted, the other stores are not looked at.
    out = namespace.layout.empty(bs)
    assert node.read_into(keys[:1], out, token_start=0, weight_version="v1") == []


def test_a_key_found_nowhere_fails_with_the_stores_searched(
    stores: tuple[ShmStore, ShmStore, NodeStores], namespace: Namespace
) -> None:
    own, producer, node = stores
    bs = namespace.layout.block_size
    keys, rows = blocks(namespace, "q", 3)
    producer.put_blocks(keys[:2], rows[: 2 * bs], 0)
    with pytest.raises(NotOnNodeError) as raised:
        node.read_into(keys, namespace.layout.empty(3 * bs), token_start=0, weight_version="v1")
    assert raised.value.absent == (2,) and raised.value.reason == "missing"
    message = str(raised.value)
    assert f"tokens from {2 * bs}" in message and own.root in message
    assert f"{FAMILY}0, {FAMILY}0-2" in message and "another node" in message


def test_stores_of_another_family_or_layout_are_never_read(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    own = writer(shm_root, f"{FAMILY}0", layout)
    other_model = writer(shm_root, "r3-ffffffffffff-dp0", layout)
    other_layout = R3Layout(num_layers=6, top_k=4, num_experts=64, block_size=16, dense_layers=())
    colliding = writer(shm_root, f"{FAMILY}1", other_layout)
    keys, rows = blocks(namespace, "f", 1)
    other_model.put_blocks(keys, rows, 0)
    colliding.put_blocks(keys, rows, 0)
    node = NodeStores(own, FAMILY)
    try:
        with pytest.raises(NotOnNodeError):
            node.read_into(keys, layout.empty(16), token_start=0, weight_version="default")
        assert node.others == []
    finally:
        node.close()
        for store in (own, other_model, colliding):
            store.close()


def test_a_removed_producer_store_is_dropped_and_its_keys_fail(
    stores: tuple[ShmStore, ShmStore, NodeStores], namespace: Namespace
) -> None:
    _, producer, node = stores
    bs = namespace.layout.block_size
    keys, rows = blocks(namespace, "r", 2)
    producer.put_blocks(keys, rows, 0)
    out = namespace.layout.empty(2 * bs)
    assert node.read_into(keys, out, token_start=0, weight_version="v1") == [(0, 2)]
    shutil.rmtree(f"{producer.root}/{producer.name}")  # e.g. its root cleaned between requests
    with pytest.raises(NotOnNodeError):
        node.read_into(keys, out, token_start=0, weight_version="v1")
    assert node.others == []  # the old mapping is released, not kept alive


def test_a_corrupt_object_in_the_producers_store_fails_closed(
    stores: tuple[ShmStore, ShmStore, NodeStores], namespace: Namespace
) -> None:
    _, producer, node = stores
    keys, rows = blocks(namespace, "c", 1)
    producer.put_blocks(keys, rows, 0)
    located = producer._reads.locate(np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2))
    slot = int(located.slots[0])
    with open(f"{producer.root}/{producer.name}/arena", "r+b") as arena:
        at = producer.geometry.payload_offset + slot * producer.geometry.slot_nbytes
        arena.seek(at)
        byte = arena.read(1)
        arena.seek(at)
        arena.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ObjectCorruptError):
        node.read_into(keys, namespace.layout.empty(16), token_start=0, weight_version="v1")


def test_r3_under_our_version_from_an_engine_now_on_other_weights_is_refused(
    stores: tuple[ShmStore, ShmStore, NodeStores], namespace: Namespace
) -> None:
    _, producer, node = stores
    keys, rows = blocks(namespace, "w", 1)
    producer.put_blocks(keys, rows, 0)  # computed under v1, before the producer's update
    producer.record_weight_version("v2")
    with pytest.raises(WeightVersionMismatchError) as raised:
        node.read_into(keys, namespace.layout.empty(16), token_start=0, weight_version="v1")
    assert "'v1'" in str(raised.value) and "'v2'" in str(raised.value)


def test_the_version_a_producer_holds_a_block_under_is_found(
    stores: tuple[ShmStore, ShmStore, NodeStores], namespace: Namespace, layout: R3Layout
) -> None:
    own, producer, node = stores
    block_hash = b"h-0".ljust(32, b".")
    v2 = Namespace(namespace.model_id, layout, "v2")
    producer.record_weight_version("v2")
    producer.put_blocks(full_block_keys(v2, [block_hash]), rows_for(layout, 1), 0)
    own.put_blocks(full_block_keys(v2, [b"h-1".ljust(32, b".")]), rows_for(layout, 2), 0)
    node._refresh()
    holder = node.version_holding(namespace, block_hash)
    assert holder is not None and holder[0].name == producer.name and holder[1] == "v2"
    # This engine's own older versions are its stale prefix cache, not another engine's.
    assert node.version_holding(namespace, b"h-1".ljust(32, b".")) is None


def test_the_capacity_hint_appears_once_this_engines_store_has_evicted(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    own = writer(shm_root, f"{FAMILY}0", layout, slots=2)
    node = NodeStores(own, FAMILY)
    try:
        n = own.stats().capacity_objects + 1
        keys, rows = blocks(namespace, "e", n)
        bs = layout.block_size
        for i in range(n):  # unpinned: the last one evicts the least recently used
            own.put_blocks(keys[i : i + 1], rows[i * bs : (i + 1) * bs], i * bs, pin=False)
        assert own.stats().evictions == 1
        with pytest.raises(NotOnNodeError, match=r"evicted 1 objects so far.*--artifact-capacity"):
            node.read_into(keys[:1], layout.empty(bs), token_start=0, weight_version="v1")
    finally:
        node.close()
        own.close()
