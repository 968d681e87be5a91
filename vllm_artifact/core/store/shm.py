"""Same-node shared-memory object store under a private /dev/shm root.

One store = one directory ``<root>/<name>/`` holding ``writer.lock`` (writer
liveness, :mod:`.shm_gc`), ``metrics`` (the writer's counters, :mod:`.shm_metrics`)
and ``arena`` (index, envelopes and payloads, :mod:`.shm_arena`), each allocated
when the writer opens the store (a full /dev/shm is :class:`ShmSpaceError` then,
never SIGBUS later). One writer process owns a store; any process of the same
user on the node opens it read-only by ``(root, name)``.

Publish protocol (per slot, a seqlock; crash-safe and lock-free for readers):

1. if the slot held an evicted object, remove its index entry;
2. ``seq |= 1`` (odd: "being written"); readers skip the slot;
3. write payload, then envelope fields and checksum;
4. ``seq += 1`` (even: published);
5. insert the key -> slot index entry.

A reader looks the key up in the index, reads ``seq``, copies the envelope and
the payload, verifies key, envelope and the xxh3 checksum *on the bytes it
copied*, then re-reads ``seq``: if it changed, the slot was reused during the
read and the read is retried (and reported missing if the object is gone).
A writer killed at any point leaves slots with an odd ``seq`` (invisible to
readers, dropped by the next writer) or complete objects (kept); never a
visible half-written object. A publication that raises (any exception,
KeyboardInterrupt too) is undone before the exception propagates: its slots are
unindexed, retired with an even ``seq`` and freed, so a put that raised stored
nothing new.

Reopen after a crash: the next writer takes the lock, drops odd/invalid slots,
removes temporary files and rebuilds the index with vectorized numpy passes
(well under a second for a 1M-slot store); checksums are verified lazily on
each read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_artifact.core.envelope import HeaderWords, checksum, header_problems
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.contract import ObjectStore, PutItem, StoreStats
from vllm_artifact.core.store.shm_arena import (
    ARENA_NAME,
    TMP_PREFIX,
    Arena,
    ArenaGeometry,
    create_arena,
    open_arena,
)
from vllm_artifact.core.store.shm_gc import StaleStoreDir, WriterLock, collect_expired_stores
from vllm_artifact.core.store.shm_index import BUCKET_WAYS, HashIndex
from vllm_artifact.core.store.shm_metrics import METRICS_NAME, StoreMetrics
from vllm_artifact.core.store.shm_root import (
    _lexical,
    check_shm_space,
    default_root,
    open_file,
    open_root,
    open_store_dir,
)
from vllm_artifact.core.store.shm_slots import SlotTable
from vllm_artifact.errors import (
    CapacityError,
    InternalError,
    KeyCollisionError,
    ObjectCorruptError,
    ObjectMissingError,
    SchemaError,
    StoreClosedError,
    StoreError,
    StoreFormatError,
    StoreNotFoundError,
    StoreReadOnlyError,
    WriterConflictError,
)

__all__ = ["RecoveryReport", "ScrubReport", "ShmStore"]

logger = logging.getLogger(__name__)

_READ_ATTEMPTS = 4
_OPEN_ATTEMPTS = 5
#: numpy keeps the GIL in fancy indexing of at most this many items and releases it above
#: (measured, numpy 2.3: 500 slots keep it, 501 release it); ``np.take`` always releases it.
_GIL_KEEPING_ITEMS = 500


@dataclass(frozen=True)
class RecoveryReport:
    """What a writer found when it opened a store."""

    recreated: bool
    reason: str
    objects: int
    dropped_partial: int
    dropped_invalid: int


@dataclass(frozen=True)
class ScrubReport:
    """Objects that read back intact, and keys of those that failed their checks."""

    checked: int
    corrupt: tuple[ObjectKey, ...]


@dataclass
class _Located:
    """Result of locating keys: slot per key plus its envelope snapshot."""

    slots: np.ndarray  # int64, -1 where not found
    seq: np.ndarray  # seq read before the envelope copy
    words: np.ndarray  # envelope copies as [n, 8] uint64 words (HeaderWords)
    present: np.ndarray  # key found, published, envelope valid
    corrupt: np.ndarray  # key found and published, envelope fields invalid
    unstable: np.ndarray  # key found but the slot is being rewritten

    @property
    def headers(self) -> np.ndarray:
        """The envelope copies as a ``HEADER_DTYPE`` array (a view)."""
        return HeaderWords.as_headers(self.words)


class _Batch:
    """A validated put batch: keys, payload bytes, token starts and counts.

    Either ``srcs`` lists one buffer per object (``put``), or ``whole`` holds
    all payloads back to back, ``step`` bytes each but the last
    (``put_blocks``): then no per-object view exists until one is needed.
    """

    def __init__(
        self,
        keys: list[ObjectKey],
        starts: np.ndarray,
        n_tokens: np.ndarray,
        *,
        srcs: list[memoryview] | None = None,
        whole: memoryview | None = None,
        step: int = 0,
    ) -> None:
        self.keys = keys
        self.starts = starts  # uint64
        self.n_tokens = n_tokens  # int64
        self.srcs = srcs
        self.whole = whole
        self.step = step

    def src(self, i: int) -> memoryview:
        if self.srcs is not None:
            return self.srcs[i]
        whole = self._whole()
        a = i * self.step
        return whole[a : min(a + self.step, len(whole))]

    def src_views(self, idx: np.ndarray) -> Iterator[memoryview]:
        """Payload views of objects ``idx`` (made at C speed for put_blocks)."""
        if self.srcs is not None:
            return map(self.srcs.__getitem__, idx.tolist())
        whole = self._whole()
        a = idx.astype(np.int64) * self.step
        e = np.minimum(a + self.step, len(whole))
        return map(whole.__getitem__, map(slice, a.tolist(), e.tolist()))

    def _whole(self) -> memoryview:
        if self.whole is None:
            raise InternalError("a put batch has neither per-object payloads nor a whole run")
        return self.whole

    def deduplicated(self) -> _Batch:
        """Drop repeated keys; a repeat with other content is a collision."""
        first: dict[bytes, int] = {}
        keep: list[int] = []
        for i, k in enumerate(self.keys):
            j = first.setdefault(k, i)
            if j == i:
                keep.append(i)
            elif self.starts[i] != self.starts[j] or bytes(self.src(i)) != bytes(self.src(j)):
                raise KeyCollisionError(
                    f"R3 key {bytes(k).hex()} appears twice in one batch with different "
                    "content; keys must identify content"
                )
        return _Batch(
            [self.keys[i] for i in keep],
            self.starts[keep],
            self.n_tokens[keep],
            srcs=[self.src(i) for i in keep],
        )


class ShmStore(ObjectStore):
    """Object store backed by one mmap'd arena under /dev/shm (see module doc)."""

    def __init__(
        self,
        *,
        root: str,
        name: str,
        arena: Arena,
        lock: WriterLock | None,
        recovery: RecoveryReport | None = None,
    ) -> None:
        self.root = root
        self.name = name
        self._arena: Arena | None = arena
        self._layout = arena.geometry.layout
        self._index = HashIndex(arena.index_table)
        self._hw = HeaderWords(self._layout)
        self._lock = lock
        self._slots = SlotTable(arena.geometry.slot_count) if lock is not None else None
        self._stride = arena.geometry.slot_nbytes
        self._mutex = threading.RLock()
        self.recovery = recovery
        self._metrics: StoreMetrics | None = None  # the writer's counters (metrics export)

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
                        arena, recovery = cls._open_writer_arena(dir_fd, geometry, root_path, where)
                    except BaseException:
                        lock.release()
                        raise
                finally:
                    os.close(dir_fd)
            finally:
                os.close(root_fd)
            store = cls(root=root_path, name=name, arena=arena, lock=lock, recovery=recovery)
            store._adopt()
            store._metrics = metrics
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

    @staticmethod
    def _open_writer_arena(
        dir_fd: int, geometry: ArenaGeometry, root: str, where: str
    ) -> tuple[Arena, RecoveryReport]:
        for entry in os.scandir(dir_fd):
            if entry.name.startswith(TMP_PREFIX):
                os.unlink(entry.name, dir_fd=dir_fd)  # an interrupted creation
        reason = "new store"
        try:
            arena = open_arena(dir_fd, writable=True, where=where)
        except FileNotFoundError:
            pass
        except StoreFormatError as err:
            reason = f"unreadable arena replaced ({err})"
        else:
            if arena.geometry == geometry:
                dropped = _recover(arena)
                return arena, RecoveryReport(False, "reopened", *dropped)
            reason = "layout or capacity changed; old objects dropped"
            arena.close()
        if reason != "new store":
            # Unlinked before the new one is allocated: a store that changes capacity needs
            # room for the new arena only. (Its pages are freed once no reader maps it; the
            # space check below sees what is really free.)
            os.unlink(ARENA_NAME, dir_fd=dir_fd)
        check_shm_space(root, geometry.file_nbytes)
        arena = create_arena(dir_fd, geometry, where=where)
        logger.info("R3 store %s: created arena (%s)", where, reason)
        return arena, RecoveryReport(True, reason, 0, 0, 0)

    def _adopt(self) -> None:
        """Load writer bookkeeping from the (recovered) envelopes."""
        arena, slots_tab = self._writer()
        slots_tab.adopt((arena.headers["magic"] != 0) & ((arena.seq & np.uint64(1)) == 0))

    # ------------------------------------------------------------------- basics

    @property
    def layout(self) -> R3Layout:
        return self._layout

    @property
    def writable(self) -> bool:
        return self._lock is not None

    @property
    def geometry(self) -> ArenaGeometry:
        return self._live().geometry

    def _live(self) -> Arena:
        arena = self._arena
        if arena is None:
            raise StoreClosedError(f"R3 store {self.root}/{self.name} handle is closed")
        return arena

    def _writer(self) -> tuple[Arena, SlotTable]:
        arena = self._live()
        lock = self._lock
        if lock is not None and not lock.held:
            why = "is a fork of the store's writer" if lock.forked else "lost its writer lock"
            raise StoreReadOnlyError(
                f"R3 store {self.root}/{self.name}: this process {why} and does not own the "
                "store; only the writer process may publish or pin (reads work)"
            )
        if self._slots is None:
            raise StoreReadOnlyError(
                f"R3 store {self.root}/{self.name} is open read-only; only its writer "
                "(the engine's global rank zero) may publish or pin"
            )
        return arena, self._slots

    def close(self) -> None:
        with self._mutex:
            arena, self._arena = self._arena, None
            if arena is None:
                return
            # The index views the mapping too: drop it, or the unmap waits for the collector
            # (and the old arena's pages stay allocated after a replace in this process).
            self._index = HashIndex(np.zeros((1, BUCKET_WAYS), dtype="<u8"))
            arena.close()
            if self._metrics is not None:
                self._metrics.close()
            if self._lock is not None:
                self._lock.heartbeat(force=True)
                self._lock.release()

    def stats(self) -> StoreStats:
        with self._mutex:
            arena = self._live()
            g = arena.geometry
            if self._slots is not None:
                objects = self._slots.objects
                pinned = self._slots.pinned
                evictions = self._slots.evictions
            else:
                objects = int(
                    np.count_nonzero(
                        (arena.headers["magic"] != 0) & ((arena.seq & np.uint64(1)) == 0)
                    )
                )
                pinned = evictions = 0
            return StoreStats(
                objects=objects,
                bytes_used=objects * g.slot_nbytes,
                capacity_bytes=g.file_nbytes,
                capacity_objects=g.slot_count,
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

    def heartbeat(self) -> None:
        """Refresh the writer's liveness marker (also done on every put)."""
        if self._lock is not None:
            self._lock.heartbeat(force=True)

    # ----------------------------------------------------------------- locating

    def _locate(self, words: np.ndarray) -> _Located:
        """Slots and envelope snapshots of keys, vectorized over the batch (for up to 248 keys
        without releasing the GIL, like :meth:`HashIndex.probe`)."""
        arena = self._live()
        n = len(words)
        owners, candidates = self._index.probe(words)
        slots = np.full(n, -1, dtype=np.int64)
        if not len(owners):  # the usual put: every key is new (no entry carries its tag)
            none = np.zeros(n, dtype=bool)
            return _Located(
                slots=slots,
                seq=np.zeros(n, dtype=np.uint64),
                words=np.zeros((n, 8), dtype=np.uint64),
                present=none,
                corrupt=none,
                unstable=none,
            )
        first = np.ones(len(owners), dtype=bool)  # each key's first candidate
        np.not_equal(owners[1:], owners[:-1], out=first[1:])
        slots[owners[first]] = candidates[first]
        n_slots = len(arena.seq)
        found = (slots >= 0) & (slots < n_slots)  # damaged entry: missing
        slots[~found] = -1
        safe = np.where(found, slots, 0)
        seq = arena.seq[safe]  # seqlock: read seq, then copy the envelope
        env = arena.header_items[safe].view("<u8").reshape(n, 8)  # the envelopes
        keyok = found & (env[:, 1] == words[:, 0]) & (env[:, 2] == words[:, 1])
        if len(owners) > np.count_nonzero(first) and not keyok.all():
            # Rare: a key with several candidates, and the first is another key's (same tag)
            # or a damaged entry.
            all_words = arena.words
            several = np.flatnonzero(np.bincount(owners, minlength=n) > 1)
            for i in several[~keyok[several]].tolist():
                for s in candidates[owners == i].tolist():
                    if (
                        0 <= s < n_slots
                        and int(all_words[s, 1]) == int(words[i, 0])
                        and int(all_words[s, 2]) == int(words[i, 1])
                    ):
                        slots[i], seq[i] = s, all_words[s, 0]
                        env[i] = all_words[s]
                        keyok[i] = True
                        break
        slots[~keyok] = -1
        stable = keyok & ((seq & np.uint64(1)) == 0) & (seq > 0) & (env[:, 0] == seq)
        problems = self._hw.problems(env)
        return _Located(
            slots=slots,
            seq=seq,
            words=env,
            present=stable & ~problems,
            corrupt=stable & problems,
            unstable=keyok & ~stable,
        )

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        with self._mutex:
            return [bool(x) for x in self._locate(keys_to_words(keys)).present.tolist()]

    def envelope_of(self, key: ObjectKey) -> np.void | None:
        """The envelope copy of ``key`` (inspection/tests), or None if absent."""
        with self._mutex:
            loc = self._locate(keys_to_words([key]))
            return loc.headers[0] if loc.present[0] or loc.corrupt[0] else None

    # ------------------------------------------------------------------ reading

    def _missing(self, keys: Sequence[ObjectKey], mask: np.ndarray, why: str) -> ObjectMissingError:
        idx = np.flatnonzero(mask)
        g = self._live().geometry
        evicted = f", {self._slots.evictions} evicted so far" if self._slots is not None else ""
        return ObjectMissingError(
            f"{len(idx)} of {len(keys)} R3 objects are not in store {self.root}/{self.name} "
            f"(first: key {keys[int(idx[0])].hex()}, {why}). The store holds at most "
            f"{g.slot_count} blocks ({g.file_nbytes / 2**20:.0f} MiB{evicted}); objects the "
            "KV cache can still hit must fit. Increase --artifact-capacity."
        )

    def _corrupt(self, keys: Sequence[ObjectKey], mask: np.ndarray, why: str) -> ObjectCorruptError:
        idx = np.flatnonzero(mask)
        return ObjectCorruptError(
            f"{len(idx)} of {len(keys)} R3 objects in store {self.root}/{self.name} failed "
            f"validation (first: key {keys[int(idx[0])].hex()}: {why}); the request fails "
            "closed. Republishing the block replaces a corrupt object; if this repeats, "
            "check the host's memory and that nothing else writes under the store root."
        )

    def _read(self, keys: Sequence[ObjectKey], dest: _Dest) -> None:
        """Locate, copy and verify ``keys`` into ``dest`` (seqlock-retrying)."""
        started = time.perf_counter()
        words = keys_to_words(keys)
        suspicious = False
        row_nbytes = self._layout.row_nbytes
        for _ in range(_READ_ATTEMPTS):
            loc = self._locate(words)
            if not loc.present.all():
                if (~loc.present & ~loc.corrupt & ~loc.unstable).any():
                    raise self._missing(
                        keys,
                        ~loc.present & ~loc.corrupt & ~loc.unstable,
                        "evicted or never published",
                    )
                if loc.unstable.any():
                    time.sleep(0.0005)
                    continue
                raise self._corrupt(keys, loc.corrupt, "envelope does not match the layout")
            n_tokens = HeaderWords.n_tokens(loc.words)
            out, dst = dest.prepare(n_tokens, loc.words[:, HeaderWords.START])
            nbytes = n_tokens * row_nbytes
            self._copy(loc.slots, nbytes, out, dst)
            bad = _verify(out, dst, nbytes, loc.words, self._hw)
            changed = self._live().seq[loc.slots] != loc.seq
            if changed.any():
                continue  # slot reused while we read: look the keys up again
            if bad is not None:
                if suspicious:
                    raise self._corrupt(keys, bad, "checksum mismatch")
                suspicious = True  # a write may not be visible yet on weakly ordered CPUs
                time.sleep(0.001)
                continue
            if self._slots is not None:
                self._slots.touch(loc.slots)
            if self._metrics is not None:
                self._metrics.observe_read(time.perf_counter() - started, len(keys))
            return
        raise self._missing(keys, np.ones(len(keys), dtype=bool), "replaced while being read")

    def _copy(
        self, slots: np.ndarray, nbytes: np.ndarray, out: memoryview, dst: np.ndarray
    ) -> None:
        """Copy payloads into ``out`` (destinations are back to back): the leading whole
        blocks with one gather, the rest (a tail object) range by range."""
        arena = self._live()
        slot_nbytes = arena.geometry.slot_nbytes
        is_whole = nbytes == slot_nbytes
        whole = len(slots) if is_whole.all() else int(np.argmin(is_whole))
        if whole > 1 and int(dst[whole - 1]) == int(dst[0]) + (whole - 1) * slot_nbytes:
            blocks = np.frombuffer(
                out, dtype=np.uint8, count=whole * slot_nbytes, offset=int(dst[0])
            ).reshape(whole, slot_nbytes)
            if whole <= _GIL_KEEPING_ITEMS:
                # A prefix hit on the engine's step thread: a copy that keeps the GIL, so the
                # thread does not wait for the publisher to hand it back (up to the switch
                # interval, 5 ms). One temporary, of a few MiB at most.
                blocks.view(arena.payload_items.dtype)[:, 0] = arena.payload_items[slots[:whole]]
            else:
                # mode="clip": no bounds-check buffering (``_locate`` returns slots in range)
                np.take(arena.payload_blocks, slots[:whole], axis=0, out=blocks, mode="clip")
        else:
            whole = 0
        payload = arena.payload
        for slot, size, at in zip(
            slots[whole:].tolist(), nbytes[whole:].tolist(), dst[whole:].tolist(), strict=True
        ):
            start = slot * slot_nbytes
            out[at : at + size] = payload[start : start + size]

    def read_into(
        self, keys: Sequence[ObjectKey], out: np.ndarray, *, token_start: int = 0
    ) -> None:
        lay = self._layout
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != lay.dtype
            or out.ndim != 3
            or (
                out.shape[1:] != lay.row_shape
                or not out.flags.c_contiguous
                or not out.flags.writeable
            )
        ):
            raise SchemaError(
                f"read_into needs a writable C-contiguous {lay.dtype} array [tokens, "
                f"{lay.num_layers}, {lay.top_k}]"
            )
        if not keys:
            if len(out):
                raise SchemaError(f"no keys given for {len(out)} rows")
            return
        # No mutex for reads (here and in get): the seqlock and checksums that make reads in
        # other processes safe against a concurrent writer do the same for this process's
        # publishing thread, and waiting on its mutex would hand it the GIL for a whole switch
        # interval (milliseconds on the engine's step path).
        self._read(keys, _IntoDest(self, keys, out, token_start))

    def get(self, keys: Sequence[ObjectKey]) -> list[np.ndarray]:
        if not keys:
            return []
        dest = _FreshDest(self._layout)
        self._read(keys, dest)
        return dest.arrays()

    def scrub(self) -> ScrubReport:
        """Read back every published object with the full read checks (an ``fsck``: after a
        crash, or on suspicion of damage). Works on a reader or the writer; objects replaced
        while it runs are skipped."""
        arena = self._live()
        words = arena.words
        seq = words[:, HeaderWords.SEQ]
        published = np.flatnonzero(
            (seq & np.uint64(1) == 0) & (seq > 0) & (words[:, 1:3] != 0).any(axis=1)
        )
        keys = [ObjectKey(bytes(key)) for key in words[published, 1:3].astype("<u8")]
        checked, corrupt = 0, []
        for key in keys:
            try:
                self.get([key])
                checked += 1
            except ObjectCorruptError:
                corrupt.append(key)
            except ObjectMissingError:
                pass  # evicted or replaced since the scan
        return ScrubReport(checked=checked, corrupt=tuple(corrupt))

    # ----------------------------------------------------------------- writing

    def put(
        self, items: Sequence[PutItem | tuple[ObjectKey, np.ndarray, int]], *, pin: bool = True
    ) -> None:
        if not items:
            return
        with self._mutex:
            self._writer()
            self._put_batch(self._check_items(items), pin)

    def put_blocks(
        self, keys: Sequence[ObjectKey], rows: np.ndarray, token_start: int, *, pin: bool = True
    ) -> None:
        """Fast path: publish consecutive blocks of one contiguous rows array.

        ``rows[i*bs:(i+1)*bs]`` is the object of ``keys[i]``; the last object
        may be shorter (a terminal tail). Validation and payload copies are
        done once for the whole array instead of per object.
        """
        if not keys:
            return
        lay = self._layout
        bs = lay.block_size
        rows = self._check_run(keys, rows, token_start)
        n = len(keys)
        n_tokens = np.full(n, bs, dtype=np.int64)
        n_tokens[-1] = len(rows) - (n - 1) * bs
        batch = _Batch(
            list(keys),
            np.arange(token_start, token_start + n * bs, bs, dtype=np.uint64),
            n_tokens,
            whole=rows.data.cast("B"),
            step=bs * lay.row_nbytes,
        )
        if len(set(batch.keys)) != n:
            batch = batch.deduplicated()
        with self._mutex:
            self._writer()
            self._put_batch(batch, pin)

    def put_runs(
        self,
        runs: Sequence[tuple[Sequence[ObjectKey], np.ndarray, int]],
        *,
        pin: bool = True,
    ) -> None:
        """Fast path for several runs: each run's rows are checked once (not per block, as
        :meth:`put` would), and all blocks go through one lookup and one index update."""
        bs = self._layout.block_size
        step = bs * self._layout.row_nbytes
        keys: list[ObjectKey] = []
        srcs: list[memoryview] = []
        starts: list[int] = []
        counts: list[int] = []
        for run_keys, rows, token_start in runs:
            if not run_keys:
                continue
            rows = self._check_run(run_keys, rows, token_start)
            n = len(run_keys)
            whole = rows.data.cast("B")
            keys.extend(run_keys)
            srcs.extend(whole[a : a + step] for a in range(0, n * step, step))
            starts.extend(range(token_start, token_start + n * bs, bs))
            counts.extend([bs] * (n - 1))
            counts.append(len(rows) - (n - 1) * bs)
        if not keys:
            return
        batch = _Batch(
            keys, np.array(starts, dtype=np.uint64), np.array(counts, dtype=np.int64), srcs=srcs
        )
        if len(set(keys)) != len(keys):
            batch = batch.deduplicated()
        with self._mutex:
            self._writer()
            self._put_batch(batch, pin)

    def _check_run(
        self, keys: Sequence[ObjectKey], rows: np.ndarray, token_start: int
    ) -> np.ndarray:
        """The rows of a run of ``len(keys)`` consecutive blocks from ``token_start``, checked
        against the layout (C-contiguous, so that their bytes can be sliced per block)."""
        bs = self._layout.block_size
        rows = self._layout.check_rows(rows)
        n = len(keys)
        if not (n - 1) * bs < len(rows) <= n * bs:
            raise SchemaError(f"{len(rows)} rows do not fill {n} blocks of {bs} tokens")
        if type(token_start) is not int or token_start < 0 or token_start % bs:
            raise SchemaError(f"token_start={token_start!r} is not a block boundary ({bs})")
        return rows

    def _put_batch(self, batch: _Batch, pin: bool) -> None:
        started = time.perf_counter()
        try:
            self._put_batch_untimed(batch, pin)
        finally:
            # Also after a failed put: it may have evicted victims.
            self._count_occupancy()
        if self._metrics is not None:
            self._metrics.observe_publish(time.perf_counter() - started, len(batch.keys))

    def _put_batch_untimed(self, batch: _Batch, pin: bool) -> None:
        _, slots_tab = self._writer()
        words = keys_to_words(batch.keys)
        loc = self._locate(words)
        found = loc.present | loc.corrupt | loc.unstable
        drop: list[int] = []
        if found.any():
            self._check_republished(batch, loc, np.flatnonzero(found), drop)
        if drop:
            d = np.array(drop, dtype=np.int64)
            self._index.remove(words[d], loc.slots[d])
            self._mark_empty(loc.slots[d])
            slots_tab.release(loc.slots[d])
            found[d] = False
        kept = loc.slots[found]
        published = self._publish(words, batch, np.flatnonzero(~found), kept)
        try:
            if pin:  # one slot per distinct key of the (deduplicated) batch
                slots_tab.pin(np.concatenate((kept, published)), distinct=True)
        except BaseException:
            self._abandon(published)  # a put that raises stores nothing new
            raise
        slots_tab.touch(kept)
        if self._lock is not None:
            self._lock.heartbeat()

    def _check_republished(
        self, batch: _Batch, loc: _Located, found_idx: np.ndarray, drop: list[int]
    ) -> None:
        """Keys already stored: accept identical content, collect corrupt or
        half-written leftovers in ``drop`` (replaced), raise on a collision."""
        payload, stride = self._live().payload, self._stride
        env = loc.words[found_idx]
        present = loc.present[found_idx].tolist()
        same_range = (
            (env[:, HeaderWords.START] == batch.starts[found_idx])
            & (HeaderWords.n_tokens(env) == batch.n_tokens[found_idx])
        ).tolist()
        seeds = self._hw.seeds(env)  # meaningful where present (format checked)
        sums = env[:, HeaderWords.CSUM].tolist()
        nbytes = (HeaderWords.n_tokens(env) * self._layout.row_nbytes).tolist()
        for j, i in enumerate(found_idx.tolist()):
            off = int(loc.slots[i]) * stride
            stored = payload[off : off + nbytes[j]]
            if not (present[j] and checksum(stored, seeds[j]) == sums[j]):
                drop.append(i)  # a corrupt or half-written leftover: replace it
                continue
            # bytes() copies 2 x 7 KiB but compares at memcmp speed (memoryview == is slow)
            if same_range[j] and bytes(stored) == bytes(batch.src(i)):
                continue  # identical republish
            h = HeaderWords.as_headers(env)[j]
            raise KeyCollisionError(
                f"R3 key {batch.keys[i].hex()} is already published with different "
                f"content (tokens {int(h['token_start'])}+{int(h['n_tokens'])}, now "
                f"{int(batch.starts[i])}+{int(batch.n_tokens[i])}). Keys must include "
                "everything that changes routing: check the weight version and the model "
                "namespace; the block hash must be the KV cache's."
            )

    def _check_items(self, items: Sequence[PutItem | tuple[ObjectKey, np.ndarray, int]]) -> _Batch:
        """Validate a put batch cheaply (no pass over the data) and dedupe its keys."""
        lay = self._layout
        dt, row_shape, bs = lay.dtype, lay.row_shape, lay.block_size
        keys: list[ObjectKey] = []
        srcs: list[memoryview] = []
        starts: list[int] = []
        counts: list[int] = []
        for key, r, ts in items:
            if (
                type(r) is not np.ndarray
                or (r.dtype is not dt and r.dtype != dt)
                or (r.shape[1:] != row_shape)
            ):
                r = lay.check_rows(r, what=f"rows of key {bytes(key).hex()}")
            n = r.shape[0]
            if not 1 <= n <= bs or type(ts) is not int or ts < 0 or ts % bs:
                raise SchemaError(
                    f"object {bytes(key).hex()}: {n} rows at token {ts!r}; an object holds "
                    f"1..{bs} rows of one KV block and starts at a multiple of {bs}"
                )
            try:
                src = r.data.cast("B")
            except TypeError:  # not C-contiguous
                src = np.ascontiguousarray(r).data.cast("B")
            keys.append(key)
            srcs.append(src)
            starts.append(ts)
            counts.append(n)
        batch = _Batch(
            keys, np.array(starts, dtype=np.uint64), np.array(counts, dtype=np.int64), srcs=srcs
        )
        if len(set(batch.keys)) != len(batch.keys):
            batch = batch.deduplicated()
        return batch

    def _abandon(self, slots: np.ndarray) -> None:
        """Undo a publication into ``slots`` that failed part-way, wherever it stopped: drop
        every index entry that points into them (the batch's own, and the victims' if the
        failure came before they were unindexed), retire them with an even seq, and free them
        in the slot table. Victims already evicted stay evicted."""
        if not len(slots):
            return
        self._index.remove_slots(slots)
        self._mark_empty(slots)
        _, slots_tab = self._writer()
        slots_tab.release(slots)

    def _mark_empty(self, slots: np.ndarray) -> None:
        """Retire objects: odd seq, clear the envelope, even seq (writer only; an odd seq, left
        by a publication that failed, ends even too)."""
        arena = self._live()
        seq = arena.seq
        seq[slots] = seq[slots] | np.uint64(1)
        cleared = arena.headers[slots]
        for field in ("magic", "key0", "key1", "checksum", "n_tokens"):
            cleared[field] = 0
        cleared["seq"] = seq[slots]
        arena.headers[slots] = cleared
        seq[slots] = seq[slots] + np.uint64(1)

    def _publish(
        self, words: np.ndarray, batch: _Batch, new: np.ndarray, kept: np.ndarray
    ) -> np.ndarray:
        """Write batch objects ``new`` by the seqlock protocol; returns their slots."""
        arena, slots_tab = self._writer()
        k = len(new)
        if k == 0:
            return np.empty(0, dtype=np.int64)
        got = slots_tab.allocate(k, kept)
        if got is None:
            raise CapacityError(
                f"R3 store {self.root}/{self.name} cannot take {k} new blocks: its "
                f"{arena.geometry.slot_count} slots hold {slots_tab.pinned} pinned blocks (the "
                "KV cache can still hit them) and nothing else can be evicted. Increase "
                "--artifact-capacity to at least the KV cache size in blocks."
            )
        slots, evicted = got
        # From here on any exception (KeyboardInterrupt too) undoes the publication: an odd
        # slot left behind would make the next publication into it even while being written.
        try:
            if evicted.any():
                victims = slots[evicted]
                old = arena.headers[victims]
                self._index.remove(np.stack((old["key0"], old["key1"]), axis=1), victims)
            seq = arena.seq
            odd = seq[slots] | np.uint64(1)  # odd even if a failed publication left it odd
            seq[slots] = odd  # 1. odd: being written
            new_words = words[new]
            starts, n_tokens = batch.starts[new], batch.n_tokens[new]
            env = self._hw.build(new_words, starts, n_tokens)
            env[:, HeaderWords.SEQ] = odd
            seeds = self._hw.seeds_for(new_words, starts, n_tokens)
            sums = list(map(checksum, batch.src_views(new), seeds))
            self._write_payloads(batch, new, slots)  # 2. payload
            env[:, HeaderWords.CSUM] = sums
            arena.words[slots] = env  # 3. envelope (seq still odd)
            seq[slots] = odd + np.uint64(1)  # 4. even: published
            failed = self._index.insert(new_words, slots)  # 5. visible by key
            if len(failed):
                failed = self._heal_index(slots)
            if len(failed):
                raise CapacityError(
                    f"R3 store {self.root}/{self.name}: the hash index has no room for "
                    f"{len(failed)} keys (both buckets full). Increase --artifact-capacity."
                )
            slots_tab.fill(slots)
        except BaseException:
            self._abandon(slots)
            raise
        return slots

    def _heal_index(self, publishing: np.ndarray) -> np.ndarray:
        """Rebuild the index from the envelopes (the truth; the index is a hint) after an
        insert found both of a key's buckets full, which at <= 25% load means damage (a stray
        write, a bug): without this, every later insert into those buckets would fail until
        the writer restarts. Called during a publication of ``publishing`` (published
        envelopes, not yet in the slot table); returns those of its slots that still found
        no room. Other objects that found none are retired (they were unreachable already)."""
        arena, slots_tab = self._writer()
        live = slots_tab.occupied.copy()
        live[publishing] = True
        failed = self._index.heal(arena.words[:, 1:3], live)
        mine = np.isin(failed, publishing)
        lost = failed[~mine]
        if len(lost):
            self._mark_empty(lost)
            slots_tab.release(lost)
        logger.warning(
            "R3 store %s/%s: the hash index was damaged (a key's two buckets were full); "
            "rebuilt it from the envelopes (%d objects retired for lack of room)",
            self.root,
            self.name,
            len(lost),
        )
        return failed[mine]

    def _write_payloads(self, batch: _Batch, new: np.ndarray, slots: np.ndarray) -> None:
        """Copy payloads into their slots; runs that are consecutive on both
        sides (``put_blocks`` into freshly swept slots) move as one range."""
        payload, stride = self._live().payload, self._stride
        if batch.whole is None or len(new) < 2:
            for view, s in zip(batch.src_views(new), slots.tolist(), strict=True):
                off = s * stride
                payload[off : off + len(view)] = view
            return
        # In put_blocks every object but the last is one full stride long.
        src = new.astype(np.int64) * stride
        dst = slots.astype(np.int64) * stride
        cont = (src[1:] == src[:-1] + stride) & (dst[1:] == dst[:-1] + stride)
        breaks = (np.flatnonzero(~cont) + 1).tolist()
        src_l, dst_l = src.tolist(), dst.tolist()
        whole = batch.whole
        for lo, hi in zip([0, *breaks], [*breaks, len(new)], strict=True):
            a = src_l[lo]
            b = min(src_l[hi - 1] + stride, len(whole))
            d = dst_l[lo]
            payload[d : d + (b - a)] = whole[a:b]

    def pin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        with self._mutex:
            _, slots_tab = self._writer()
            loc = self._locate(keys_to_words(keys))
            slots_tab.pin(loc.slots[loc.present])
            self._count_occupancy()
            return [bool(x) for x in loc.present.tolist()]

    def unpin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if not keys:
            return []
        with self._mutex:
            _, slots_tab = self._writer()
            loc = self._locate(keys_to_words(keys))
            result = np.zeros(len(keys), dtype=bool)
            idx = np.flatnonzero(loc.present)
            result[idx] = slots_tab.unpin(loc.slots[idx])
            self._count_occupancy()
            return [bool(x) for x in result.tolist()]


