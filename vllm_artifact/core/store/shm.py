"""Same-node shared-memory object store under a private /dev/shm root.

One store = one directory ``<root>/<name>/`` holding ``writer.lock`` (writer
liveness, :mod:`.shm_gc`), ``metrics`` (the writer's counters, :mod:`.shm_metrics`)
and ``arena`` (index, envelopes and payloads, :mod:`.shm_arena`), each allocated
when the writer opens the store (a full /dev/shm is :class:`ShmSpaceError` then,
never SIGBUS later). One writer process owns a store; any process of the same
user on the node opens it read-only by ``(root, name)``.

:class:`ShmStore` is the handle; its work lives in one module per job: reads
(lock-free, seqlock-checked: :mod:`.shm_read`), writes (the publish protocol, writer
only: :mod:`.shm_write`) and recovery (the writer's open, retiring slots, healing the
index: :mod:`.shm_recovery`).

Reopen after a crash: the next writer takes the lock, drops odd/invalid slots,
removes temporary files and rebuilds the index with vectorized numpy passes
(well under a second for a 1M-slot store); checksums are verified lazily on
each read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from vllm_artifact.core.envelope import HeaderWords
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.contract import ObjectStore, PutItem, StoreStats
from vllm_artifact.core.store.shm_arena import ARENA_NAME, Arena, ArenaGeometry, open_arena
from vllm_artifact.core.store.shm_gc import StaleStoreDir, WriterLock, collect_expired_stores
from vllm_artifact.core.store.shm_metrics import METRICS_NAME, StoreMetrics
from vllm_artifact.core.store.shm_read import ScrubReport, StoreReads
from vllm_artifact.core.store.shm_recovery import RecoveryReport, open_writer_arena
from vllm_artifact.core.store.shm_root import (
    _lexical,
    default_root,
    open_file,
    open_root,
    open_store_dir,
)
from vllm_artifact.core.store.shm_slots import SlotTable
from vllm_artifact.core.store.shm_versions import read_weight_versions, record_weight_version
from vllm_artifact.core.store.shm_write import BatchBuilder, PutBatch, StoreWrites
from vllm_artifact.errors import (
    StoreError,
    StoreNotFoundError,
    StoreReadOnlyError,
    WriterConflictError,
)

__all__ = ["RecoveryReport", "ScrubReport", "ShmStore"]

_OPEN_ATTEMPTS = 5


class ShmStore(ObjectStore):
    """Object store backed by one mmap'd arena under /dev/shm (see module doc)."""

    writes_local_memory = True
    reads_envelopes = True

    def __init__(
        self,
        *,
        root: str,
        name: str,
        arena: Arena,
        lock: WriterLock | None,
        recovery: RecoveryReport | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.root = root
        self.name = name
        self._lock = lock
        self._slots = SlotTable(arena.geometry.slot_count) if lock is not None else None
        self._metrics = metrics  # the writer's counters (metrics export)
        self._reads = StoreReads(arena, f"{root}/{name}", slots=self._slots, metrics=metrics)
        self._writes: StoreWrites | None = None
        if self._slots is not None:
            self._slots.adopt(arena.published())  # none pinned or referenced yet
            self._writes = StoreWrites(self._reads, self._slots)
        self._mutex = threading.RLock()
        self.recovery = recovery

    # ------------------------------------------------------------------ opening

    @classmethod
    def create_or_open_writer(
        cls,
        root: str | os.PathLike[str] | None,
        name: str,
        *,
        layout: R3Layout,
        capacity_bytes: int,
        ttl_seconds: float = 3600.0,
        collect_expired: bool = True,
    ) -> ShmStore:
        """Open ``root/name`` as its single writer, creating or recovering it.

        ``capacity_bytes`` bounds the arena file. An existing arena with the
        same layout and capacity is recovered (its objects stay readable after
        an engine restart); otherwise it is replaced. With
        ``collect_expired``, stores of dead writers idle for more than
        ``ttl_seconds`` are removed first.
        """
        root_path = _lexical(default_root() if root is None else root)
        geometry = ArenaGeometry.for_capacity(layout, capacity_bytes)
        where = f"{root_path}/{name}"
        for attempt in range(_OPEN_ATTEMPTS):
            if collect_expired and attempt == 0:
                collect_expired_stores(root_path, ttl_seconds)
            root_fd = open_root(root_path, create=True)
            try:
                dir_fd = open_store_dir(root_fd, name, create=True, where=root_path)
                try:
                    try:
                        lock = WriterLock.acquire(root_fd, dir_fd, name, where=where)
                    except StaleStoreDir:
                        continue
                    except WriterConflictError:
                        if attempt == _OPEN_ATTEMPTS - 1:
                            raise
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    try:
                        # The small metrics file first: the arena's space check then counts
                        # what is really left for the arena.
                        metrics = StoreMetrics.create(
                            open_file(dir_fd, METRICS_NAME, os.O_RDWR | os.O_CREAT, where=where),
                            where=where,
                        )
                        arena, recovery = open_writer_arena(dir_fd, geometry, root_path, where)
                    except BaseException:
                        lock.release()
                        raise
                finally:
                    os.close(dir_fd)
            finally:
                os.close(root_fd)
            store = cls(
                root=root_path,
                name=name,
                arena=arena,
                lock=lock,
                recovery=recovery,
                metrics=metrics,
            )
            store._count_occupancy()
            return store
        raise StoreError(f"could not open R3 store {where!r}: it kept being replaced")

    @classmethod
    def open_reader(cls, root: str | os.PathLike[str] | None, name: str) -> ShmStore:
        """Open ``root/name`` read-only (any process of the same user)."""
        root_path = _lexical(default_root() if root is None else root)
        root_fd = open_root(root_path, create=False)
        try:
            dir_fd = open_store_dir(root_fd, name, create=False, where=root_path)
            try:
                try:
                    arena = open_arena(dir_fd, writable=False, where=f"{root_path}/{name}")
                except FileNotFoundError:
                    raise StoreNotFoundError(
                        f"R3 store {root_path}/{name} has no arena yet; its writer is starting "
                        "or failed"
                    ) from None
            finally:
                os.close(dir_fd)
        finally:
            os.close(root_fd)
        return cls(root=root_path, name=name, arena=arena, lock=None)

    # ------------------------------------------------------------------- basics

    @property
    def layout(self) -> R3Layout:
        return self._reads.layout

    @property
    def writable(self) -> bool:
        return self._lock is not None

    @property
    def geometry(self) -> ArenaGeometry:
        return self._live().geometry

    def is_current(self) -> bool:
        """Whether ``root/name/arena`` is still the file this handle maps (False once the
        store was removed or replaced: a reader should drop the handle, which keeps the old
        file's memory allocated)."""
        try:
            file_stat = os.stat(f"{self.root}/{self.name}/{ARENA_NAME}", follow_symlinks=False)
        except OSError:
            return False
        return (file_stat.st_dev, file_stat.st_ino) == self._live().file_id

    def _live(self) -> Arena:
        return self._reads.live()

    def _writer(self) -> StoreWrites:
        """The write path, once this handle is known to own the store."""
        self._live()
        lock = self._lock
        if lock is not None and not lock.held:
            why = "is a fork of the store's writer" if lock.forked else "lost its writer lock"
            raise StoreReadOnlyError(
                f"R3 store {self.root}/{self.name}: this process {why} and does not own the "
                "store; only the writer process may publish or pin (reads work)"
            )
        if self._writes is None:
            raise StoreReadOnlyError(
                f"R3 store {self.root}/{self.name} is open read-only; only its writer "
                "(the engine's global rank zero) may publish or pin"
            )
        return self._writes

    def close(self) -> None:
        with self._mutex:
            if self._reads.closed:
                return
            self._reads.close()
            if self._metrics is not None:
                self._metrics.close()
            if self._lock is not None:
                self._lock.heartbeat(force=True)
                self._lock.release()

    def stats(self) -> StoreStats:
        with self._mutex:
            geometry = self._live().geometry
            if self._slots is not None:
                objects = self._slots.objects
                pinned = self._slots.pinned
                evictions = self._slots.evictions
            else:
                objects = int(np.count_nonzero(self._live().published()))
                pinned = evictions = 0
            return StoreStats(
                objects=objects,
                bytes_used=objects * geometry.slot_nbytes,
                capacity_bytes=geometry.file_nbytes,
                capacity_objects=geometry.slot_count,
                pinned_objects=pinned,
                evictions=evictions,
                writable=self.writable,
            )

    def _count_occupancy(self) -> None:
        """Refresh the writer's exported occupancy gauges (after puts and pin changes; the
        slot table keeps its counts up to date, so this is a few word stores)."""
        if self._metrics is None or self._slots is None:
            return
        stats = self.stats()
        self._metrics.set_occupancy(
            objects=stats.objects,
            bytes_used=stats.bytes_used,
            capacity_bytes=stats.capacity_bytes,
            pinned=stats.pinned_objects,
            evictions=stats.evictions,
        )

    def record_weight_version(self, version: str) -> None:
        """Record that objects are keyed under ``version`` from now on (writer only), so an
        engine that misses them can name the version they are under (:mod:`.shm_versions`)."""
        with self._mutex:
            self._writer()
            record_weight_version(self.root, self.name, version)

    def weight_versions(self) -> tuple[str, ...]:
        """The weight versions the store's writer recorded, oldest first."""
        return read_weight_versions(self.root, self.name)

    def heartbeat(self) -> None:
        """Refresh the writer's liveness marker (also done on every put)."""
        if self._lock is not None:
            self._lock.heartbeat(force=True)

    # ------------------------------------------------------------------ reading

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        with self._mutex:
            return [bool(x) for x in self._reads.locate(keys_to_words(keys)).present.tolist()]

    def envelope_checksums(self, keys: Sequence[ObjectKey]) -> list[int] | None:
        # No mutex, as for reads: the seqlock check in locate() stands in for it.
        if not keys:
            return []
        located = self._reads.locate(keys_to_words(keys))
        if not located.present.all():
            return None
        sums: list[int] = located.words[:, HeaderWords.CSUM].tolist()
        return sums

    def envelope_of(self, key: ObjectKey) -> np.void | None:
        """The envelope copy of ``key`` (inspection/tests), or None if absent."""
        with self._mutex:
            located = self._reads.locate(keys_to_words([key]))
            return located.headers[0] if located.present[0] or located.corrupt[0] else None

    def read_into(
        self, keys: Sequence[ObjectKey], out: np.ndarray, *, token_start: int = 0
    ) -> np.ndarray:
        # No mutex for reads (here and in get): the seqlock and checksums that make reads in
        # other processes safe against a concurrent writer do the same for this process's
        # publishing thread, and waiting on its mutex would hand it the GIL for a whole switch
        # interval (milliseconds on the engine's step path).
        return self._reads.read_into(keys, out, token_start)

    def get(self, keys: Sequence[ObjectKey]) -> list[np.ndarray]:
        return self._reads.get(keys)

    def scrub(self) -> ScrubReport:
        """Read back every published object with the full read checks (an ``fsck``: after a
        crash, or on suspicion of damage). Works on a reader or the writer; objects replaced
        while it runs are skipped."""
        return self._reads.scrub()

    # ----------------------------------------------------------------- writing

    def put(
        self, items: Sequence[PutItem | tuple[ObjectKey, np.ndarray, int]], *, pin: bool = True
    ) -> None:
        if not items:
            return
        with self._mutex:
            self._writer()
            builder = BatchBuilder(self.layout)
            for key, rows, token_start in items:
                builder.add_object(key, rows, token_start)
            batch = builder.build()
            if batch is not None:
                self._put_batch(batch, pin)

    def put_blocks(
        self, keys: Sequence[ObjectKey], rows: np.ndarray, token_start: int, *, pin: bool = True
    ) -> None:
        """Fast path: publish consecutive blocks of one contiguous rows array.

        ``rows[i*bs:(i+1)*bs]`` is the object of ``keys[i]``; the last object
        may be shorter (a terminal tail). Validation and payload copies are
        done once for the whole array instead of per object.
        """
        self.put_runs([(keys, rows, token_start)], pin=pin)

    def put_runs(
        self,
        runs: Sequence[tuple[Sequence[ObjectKey], np.ndarray, int]],
        *,
        pin: bool = True,
    ) -> None:
        """Fast path for several runs: each run's rows are checked once (not per block, as
        :meth:`put` would), and all blocks go through one lookup and one index update."""
        builder = BatchBuilder(self.layout)
        for keys, rows, token_start in runs:
            builder.add_run(keys, rows, token_start)
        batch = builder.build()
        if batch is None:
            return
        with self._mutex:
            self._writer()
            self._put_batch(batch, pin)

    def _put_batch(self, batch: PutBatch, pin: bool) -> None:
        writes = self._writer()
        started = time.perf_counter()
        try:
            writes.put(batch, pin)
        finally:
            # Also after a failed put: it may have evicted victims.
            self._count_occupancy()
        if self._lock is not None:
            self._lock.heartbeat()
        if self._metrics is not None:
            self._metrics.observe_publish(time.perf_counter() - started, len(batch.keys))

    def pin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        with self._mutex:
            table = self._writer().table
            located = self._reads.locate(keys_to_words(keys))
            table.pin(located.slots[located.present])
            self._count_occupancy()
            return [bool(x) for x in located.present.tolist()]

    def unpin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        with self._mutex:
            table = self._writer().table
            located = self._reads.locate(keys_to_words(keys))
            result = np.zeros(len(keys), dtype=bool)
            idx = np.flatnonzero(located.present)
            result[idx] = table.unpin(located.slots[idx])
            self._count_occupancy()
            return [bool(x) for x in result.tolist()]
