"""The Prometheus collector reads every store's counters under the roots in use."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_artifact.core import Namespace, R3Layout, full_block_keys
from vllm_artifact.core.store import ShmStore
from vllm_artifact.integration.metrics import StoreCollector, register_store_metrics

LAYOUT = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=(1,))


@pytest.fixture
def roots() -> Iterator[list[Path]]:
    made = [Path(f"/dev/shm/vat-metrics-{os.getpid()}-{secrets.token_hex(3)}") for _ in range(2)]
    for root in made:
        root.mkdir(mode=0o700)
    yield made
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


def test_collector_labels_each_store_and_registers_once(roots: list[Path]) -> None:
    namespace = Namespace("m", LAYOUT, "v1")
    rows = np.zeros((32, 4, 2), np.uint8)
    LAYOUT.mark_dense(rows)
    for i, root in enumerate(roots):
        with ShmStore.create_or_open_writer(
            root, f"r3-test-dp{i}", layout=LAYOUT, capacity_bytes=1 << 20
        ) as store:
            store.put_blocks(
                full_block_keys(namespace, [b"a" * 32, b"b" * 32][: i + 1]), rows[: 16 * (i + 1)], 0
            )
    collector = StoreCollector()
    for root in [*roots, roots[0]]:
        collector.add_root(root)
    registry = CollectorRegistry()
    registry.register(collector)
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    published = {
        s.labels["store"]: s.value
        for s in families["vllm_artifact_published_objects"].samples
        if s.name.endswith("_total")
    }
    assert published == {"r3-test-dp0": 1.0, "r3-test-dp1": 2.0}
    assert {s.labels["store"] for s in families["vllm_artifact_store_capacity_bytes"].samples} == {
        "r3-test-dp0",
        "r3-test-dp1",
    }
    # The process-wide registration takes any number of roots.
    register_store_metrics(roots[0])
    register_store_metrics(roots[1])
