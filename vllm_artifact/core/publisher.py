"""Publication of R3 objects, off the step path, and large batches inline on memory stores.

The worker hands full blocks to :class:`Publisher` and continues; one thread writes them to
the store in order. Readers in the same process call :meth:`Publisher.flush` before reading
keys that may still be queued (the read-after-write hazard): it waits, with a bound, until
those keys are durable.

With ``inline_from_blocks`` (a store whose writes are copies into this host's memory: the
/dev/shm store), a submission of at least that many blocks is written on the caller's thread
instead, once every earlier submission is done (order is kept). Why: on a GPU the engine's
main thread launches an eager (prefill) step's forward pass one torch or Triton call at a
time, releasing the GIL inside each; a publishing thread waiting for the GIL takes it there
and the main thread then sleeps until it gets it back, many times for one large batch
(docs/benchmarks.md: on an H100 a prefill round's main-thread sleeps fell from about 1,200
to 470 with its batches written inline). A decode step's few blocks stay on the thread: there
the main thread has time to spare and the step thread's own time is what counts. Pin changes
alone (a step's unpins) are index updates: they too are written inline, but only while the
thread has nothing queued or in hand, so the caller never waits for it.

A failed publication never raises on the step path: it is logged and counted, and the
affected keys simply stay absent, so a later hit on them fails closed as "missing" for that
request only. A stalled store cannot hang the engine either: a full queue drops the submission
after ``stall_timeout`` (counted as a failure), an inline batch that waited that long for the
batches before it is dropped the same way, and a flush that waited that long raises
``StoreError`` (the reading request fails) and later flushes fail at once until the thread
makes progress again.

Leases (:class:`Lease`) keep the objects a keys-only handle names pinned for a while after the
request's end, so a trainer reading the handle within the lease finds them whatever the store's
pressure; the publishing thread drops each lease's pins when it expires.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vllm_artifact.core.keys import ObjectKey
from vllm_artifact.core.store.contract import ObjectStore
from vllm_artifact.errors import ArtifactError, KeyCollisionError, StoreError

__all__ = [
    "MEMORY_STORE_INLINE_FROM_BLOCKS",
    "BlockRun",
    "Lease",
    "PinChange",
    "Publisher",
    "Submission",
]

logger = logging.getLogger("vllm.artifact.publisher")


class BlockRun(NamedTuple):
    """Consecutive blocks of one request: ``rows[i*bs:(i+1)*bs]`` is the object of
    ``keys[i]``; published with the store's batch fast path (``put_blocks``). (A named tuple:
    the worker makes one per completed block on the step path.)"""

    keys: Sequence[ObjectKey]
    rows: np.ndarray
    token_start: int


class PinChange(NamedTuple):
    """Add (``pin=True``) or drop one pin reference on each key, in order with publication."""

    keys: Sequence[ObjectKey]
    pin: bool


class Lease(NamedTuple):
    """Pin each of ``keys`` that is stored for ``seconds`` (one pin reference each, dropped by
    the publishing thread at expiry), in order with publication."""

    keys: Sequence[ObjectKey]
    seconds: float


Submission = BlockRun | PinChange | Lease

#: A memory store's submissions of at least this many blocks are written inline: a prefill
#: step's (an 8,192-token chunk completes 512 blocks of 16 tokens), not a decode step's (one
#: block per 16 running requests).
MEMORY_STORE_INLINE_FROM_BLOCKS = 64
#: Default bound on waiting for a stalled store (queue full, or a flush).
STALL_TIMEOUT_S = 10.0
#: ``_queued`` is pruned of written entries once it has this many (or twice what it kept).
_MIN_PRUNE_AT = 1 << 16


class Publisher:
    """The one writer in front of one writable store: a single publishing thread, and large
    batches on the caller's thread with ``inline_from_blocks`` (module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        inline_from_blocks: int | None = None,
        max_pending_batches: int = 1024,
        stall_timeout: float = STALL_TIMEOUT_S,
    ) -> None:
        self._store = store
        self._queue: queue.Queue[tuple[int, list[Submission]] | None] = queue.Queue(
            maxsize=max_pending_batches
        )
        self.stall_timeout = stall_timeout
        self._stalled_at: int | None = None  # ``_finished`` when a flush last timed out
        self.dropped_submissions = 0  # dropped on a stalled store (queue full, inline wait)
        # Lease expiries: (deadline, sequence, keys pinned), and how many keys they hold.
        self._leases: list[tuple[float, int, list[ObjectKey]]] = []
        self._lease_ids = itertools.count()
        self._leased = 0
        self._failures = 0
        self._collisions = 0  # recomputed blocks whose rows differed from the stored object
        self._published_objects = 0
        self._submitted = 0  # batches handed to submit(), numbered from 1
        self._finished = 0  # every batch up to this number is done (published, failed, dropped)
        self._finished_ahead: set[int] = set()  # batches done out of order (dropped)
        # Objects submitted, with the batch number that writes them: those of batches up to
        # ``_finished`` are written. The owner's thread alone reads and changes it (submit,
        # flush), so the publishing thread's bookkeeping under ``_progress`` is a few integer
        # updates: the owner's step thread waits for that lock whenever the publishing thread
        # holds it, and then for the GIL as well (up to the switch interval).
        self._queued: dict[ObjectKey, int] = {}
        self._prune_at = _MIN_PRUNE_AT  # drop written entries once ``_queued`` has this many
        self._progress = threading.Condition()
        #: Submissions of at least this many blocks are written by the caller (None: never).
        self.inline_from_blocks = inline_from_blocks
        self.inline_batches = 0  # submissions written on the caller's thread
        # Held by whichever thread writes the store (the caller's inline batches, the
        # publishing thread's batches and lease expiries): the store has one writer at a time.
        self._writing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="vllm-artifact-publisher", daemon=True
        )
        self._thread.start()

    @property
    def failures(self) -> int:
        """Batches whose publication failed (their objects are absent)."""
        return self._failures

    @property
    def collisions(self) -> int:
        return self._collisions

    @property
    def published_objects(self) -> int:
        return self._published_objects

    @property
    def thread_batches(self) -> int:
        """Submissions handed to the publishing thread (each wakes it once)."""
        return self._submitted - self.inline_batches

    @property
    def leased_objects(self) -> int:
        """Objects pinned by leases that have not expired yet."""
        return self._leased

    def submit(self, runs: Sequence[Submission]) -> bool:
        """Blocks for publication, pin changes and leases, executed in order: queued, or
        written before returning if the batch is large enough to go inline. Either waits only
        for a stalled store, for at most ``stall_timeout``: then the submission is dropped
        (logged and counted; its blocks stay absent, so hits on them fail closed) and False
        is returned. Never raises on the step path but when closed."""
        if self._closed:
            raise StoreError("the R3 publisher is closed")
        if not runs:
            return True
        batch = list(runs)
        if self._goes_inline(batch):
            return self._write_inline(batch)
        self._submitted += 1
        number = self._submitted
        queued = self._queued
        for run in batch:
            if isinstance(run, BlockRun):
                queued.update(dict.fromkeys(run.keys, number))
        if len(queued) >= self._prune_at:
            self._prune_queued()
        try:
            self._queue.put((number, batch), timeout=self.stall_timeout)
            return True
        except queue.Full:
            queued = self._queued  # (pruning may have replaced it)
            for run in batch:  # nothing to wait for: its objects stay absent
                if isinstance(run, BlockRun):
                    for key in run.keys:
                        if queued.get(key) == number:
                            del queued[key]
            self._drop(number, batch)
            return False

    def _goes_inline(self, batch: list[Submission]) -> bool:
        """Large enough to write inline, or pin changes alone while the thread has nothing to
        do (index updates, cheaper than waking it); never with a lease (the thread times its
        expiry)."""
        if self.inline_from_blocks is None:
            return False
        blocks = 0
        for run in batch:
            if isinstance(run, BlockRun):
                blocks += len(run.keys)
            elif isinstance(run, Lease):
                return False
        if blocks == 0:
            return self._finished == self._submitted  # no wait for earlier submissions
        return blocks >= self.inline_from_blocks

    def _write_inline(self, batch: list[Submission]) -> bool:
        """Write ``batch`` on this thread once every earlier submission is done."""
        try:
            self.flush(timeout=self.stall_timeout)
        except StoreError:
            self._submitted += 1
            self._drop(self._submitted, batch)
            return False
        self._submitted += 1
        number = self._submitted
        try:
            with self._writing:
                self._publish(batch)
        finally:
            self.inline_batches += 1
            self._finish(number)
        return True

    def _drop(self, number: int, batch: list[Submission]) -> None:
        """Submission ``number`` is not written (the store stalled): counted and logged."""
        self._finish(number)
        self._failures += 1
        self.dropped_submissions += 1
        logger.error(
            "vllm-artifact: R3 publication has made no room for a submission in %.1f s (store "
            "stalled? check /dev/shm); %d objects not published, later hits on them fail "
            "closed",
            self.stall_timeout,
            sum(len(run.keys) for run in batch if isinstance(run, BlockRun)),
        )

    def flush(self, keys: Sequence[ObjectKey] | None = None, timeout: float | None = None) -> None:
        """Wait until every object submitted so far (or only those of ``keys`` still queued)
        was published or failed; raises ``StoreError`` after ``timeout`` (default
        ``stall_timeout``), and at once while the thread has made no progress since a flush
        last timed out."""
        wait = self.stall_timeout if timeout is None else timeout
        if keys is None:
            target = self._submitted
        else:
            target = max((self._queued.get(key, 0) for key in keys), default=0)
        if target <= self._finished:
            return
        with self._progress:
            if target <= self._finished:
                return
            if self._stalled_at == self._finished:
                raise StoreError(
                    "R3 publication is stalled (no progress since an earlier wait timed out); "
                    "the store may be unusable (check /dev/shm)"
                )
            if not self._progress.wait_for(lambda: self._finished >= target, wait):
                self._stalled_at = self._finished
                raise StoreError(
                    f"R3 publication did not finish within {wait:.0f} s; the store may be "
                    "stalled (check /dev/shm)"
                )

    def _prune_queued(self) -> None:
        """Forget the written entries of ``_queued`` (owner's thread)."""
        finished = self._finished
        self._queued = {key: n for key, n in self._queued.items() if n > finished}
        self._prune_at = max(_MIN_PRUNE_AT, 2 * len(self._queued))

    def _finish(self, number: int) -> None:
        """Submission ``number`` is done (published, failed or dropped): advance
        ``_finished`` over every submission done without a gap."""
        with self._progress:
            self._finished_ahead.add(number)
            while self._finished + 1 in self._finished_ahead:
                self._finished += 1
                self._finished_ahead.remove(self._finished)
            self._progress.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._until_next_expiry())
            except queue.Empty:
                with self._writing:
                    self._expire_leases()
                continue
            if item is None:
                return
            number, batch = item
            try:
                with self._writing:
                    self._publish(batch)
            finally:
                self._finish(number)
            if self._leases:
                with self._writing:
                    self._expire_leases()

    def _until_next_expiry(self) -> float | None:
        if not self._leases:
            return None
        return max(0.0, self._leases[0][0] - time.monotonic())

    def _expire_leases(self) -> None:
        now = time.monotonic()
        while self._leases and self._leases[0][0] <= now:
            _, _, keys = heapq.heappop(self._leases)
            self._leased -= len(keys)
            try:
                self._store.unpin(keys)
            except Exception:
                logger.exception("vllm-artifact: unpinning %d leased R3 objects failed", len(keys))

    def _lease(self, lease: Lease) -> None:
        """Pin the stored ones of ``lease.keys`` until the lease ends (absent keys are not
        pinned, so their expiry cannot drop another holder's pin)."""
        keys = list(lease.keys)
        pinned = [key for key, ok in zip(keys, self._store.pin(keys), strict=True) if ok]
        if pinned:
            deadline = time.monotonic() + lease.seconds
            heapq.heappush(self._leases, (deadline, next(self._lease_ids), pinned))
            self._leased += len(pinned)

    def _publish(self, runs: list[Submission]) -> None:
        objects = sum(len(run.keys) for run in runs if isinstance(run, BlockRun))
        try:
            blocks: list[BlockRun] = []  # consecutive runs, written as one store batch
            for run in [*runs, None]:
                if isinstance(run, BlockRun):
                    blocks.append(run)
                    continue
                if blocks:
                    # The usual step: its new blocks, then a pin on each of them (one
                    # store pass instead of two).
                    pin_all = (
                        isinstance(run, PinChange) and run.pin and _pins_each_once(run.keys, blocks)
                    )
                    self._put(blocks, pin=pin_all)
                    blocks = []
                    if pin_all:
                        continue
                if isinstance(run, Lease):
                    self._lease(run)
                elif run is not None:
                    (self._store.pin if run.pin else self._store.unpin)(run.keys)
            self._published_objects += objects
        except ArtifactError as error:
            self._failures += 1
            logger.error(
                "vllm-artifact: publishing %d R3 objects failed (%s): %s; later prefix hits on "
                "them fail closed as missing",
                objects,
                error.reason,
                error,
            )
        except Exception:
            self._failures += 1
            logger.exception("vllm-artifact: publishing %d R3 objects failed", objects)

    def _put(self, runs: list[BlockRun], *, pin: bool) -> None:
        """Runs of several requests in one store batch (one lookup, one index update): the
        publishing thread holds the GIL for far less than with one call per run."""
        try:
            if len(runs) == 1:
                run = runs[0]
                self._store.put_blocks(run.keys, run.rows, run.token_start, pin=pin)
            else:
                self._store.put_runs(runs, pin=pin)
        except KeyCollisionError:
            for run in runs:
                self._publish_one_by_one(run)
            if pin:  # once per distinct key, as the batch put would have; kept objects too
                self._store.pin(list(dict.fromkeys(key for run in runs for key in run.keys)))

    def _publish_one_by_one(self, run: BlockRun) -> None:
        """A block of the run collided (recomputed with different routing, e.g. GPU
        nondeterminism): keep the first object, as immutability demands, publish the rest."""
        bs = self._store.layout.block_size
        for i, key in enumerate(run.keys):
            rows = run.rows[i * bs : (i + 1) * bs]
            try:
                self._store.put([(key, rows, run.token_start + i * bs)], pin=False)
            except KeyCollisionError as error:
                self._collisions += 1
                logger.warning("vllm-artifact: kept the first R3 object: %s", error)


def _pins_each_once(keys: Sequence[ObjectKey], runs: list[BlockRun]) -> bool:
    """Whether ``keys`` names every block of ``runs`` exactly once (a store put with ``pin``
    pins each distinct key of its batch once)."""
    distinct = set(keys)
    return len(distinct) == len(keys) and distinct == {key for run in runs for key in run.keys}