# ---------------------------------------------------------------- read targets


class _Dest:
    """Where a read lands: decides destination offsets once envelopes are known."""

    def prepare(
        self, n_tokens: np.ndarray, token_starts: np.ndarray
    ) -> tuple[memoryview, np.ndarray]:
        """Destination buffer and byte offset of each object (``n_tokens``
        int64 and ``token_starts`` uint64, from validated envelopes)."""
        raise NotImplementedError


class _IntoDest(_Dest):
    """``read_into``: objects must tile ``out`` from ``token_start`` without gaps."""

    def __init__(
        self, store: ShmStore, keys: Sequence[ObjectKey], out: np.ndarray, token_start: int
    ) -> None:
        self._store, self._keys = store, keys
        self._out = out.data.cast("B") if out.size else memoryview(b"")
        self._rows = len(out)
        self._start = token_start
        self._row_nbytes = store.layout.row_nbytes

    def prepare(
        self, n_tokens: np.ndarray, token_starts: np.ndarray
    ) -> tuple[memoryview, np.ndarray]:
        # Not np.zeros: numpy zero-fills 1 KiB and more with calloc, releasing the GIL.
        offsets = np.empty(len(n_tokens), dtype=np.int64)
        offsets[:1] = 0
        np.cumsum(n_tokens[:-1], out=offsets[1:])
        wrong = token_starts.astype(np.int64) != self._start + offsets
        if wrong.any():
            raise self._store._corrupt(
                self._keys,
                wrong,
                "token range does not continue the previous object (wrong key order, or a "
                "key of another request position)",
            )
        if int(n_tokens.sum()) != self._rows:
            raise ObjectCorruptError(
                f"R3 objects hold {int(n_tokens.sum())} tokens but {self._rows} rows were "
                f"requested from store {self._store.root}/{self._store.name}; a tail object "
                "with the wrong token count was given"
            )
        return self._out, offsets * self._row_nbytes


