"""Writer-side counters of one /dev/shm store, readable by other processes (metrics export).

The writer process knows what readers cannot see in the arena: pins, evictions, and how long
publications and reads take. It keeps them in a small file next to the arena (``metrics``,
float64 words) so an exporter in another process (vLLM's API server serving ``/metrics``)
reads them without talking to the engine. One writer per store (flock); each word is written
by one thread (publication by the publishing thread, reads by the step thread), so plain stores
suffice; a reader may see a histogram mid-update, which Prometheus tolerates (counters only
grow).
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_artifact.core.store.shm_root import allocate, open_file, open_root, open_store_dir

__all__ = ["LATENCY_BUCKETS", "METRICS_NAME", "Histogram", "MetricsSnapshot", "StoreMetrics"]

METRICS_NAME = "metrics"
#: Upper bounds (seconds) of the publish and read latency histograms; +Inf is implied.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
_MAGIC = 0x52334D4554524943  # "R3METRIC"
_HIST_BUCKETS = len(LATENCY_BUCKETS) + 1  # finite buckets + Inf
# Layout of the float64 words.
_MAGIC_AT, _OBJECTS, _BYTES, _CAPACITY, _PINNED, _EVICTIONS = range(6)
_PUBLISHED, _READ = 6, 7
_PUBLISH_HIST = 8  # _HIST_BUCKETS bucket counts, then sum, then count
_READ_HIST = _PUBLISH_HIST + _HIST_BUCKETS + 2
_WORDS = _READ_HIST + _HIST_BUCKETS + 2


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (``le`` -> count, last is +Inf), sum and count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float


@dataclass(frozen=True)
class MetricsSnapshot:
    objects: int
    bytes_used: int
    capacity_bytes: int
    pinned_objects: int
    evictions: int
    published_objects: int
    read_objects: int
    publish_seconds: Histogram
    read_seconds: Histogram


class StoreMetrics:
    """The writer's counters, mapped from ``<store dir>/metrics``."""

    def __init__(self, words: np.ndarray, mapping: mmap.mmap | None = None) -> None:
        self._words = words
        self._mapping = mapping

    @classmethod
    def create(cls, fd: int, *, where: str) -> StoreMetrics:
        """Start counting for a writer on the open ``metrics`` file ``fd`` (closed here);
        counters restart with the writer process. The file is allocated before it is mapped:
        a sparse page that /dev/shm cannot back would be a SIGBUS at its first write."""
        try:
            os.ftruncate(fd, 0)
            allocate(fd, _WORDS * 8, what="its metrics file", where=where)
            mapping = mmap.mmap(fd, _WORDS * 8)
        finally:
            os.close(fd)
        words = np.frombuffer(mapping, dtype=np.float64)
        words[_MAGIC_AT] = float(_MAGIC)
        return cls(words, mapping)

    @classmethod
    def create_in(cls, root: str, name: str) -> StoreMetrics:
        """Counters of a store that keeps its objects elsewhere (Mooncake), in
        ``<root>/<name>/metrics`` on the writer's node, where ``/metrics`` reads them."""
        root_fd = open_root(root, create=True)
        try:
            dir_fd = open_store_dir(root_fd, name, create=True, where=root)
        finally:
            os.close(root_fd)
        where = f"{root}/{name}"
        try:
            return cls.create(
                open_file(dir_fd, METRICS_NAME, os.O_RDWR | os.O_CREAT, where=where), where=where
            )
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        """Unmap the file (the writer closes its store); later updates go nowhere."""
        mapping, self._mapping = self._mapping, None
        self._words = np.zeros(_WORDS, dtype=np.float64)
        if mapping is not None:
            # A view still exported: the mapping goes when it is collected.
            with contextlib.suppress(BufferError):
                mapping.close()

    @staticmethod
    def read(store_dir: Path) -> MetricsSnapshot | None:
        """A copy of a store's counters; None if it has none (yet) or they are not ours."""
        try:
            fd = os.open(store_dir / METRICS_NAME, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            raw = os.read(fd, _WORDS * 8)
        finally:
            os.close(fd)
        if len(raw) != _WORDS * 8:
            return None
        words = np.frombuffer(raw, dtype=np.float64)
        if words[_MAGIC_AT] != float(_MAGIC):
            return None
        return MetricsSnapshot(
            objects=int(words[_OBJECTS]),
            bytes_used=int(words[_BYTES]),
            capacity_bytes=int(words[_CAPACITY]),
            pinned_objects=int(words[_PINNED]),
            evictions=int(words[_EVICTIONS]),
            published_objects=int(words[_PUBLISHED]),
            read_objects=int(words[_READ]),
            publish_seconds=_histogram(words, _PUBLISH_HIST),
            read_seconds=_histogram(words, _READ_HIST),
        )

    def set_occupancy(
        self, *, objects: int, bytes_used: int, capacity_bytes: int, pinned: int, evictions: int
    ) -> None:
        words = self._words
        words[_OBJECTS], words[_BYTES], words[_CAPACITY] = objects, bytes_used, capacity_bytes
        words[_PINNED], words[_EVICTIONS] = pinned, evictions

    def observe_publish(self, seconds: float, objects: int) -> None:
        self._words[_PUBLISHED] += objects
        self._observe(_PUBLISH_HIST, seconds)

    def observe_read(self, seconds: float, objects: int) -> None:
        self._words[_READ] += objects
        self._observe(_READ_HIST, seconds)

    def _observe(self, at: int, seconds: float) -> None:
        words = self._words
        # First bound >= seconds. bisect, not np.searchsorted: this runs on every read, also
        # on the engine's step thread, and numpy's search releases the GIL (docs/design.md).
        bucket = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        words[at + bucket] += 1
        words[at + _HIST_BUCKETS] += seconds
        words[at + _HIST_BUCKETS + 1] += 1


def _histogram(words: np.ndarray, at: int) -> Histogram:
    cumulative = np.cumsum(words[at : at + _HIST_BUCKETS])
    bounds = (*LATENCY_BUCKETS, float("inf"))
    return Histogram(
        tuple(zip(bounds, cumulative.tolist(), strict=True)),
        float(words[at + _HIST_BUCKETS]),
        words[at + _HIST_BUCKETS + 1],
    )
