"""Fixtures for the pure-core tests: small layouts and private /dev/shm roots."""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from vllm_artifact.core import Namespace, ObjectKey, R3Layout, full_block_key
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_arena import ArenaGeometry
from vllm_artifact.core.store.shm_metrics import StoreMetrics

# Small geometry: 6 layers (layer 2 dense) x top-4, 16-token blocks = 384 B/block.
SMALL = R3Layout(num_layers=6, top_k=4, num_experts=64, block_size=16, dense_layers=(2,))


@pytest.fixture
def layout() -> R3Layout:
    return SMALL


@pytest.fixture
def namespace(layout: R3Layout) -> Namespace:
    return Namespace("test-model", layout, "v1")


@pytest.fixture
def shm_root() -> Iterator[str]:
    """A fresh private root under /dev/shm, removed afterwards."""
    root = f"/dev/shm/vat-test-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(root, 0o700)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def store(shm_root: str) -> Iterator[ShmStore]:
    """A writable store of the ``SMALL`` layout, ``r3-s`` under a fresh root (1 MiB); modules
    with a ``store`` fixture of their own use theirs."""
    with ShmStore.create_or_open_writer(
        shm_root, "r3-s", layout=SMALL, capacity_bytes=1 << 20, collect_expired=False
    ) as writer:
        yield writer


@pytest.fixture
def small_tmpfs() -> Iterator[Callable[[int], str]]:
    """Mounts a tmpfs of a given size on a fresh 0700 directory under /dev/shm (a trusted
    root must be strictly under /dev/shm) and unmounts it afterwards. The suite runs as root.
    ``mount(size)`` returns the mount point; ``mount.resize(path, size)`` remounts it."""
    mounts: list[str] = []

    def mount(size_bytes: int) -> str:
        path = f"/dev/shm/vllm-artifact-test-tmpfs-{secrets.token_hex(4)}"
        os.mkdir(path, 0o700)
        mounts.append(path)
        opts = f"size={size_bytes},mode=0700,uid={os.geteuid()},gid={os.getegid()}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)
        return path

    try:
        yield mount
    finally:
        for path in mounts:
            gc.collect()  # drop mappings of closed stores' leftover views
            if subprocess.run(["umount", path], check=False).returncode:
                subprocess.run(["umount", "-l", path], check=False)
            os.rmdir(path)


def remount_tmpfs(path: str, size_bytes: int) -> None:
    """Give a ``small_tmpfs`` mount another size (its files stay)."""
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", path], check=True)


def assert_store_consistent(store: ShmStore) -> None:
    """The writer's view of ``store`` agrees with its arena and index: no slot is left odd
    (being written); the slot table's occupancy is exactly the slots whose envelope is
    published, and its object and pin counts are recounts; a fresh reader counts the same
    objects; every index entry points to a published object of its key (tag and bucket) and
    every object has exactly one entry; the exported counters say the same."""
    arena = store._live()
    table = store._slots
    assert table is not None
    seq = arena.seq
    odd = np.flatnonzero(seq & np.uint64(1))
    assert not len(odd), f"slots left odd (being written): {odd.tolist()}"
    published = (arena.headers["magic"] != 0) & (seq > 0)
    assert np.array_equal(table.occupied, published), (
        f"slot table occupied {np.flatnonzero(table.occupied).tolist()}, "
        f"arena published {np.flatnonzero(published).tolist()}"
    )
    assert table.objects == int(np.count_nonzero(table.occupied))
    assert table.pinned == int(np.count_nonzero(table.pins))
    assert not table.pins[~table.occupied].any(), "pins on empty slots"
    stats = store.stats()
    with ShmStore.open_reader(store.root, store.name) as reader:
        assert reader.stats().objects == stats.objects
    index = store._reads.index.table
    buckets, ways = np.nonzero(index)
    entries = index[buckets, ways]
    slots = (entries & np.uint64(0xFFFFFFFF)).astype(np.int64) - 1
    assert (slots < len(seq)).all(), "index entries point outside the arena"
    assert published[slots].all(), "index entries point to empty slots"
    k0, k1 = arena.words[slots, 1], arena.words[slots, 2]
    assert ((entries >> np.uint64(32)) == (k1 >> np.uint64(32))).all(), "entry tag is wrong"
    mask = np.uint64(len(index) - 1)
    home = (buckets == (k0 & mask)) | (buckets == ((k0 >> np.uint64(32)) & mask))
    assert home.all(), "index entries outside their key's two buckets"
    assert sorted(slots.tolist()) == np.flatnonzero(published).tolist(), (
        "not exactly one index entry per object"
    )
    snapshot = StoreMetrics.read(Path(store.root) / store.name)
    assert snapshot is not None
    assert (snapshot.objects, snapshot.pinned_objects) == (stats.objects, stats.pinned_objects)


def rows_for(layout: R3Layout, seed: int, n_tokens: int | None = None) -> np.ndarray:
    """Deterministic valid rows (dense layers marked) derived from ``seed``."""
    n = layout.block_size if n_tokens is None else n_tokens
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, layout.num_experts, size=(n, *layout.row_shape)).astype(layout.dtype)
    layout.mark_dense(rows)
    return rows


def open_writer(root: str, layout: R3Layout, slots: int = 64) -> ShmStore:
    """A writable store under ``root`` sized for ``slots`` blocks."""
    cap = ArenaGeometry(layout, slots).file_nbytes
    return ShmStore.create_or_open_writer(root, "s", layout=layout, capacity_bytes=cap)


def key_for(namespace: Namespace, i: int) -> ObjectKey:
    return full_block_key(namespace, i.to_bytes(32, "little"))


@contextlib.contextmanager
def gil_releases() -> Iterator[list[int]]:
    """Counts the times the calling thread lets another thread run: a spinner thread counts
    and yields the GIL in a loop, and with a switch interval of 100 s there are no forced
    switches, so it runs only while this thread has released the GIL."""
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    # A collection inside the window could run finalizers of earlier tests' objects (an
    # mmap's close releases the GIL): collect now, none while counting.
    gc.collect()
    gc.disable()
    sys.setswitchinterval(100.0)
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        deadline = time.monotonic() + 10
        while count[0] == 0:  # the spinner runs now, so it waits for the GIL from here on
            assert time.monotonic() < deadline, "the spinner thread never ran"
            time.sleep(0.005)
        yield count
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        spinner.join()
        gc.enable()