class _FreshDest(_Dest):
    """``get``: one new buffer, split into one array per object afterwards."""

    def __init__(self, layout: R3Layout) -> None:
        self._layout = layout
        self._buf: np.ndarray | None = None
        self._counts: list[int] = []

    def prepare(
        self, n_tokens: np.ndarray, token_starts: np.ndarray
    ) -> tuple[memoryview, np.ndarray]:
        self._counts = n_tokens.tolist()
        self._buf = self._layout.empty(int(n_tokens.sum()))
        offsets = np.concatenate(([0], np.cumsum(n_tokens)[:-1]))
        return self._buf.data.cast("B"), offsets * self._layout.row_nbytes

    def arrays(self) -> list[np.ndarray]:
        if self._buf is None:
            raise InternalError("a read's arrays were asked for before its buffer was made")
        bounds = np.cumsum(self._counts)[:-1]
        return list(np.split(self._buf, bounds))


def _verify(
    out: memoryview, dst: np.ndarray, nbytes: np.ndarray, env: np.ndarray, hw: HeaderWords
) -> np.ndarray | None:
    """Checksum every object on the bytes actually copied.

    Returns None if all match, else a mask of the failures. One xxh3 call per
    object, driven by ``map`` so no Python bytecode runs per object.
    """
    views = map(out.__getitem__, map(slice, dst.tolist(), (dst + nbytes).tolist()))
    got = list(map(checksum, views, hw.seeds(env)))
    if got == env[:, HeaderWords.CSUM].tolist():
        return None
    return np.array(got, dtype=np.uint64) != env[:, HeaderWords.CSUM]


