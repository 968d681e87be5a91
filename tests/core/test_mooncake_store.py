"""MooncakeStore against a real ``mooncake_master`` on loopback (no mocks): round trips,
immutability, fail-closed reads, another process, master death and restart, capacity,
eviction and pins."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mooncake.store as mooncake_store  # installed by the setup (the mooncake extra)
import numpy as np
import pytest
from vllm_artifact_testing.mooncake_master import (
    MooncakeMaster,
    client_env,
    mooncake_master,
)

from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.envelope import HEADER_NBYTES
from vllm_artifact.core.objects_digest import objects_checksums
from vllm_artifact.core.store import ObjectStore
from vllm_artifact.core.store.mooncake import MooncakeStore
from vllm_artifact.errors import (
    ArtifactConfigError,
    CapacityError,
    KeyCollisionError,
    ObjectCorruptError,
    ObjectMissingError,
    StoreClosedError,
    StoreReadOnlyError,
    StoreUnavailableError,
)

from .conftest import SMALL, key_for, rows_for

NS = Namespace("test-model", SMALL, "v1")
#: DeepSeek-V3-sized rows (58 layers x top-8 uint8): 7.4 KB objects fill segments quickly.
WIDE = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
WIDE_NS = Namespace("wide-model", WIDE, "v1")
MiB = 1 << 20


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with mooncake_master() as running:
        yield running


def connect(
    master: MooncakeMaster,
    prefix: str,
    *,
    layout: R3Layout = SMALL,
    segment_bytes: int = 64 * MiB,
    writable: bool = True,
) -> MooncakeStore:
    return MooncakeStore.connect(
        master_address=master.master_address,
        metadata_url=master.metadata_url,
        local_hostname="127.0.0.1",
        layout=layout,
        key_prefix=prefix,
        segment_bytes=segment_bytes,
        local_buffer_bytes=4 * MiB,
        writable=writable,
    )


@pytest.fixture(scope="module")
def writer(master: MooncakeMaster) -> Iterator[MooncakeStore]:
    """One writer client for the module (a Mooncake client takes 1-2 s to close)."""
    with connect(master, "test/module") as opened:
        yield opened


@pytest.fixture
def store(writer: MooncakeStore) -> Iterator[MooncakeStore]:
    """A writer under a fresh prefix (so tests never see each other's objects)."""
    with writer.sharing_client(f"test/{secrets.token_hex(4)}") as opened:
        assert isinstance(opened, MooncakeStore)
        yield opened


@pytest.fixture(scope="module")
def raw(master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client (no segment) for planting bytes under our keys."""
    client = mooncake_store.MooncakeDistributedStore()
    assert (
        client.setup("127.0.0.1", master.metadata_url, 0, 4 * MiB, "tcp", "", master.master_address)
        == 0
    )
    yield client
    client.close()


def test_round_trip_put_runs_read_into_get(store: MooncakeStore, layout: R3Layout) -> None:
    assert isinstance(store, ObjectStore)
    a = [key_for(NS, i) for i in range(3)]
    b = [key_for(NS, 10 + i) for i in range(2)]
    rows_a = rows_for(layout, 1, 40)  # 2 full blocks + an 8-token tail, from token 32
    rows_b = rows_for(layout, 2, 32)[:, :, ::-1]  # not C-contiguous
    store.put_runs([(a, rows_a, 32), (b, rows_b, 0)])
    single = key_for(NS, 20)
    store.put([(single, rows_for(layout, 3, 5), 16)], pin=False)
    assert store.exists([*a, *b, single, key_for(NS, 99)]) == [True] * 6 + [False]
    out = layout.empty(40)
    checksums = store.read_into(a, out, token_start=32)
    np.testing.assert_array_equal(out, rows_a)
    # the envelope checksums verified on the rows read: those the rows' objects must carry
    want = objects_checksums(layout, a, 32, np.ascontiguousarray(rows_a).reshape(-1).view(np.uint8))
    assert checksums.tolist() == want
    part = layout.empty(16)
    store.read_into(a[1:2], part, token_start=48)
    np.testing.assert_array_equal(part, rows_a[16:32])
    got = store.get([*b, single])
    np.testing.assert_array_equal(np.concatenate(got[:2]), rows_b)
    np.testing.assert_array_equal(got[2], rows_for(layout, 3, 5))
    stats = store.stats()
    assert (stats.objects, stats.pinned_objects, stats.writable) == (6, 5, True)


def test_identical_republish_is_accepted_different_content_collides(
    store: MooncakeStore, layout: R3Layout
) -> None:
    keys = [key_for(NS, i) for i in range(3)]
    rows = rows_for(layout, 7, 48)
    store.put_blocks(keys, rows, 0)
    store.put_blocks(keys, rows, 0)  # identical: accepted, nothing rewritten
    other = rows.copy()
    other[20, 0, 0] ^= 1
    fresh = key_for(NS, 50)
    with pytest.raises(KeyCollisionError, match="different content"):
        store.put_runs([([fresh], rows_for(layout, 8), 0), (keys, other, 0)])
    assert store.exists([fresh]) == [False], "a collision must store nothing of its batch"
    with pytest.raises(KeyCollisionError):  # same bytes at another token range
        store.put([(keys[0], rows[:16], 16)])
    out = layout.empty(48)
    store.read_into(keys, out)
    np.testing.assert_array_equal(out, rows)  # the first value is kept


def test_missing_objects_fail_closed(store: MooncakeStore, layout: R3Layout) -> None:
    present = key_for(NS, 1)
    store.put([(present, rows_for(layout, 1), 0)])
    out = layout.empty(32)
    with pytest.raises(ObjectMissingError, match="1 of 2"):
        store.read_into([present, key_for(NS, 2)], out)
    with pytest.raises(ObjectMissingError):
        store.get([key_for(NS, 3)])


def _plant(store: MooncakeStore, raw: Any, key: Any, value: bytes) -> None:
    """Replace the value under ``key`` by ``value``, written by another client."""
    (name,) = store.names([key])
    assert raw.remove(name, True) in (0, -704)
    assert raw.put(name, value) == 0


def test_planted_bytes_under_our_key_are_corrupt(
    store: MooncakeStore, raw: Any, layout: R3Layout
) -> None:
    """Values written under our keys by another client: a flipped payload byte (only the
    checksum sees it), another key's value, a truncated value and garbage all fail closed;
    a put replaces them."""
    keys = [key_for(NS, i) for i in range(4)]
    rows = rows_for(layout, 5, 64)
    store.put_blocks(keys, rows, 0, pin=False)
    values = [bytes(store.live().get(name)) for name in store.names(keys)]
    assert {len(value) for value in values} == {HEADER_NBYTES + layout.block_nbytes}
    flipped = bytearray(values[0])
    flipped[-1] ^= 1
    planted = [bytes(flipped), values[0], values[2][:-1], secrets.token_bytes(len(values[3]))]
    for key, value in zip(keys, planted, strict=True):
        _plant(store, raw, key, value)
        with pytest.raises(ObjectCorruptError):
            store.get([key])
    store.put([(keys[0], rows[:16], 0)])  # a corrupt leftover is replaced
    np.testing.assert_array_equal(store.get([keys[0]])[0], rows[:16])
    good = [key_for(NS, 10 + i) for i in range(2)]
    store.put_blocks(good, rows[:32], 0)
    with pytest.raises(ObjectCorruptError, match="does not continue"):
        store.read_into(good[::-1], layout.empty(32))  # intact objects in the wrong order


def test_another_process_reads_what_this_one_wrote(
    master: MooncakeMaster, store: MooncakeStore, layout: R3Layout, tmp_path: Path
) -> None:
    keys = [key_for(NS, i) for i in range(5)]
    rows = rows_for(layout, 11, 70)
    store.put_blocks(keys, rows, 0)
    np.save(tmp_path / "want.npy", rows)
    script = textwrap.dedent(
        f"""
        import numpy as np
        from tests.core.conftest import SMALL, key_for
        from vllm_artifact.core import Namespace
        from vllm_artifact.core.store.mooncake import MooncakeStore
        from vllm_artifact.errors import StoreReadOnlyError
        store = MooncakeStore.connect(
            master_address={master.master_address!r}, metadata_url={master.metadata_url!r},
            local_hostname="127.0.0.1", layout=SMALL, key_prefix={store._prefix!r},
            segment_bytes=0, writable=False)
        keys = [key_for(Namespace("test-model", SMALL, "v1"), i) for i in range(5)]
        out = SMALL.empty(70)
        store.read_into(keys, out)
        assert np.array_equal(out, np.load({str(tmp_path / "want.npy")!r}))
        try:
            store.put_blocks(keys, out, 0)
        except StoreReadOnlyError:
            print("read-only")
        store.close()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=client_env(),
        cwd=Path(__file__).parents[2],
    )
    assert done.stdout.split() == ["read-only", "ok"], done.stderr[-3000:]


def test_pins_are_hard_pins_and_the_last_unpin_removes(
    store: MooncakeStore, layout: R3Layout
) -> None:
    """Put pinned: one pin per put; a pin on an object stored unpinned rewrites it
    pinned; the last unpin removes the object (Mooncake cannot lift a hard pin)."""
    pinned, loose = key_for(NS, 1), key_for(NS, 2)
    store.put([(pinned, rows_for(layout, 1), 0)])
    store.put([(pinned, rows_for(layout, 1), 0)])  # a second pin reference
    store.put([(loose, rows_for(layout, 2), 16)], pin=False)
    assert store.stats().pinned_objects == 1
    assert store.pin([loose, key_for(NS, 3)]) == [True, False]
    np.testing.assert_array_equal(store.get([loose])[0], rows_for(layout, 2))
    assert store.stats().pinned_objects == 2
    assert store.unpin([pinned, loose, key_for(NS, 3)]) == [True, True, False]
    assert store.exists([pinned, loose]) == [True, False]
    assert store.unpin([pinned]) == [True]
    assert store.exists([pinned]) == [False]
    assert store.unpin([pinned]) == [False]
    stats = store.stats()
    assert (stats.pinned_objects, stats.evictions) == (0, 2)


def test_two_writers_of_one_prefix_never_remove_each_others_objects(
    store: MooncakeStore, layout: R3Layout
) -> None:
    """The engines of a prefill/decode pair write one prefix: the consumer's pins and unpins
    of the producer's objects (a keys lease, a hit it republishes) leave them in place; their
    lifetime is their writer's."""
    producer = store
    consumer = store.sharing_client(store.key_prefix)
    shared, own = key_for(NS, 20), key_for(NS, 21)
    producer.put([(shared, rows_for(layout, 20), 0)])
    consumer.put([(shared, rows_for(layout, 20), 0)])  # identical: accepted, not rewritten
    consumer.put([(own, rows_for(layout, 21), 16)])
    assert consumer.pin([shared]) == [True]
    assert consumer.unpin([shared, shared, own]) == [True, True, True]
    assert producer.exists([shared, own]) == [True, False]  # the consumer removed only its own
    np.testing.assert_array_equal(consumer.get([shared])[0], rows_for(layout, 20))
    assert producer.unpin([shared]) == [True]
    assert consumer.exists([shared]) == [False]
    consumer.close()


def test_reader_and_closed_handles(master: MooncakeMaster, store: MooncakeStore) -> None:
    key = key_for(NS, 1)
    store.put([(key, rows_for(SMALL, 1), 0)])
    with connect(master, store._prefix, segment_bytes=0, writable=False) as reader:
        assert reader.exists([key]) == [True]
        for call in (lambda: reader.put([(key, rows_for(SMALL, 1), 0)]), lambda: reader.pin([key])):
            with pytest.raises(StoreReadOnlyError):
                call()
    with pytest.raises(StoreClosedError):
        reader.get([key])
    reader.close()  # idempotent


def test_unreachable_master_fails_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refuses connections
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="does not accept connections"):
            MooncakeStore.connect(
                master_address=f"127.0.0.1:{port}",
                metadata_url=f"http://127.0.0.1:{port}/metadata",
                local_hostname="127.0.0.1",
                layout=SMALL,
                key_prefix="x",
                segment_bytes=0,
            )
    assert time.monotonic() - started < 3


