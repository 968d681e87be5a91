"""Prometheus metrics of the Artifact Connector, served on vLLM's own ``/metrics``.

Registered in the process that builds the engine configuration (vLLM's API server for
``vllm serve``), which serves ``/metrics`` from prometheus_client's default registry:

* store gauges and counters (objects, bytes, capacity, pins, evictions, objects published and
  read) and publish/read latency histograms, read at scrape time from each store's
  ``metrics`` file under the artifact root (written by the engine's rank zero, see
  ``core/store/shm_metrics.py``), labelled with the store's name;
* requests failed closed, by reason, counted where the frontend turns them into errors
  (``hooks/request_errors.py``);
* requests whose R3 array the frontend assembled, by how (``hooks/terminal_output.py``):
  whether the fast paths of ``docs/design.md`` are in effect.

Limit: with ``--api-server-count > 1`` vLLM serves metrics in prometheus_client's
multiprocess mode, which does not ask custom collectors; the store metrics are then missing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from vllm_artifact.core.store.shm_metrics import Histogram, StoreMetrics

__all__ = ["FAILED_REQUESTS", "FRONTEND_FILES", "StoreCollector", "register_store_metrics"]

FAILED_REQUESTS = Counter(
    "vllm_artifact_failed_requests",
    "Requests failed closed because their routed experts (R3) could not be delivered completely",
    ["reason"],
)
FRONTEND_FILES = Counter(
    "vllm_artifact_frontend_files",
    "Requests whose R3 array the frontend assembled, by how: adopted (the engine sent the "
    "first rows as their .npy file), copied as they arrived, or concatenated at the end",
    ["how"],
)


class StoreCollector(Collector):
    """Reads the counters of every store under the artifact roots in use, at scrape time."""

    def __init__(self) -> None:
        self._roots: set[Path] = set()
        self._lock = threading.Lock()

    def add_root(self, root: Path) -> None:
        with self._lock:
            self._roots.add(root)

    def _store_dirs(self) -> list[Path]:
        with self._lock:
            roots = sorted(self._roots)
        return [store_dir for root in roots for store_dir in sorted(root.glob("r3-*"))]

    def collect(self) -> Iterator[Metric]:
        families = {
            field: kind(name, doc, labels=["store"]) for field, kind, name, doc in _FAMILIES
        }
        for store_dir in self._store_dirs():
            snapshot = StoreMetrics.read(store_dir)
            if snapshot is None:
                continue
            label = [store_dir.name]
            for field, family in families.items():
                value = getattr(snapshot, field)
                if isinstance(value, Histogram):
                    buckets = [(_le(bound), count) for bound, count in value.buckets]
                    family.add_metric(label, buckets, value.sum)
                else:
                    family.add_metric(label, value)
        yield from families.values()


#: Snapshot field -> (metric kind, name, help); counters get ``_total`` from prometheus_client.
_FAMILIES: tuple[tuple[str, Any, str, str], ...] = (
    ("objects", GaugeMetricFamily, "vllm_artifact_store_objects", "R3 objects in the store"),
    ("bytes_used", GaugeMetricFamily, "vllm_artifact_store_bytes", "Bytes of the slots in use"),
    (
        "capacity_bytes",
        GaugeMetricFamily,
        "vllm_artifact_store_capacity_bytes",
        "Store size (arena file)",
    ),
    (
        "pinned_objects",
        GaugeMetricFamily,
        "vllm_artifact_store_pinned_objects",
        "Objects pinned because the KV cache still holds their block",
    ),
    ("evictions", CounterMetricFamily, "vllm_artifact_store_evictions", "Objects evicted"),
    (
        "published_objects",
        CounterMetricFamily,
        "vllm_artifact_published_objects",
        "Objects published",
    ),
    (
        "read_objects",
        CounterMetricFamily,
        "vllm_artifact_read_objects",
        "Objects read for prefix-cache hits",
    ),
    (
        "publish_seconds",
        HistogramMetricFamily,
        "vllm_artifact_publish_seconds",
        "Time to publish one batch of objects (background thread)",
    ),
    (
        "read_seconds",
        HistogramMetricFamily,
        "vllm_artifact_read_seconds",
        "Time to read one request's prefix-hit objects (checksums verified)",
    ),
)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


_COLLECTOR = StoreCollector()
_registered = False
_register_lock = threading.Lock()


def register_store_metrics(root: Path) -> None:
    """Export the stores under ``root`` on this process's ``/metrics``."""
    global _registered
    _COLLECTOR.add_root(root)
    with _register_lock:
        if not _registered:
            REGISTRY.register(_COLLECTOR)
            _registered = True