def _recover(arena: Arena) -> tuple[int, int, int]:
    """Drop half-written and invalid slots and rebuild the index (writer, at open).

    Returns ``(objects, dropped_partial, dropped_invalid)``.
    """
    h = arena.headers
    layout = arena.geometry.layout
    seq = arena.seq
    odd = (seq & np.uint64(1)) == 1
    present = h["magic"] != 0
    valid = present & ~odd & (seq > 0) & ~header_problems(h, layout)
    idx = np.flatnonzero(valid)
    words = np.stack((h["key0"][idx], h["key1"][idx]), axis=1)
    dup = np.zeros(len(idx), dtype=bool)
    if len(idx):
        # lexsort is stable: the first (lowest) slot of each key is kept. (np.unique
        # on a structured key view sorts ~20x slower: 0.35 s for 200k keys.)
        order = np.lexsort((words[:, 1], words[:, 0]))
        w = words[order]
        same = (w[1:, 0] == w[:-1, 0]) & (w[1:, 1] == w[:-1, 1])
        dup[order[1:][same]] = True
    table = np.zeros_like(arena.index_table)
    keep = idx[~dup]
    failed = HashIndex(table).insert(words[~dup], keep)
    clear = odd | (present & ~valid)
    clear[idx[dup]] = True
    clear[keep[failed]] = True
    to_clear = np.flatnonzero(clear)
    if len(to_clear):
        seq[to_clear] = seq[to_clear] | np.uint64(1)
        cleared = h[to_clear]
        for field in ("magic", "key0", "key1", "checksum", "n_tokens"):
            cleared[field] = 0
        cleared["seq"] = seq[to_clear]
        h[to_clear] = cleared
        seq[to_clear] = seq[to_clear] + np.uint64(1)
    arena.index_table[...] = table
    partial = int(np.count_nonzero(odd))
    return len(keep) - len(failed), partial, len(to_clear) - partial
