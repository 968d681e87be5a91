"""Background publication of R3 objects, off the step path of the writing worker.

The worker hands full blocks to :class:`BackgroundPublisher` and continues; one thread writes
them to the store in order. Readers in the same process call :meth:`flush` before reading keys
that may still be queued (the read-after-write hazard of DESIGN.md section 5): it waits, with a
bound, until everything submitted so far is durable. A failed publication never raises on the
step path: it is logged and counted, and the affected keys simply stay absent, so a later hit on
them fails closed as "missing" for that request only.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from vllm_artifact.core.keys import ObjectKey
from vllm_artifact.core.store.contract import ObjectStore
from vllm_artifact.errors import ArtifactError, KeyCollisionError, StoreError

__all__ = ["BackgroundPublisher", "BlockRun", "PinChange"]

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


class BackgroundPublisher:
    """Single publishing thread in front of one writable store."""

    def __init__(self, store: ObjectStore, *, max_pending_batches: int = 1024) -> None:
        self._store = store
        self._queue: queue.Queue[list[BlockRun | PinChange] | None] = queue.Queue(
            maxsize=max_pending_batches
        )
        self._failures = 0
        self._collisions = 0  # recomputed blocks whose rows differed from the stored object
        self._published_objects = 0
        self._submitted = 0  # batches handed to submit()
        self._finished = 0  # batches the thread is done with (published or failed)
        # Objects queued but not yet written, with the batch number that writes them.
        self._queued: dict[ObjectKey, int] = {}
        self._progress = threading.Condition()
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

    def submit(self, runs: Sequence[BlockRun | PinChange]) -> None:
        """Queue blocks for publication and pin changes, executed in order (blocks the caller
        only if the queue is full)."""
        if self._closed:
            raise StoreError("the R3 publisher is closed")
        if runs:
            with self._progress:
                self._submitted += 1
                for run in runs:
                    if isinstance(run, BlockRun):
                        self._queued.update(dict.fromkeys(run.keys, self._submitted))
            self._queue.put(list(runs))

    def flush(self, keys: Sequence[ObjectKey] | None = None, timeout: float = 30.0) -> None:
        """Wait until every object submitted so far (or only those of ``keys`` still queued)
        was published or failed."""
        with self._progress:
            if keys is None:
                target = self._submitted
            else:
                target = max((self._queued.get(key, 0) for key in keys), default=0)
            if target <= self._finished:
                return
            if not self._progress.wait_for(lambda: self._finished >= target, timeout):
                raise StoreError(
                    f"R3 publication did not finish within {timeout:.0f} s; the store may be "
                    "stalled (check /dev/shm)"
                )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            runs = self._queue.get()
            if runs is None:
                return
            try:
                self._publish(runs)
            finally:
                with self._progress:
                    self._finished += 1
                    for run in runs:
                        if isinstance(run, BlockRun):
                            for key in run.keys:
                                if self._queued.get(key) == self._finished:
                                    del self._queued[key]
                    self._progress.notify_all()

    def _publish(self, runs: list[BlockRun | PinChange]) -> None:
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
                    pin_all = run is not None and run.pin and _pins_each_once(run.keys, blocks)
                    self._put(blocks, pin=pin_all)
                    blocks = []
                    if pin_all:
                        continue
                if run is not None:
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