def test_master_death_is_unavailable_and_a_restart_loses_everything() -> None:
    with mooncake_master() as own:
        store = connect(own, "restart")
        keys = [key_for(NS, i) for i in range(2)]
        rows = rows_for(SMALL, 3, 32)
        store.put_blocks(keys, rows, 0)
        own.kill()
        out = SMALL.empty(32)
        for call in (
            lambda: store.read_into(keys, out),
            lambda: store.put_blocks([key_for(NS, 9)], rows[:16], 0),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                call()
            assert time.monotonic() - started < 10
        own.start()
        deadline = time.monotonic() + 15
        while True:  # the client mounts its segment again within a second or two
            try:
                store.put_blocks([key_for(NS, 5)], rows[:16], 0)
                break
            except (StoreUnavailableError, CapacityError):
                # Until then puts find no segment (NO_AVAILABLE_HANDLE) while the client's
                # health check may already say healthy: a CapacityError, not unavailable.
                assert time.monotonic() < deadline, "puts never worked after the restart"
                time.sleep(0.2)
        np.testing.assert_array_equal(store.get([key_for(NS, 5)])[0], rows[:16])
        with pytest.raises(ObjectMissingError):  # the old master's objects are gone
            store.read_into(keys, out)
        store.close()


def test_unpinned_objects_are_evicted_pinned_ones_never_then_capacity() -> None:
    """Segments full: Mooncake evicts unpinned objects silently (their reads then fail as
    missing), never hard-pinned ones; with pinned objects alone filling the segment a put
    is CapacityError, and unpinning makes room again."""
    with mooncake_master(["--default_kv_lease_ttl=50"]) as own:
        store = connect(own, "full", layout=WIDE, segment_bytes=16 * MiB)
        rows = rows_for(WIDE, 1, 16 * 500)
        pinned = [key_for(WIDE_NS, i) for i in range(64)]
        store.put_blocks(pinned[:32], rows[: 16 * 32], 0)  # 64 x 7.5 KB of a 16 MiB segment
        store.put_blocks(pinned[32:], rows[16 * 32 : 16 * 64], 16 * 32, pin=False)
        assert store.pin(pinned[32:]) == [True] * 32  # rewritten hard-pinned
        loose = [key_for(WIDE_NS, 10_000 + i) for i in range(6000)]  # 45 MB: 3x the segment
        for at in range(0, len(loose), 500):
            store.put_blocks(loose[at : at + 500], rows, 0, pin=False)
            time.sleep(0.06)  # past the lease the put left on them
        assert not all(store.exists(loose)), "nothing was evicted"
        out = WIDE.empty(16 * 64)
        store.read_into(pinned, out)
        np.testing.assert_array_equal(out, rows[: 16 * 64])
        more = [key_for(WIDE_NS, 20_000 + i) for i in range(5000)]
        with pytest.raises(CapacityError):
            for at in range(0, len(more), 500):
                store.put_blocks(more[at : at + 500], rows, 0)
                time.sleep(0.06)
        assert store.exists(pinned) == [True] * 64
        store.unpin(more[:500])
        store.put_blocks(more[:500], rows, 0)  # room again
        store.close()


def test_core_imports_without_mooncake() -> None:
    script = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from vllm_artifact.core.store.mooncake import MooncakeStore\n"
        "from vllm_artifact.errors import ArtifactConfigError\n"
        "from tests.core.conftest import SMALL\n"
        "try:\n"
        "    MooncakeStore.connect(master_address='127.0.0.1:1', metadata_url='P2PHANDSHAKE',"
        " local_hostname='127.0.0.1', layout=SMALL, key_prefix='x', segment_bytes=0)\n"
        "except ArtifactConfigError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert "pip install vllm-artifact[mooncake]" in done.stdout, done.stderr[-2000:]


def test_bad_configuration_is_refused(master: MooncakeMaster) -> None:
    with pytest.raises(ArtifactConfigError, match="prefix"):
        connect(master, "has space")
    with pytest.raises(ArtifactConfigError, match="16 MiB"):
        connect(master, "x", segment_bytes=MiB)
    with pytest.raises(ArtifactConfigError, match="host:port"):
        MooncakeStore.connect(
            master_address="nohost",
            metadata_url=master.metadata_url,
            local_hostname="127.0.0.1",
            layout=SMALL,
            key_prefix="x",
            segment_bytes=0,
        )
