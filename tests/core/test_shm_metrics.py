"""The writer's exported counters: what a metrics exporter in another process reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_metrics import METRICS_NAME, StoreMetrics

from .conftest import key_for, rows_for


def test_counters_follow_puts_reads_and_pins(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    store_dir = Path(shm_root) / "s"
    bs = layout.block_size
    with ShmStore.create_or_open_writer(
        shm_root, "s", layout=layout, capacity_bytes=64 * layout.block_nbytes
    ) as store:
        fresh = StoreMetrics.read(store_dir)
        assert fresh is not None and fresh.objects == 0 and fresh.published_objects == 0
        keys = [key_for(namespace, i) for i in range(6)]
        rows = np.concatenate([rows_for(layout, i) for i in range(6)])
        store.put_blocks(keys[:4], rows[: 4 * bs], 0, pin=True)
        store.put_blocks(keys[4:], rows[4 * bs :], 4 * bs, pin=False)
        out = layout.empty(6 * bs)
        store.read_into(keys, out)
        store.unpin(keys[:1])
        seen = StoreMetrics.read(store_dir)
    assert seen is not None
    assert (seen.objects, seen.pinned_objects, seen.evictions) == (6, 3, 0)
    assert seen.bytes_used > 0 and seen.capacity_bytes >= 64 * layout.block_nbytes
    assert (seen.published_objects, seen.read_objects) == (6, 6)
    assert seen.publish_seconds.count == 2 and seen.read_seconds.count == 1
    assert seen.publish_seconds.buckets[-1] == (float("inf"), 2.0)  # cumulative
    assert 0 < seen.read_seconds.sum < 1


def test_missing_or_foreign_metrics_files_read_as_none(tmp_path: Path) -> None:
    assert StoreMetrics.read(tmp_path) is None
    (tmp_path / METRICS_NAME).write_bytes(b"\0" * 8)
    assert StoreMetrics.read(tmp_path) is None
    (tmp_path / METRICS_NAME).write_bytes(b"\1" * 8 * 36)
    assert StoreMetrics.read(tmp_path) is None
