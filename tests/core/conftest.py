"""Fixtures for the pure-core tests: small layouts and private /dev/shm roots."""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from vllm_artifact.core import Namespace, ObjectKey, R3Layout, full_block_key
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_arena import ArenaGeometry

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
