"""What rank zero's tracker hands the background publisher, and the KV pins it holds.

A complete block is published once its KV block hash is known (consecutive blocks as one
run). Every hashed full block is in vLLM's prefix cache, so its object is published pinned and
store capacity never drops R3 that a KV-cache hit still needs. There is one pin per KV block,
indexed by the id the scheduler reports that block's eviction under (``block_id``, supplied by
the integration layer); :meth:`StepPublication.kv_evicted` drops it.

A step's blocks go to the publisher as one submission with their pins after them. Tails of
requests that finish together go as one more (:meth:`StepPublication.one_tail_submission`),
with the leases of keys handles around them. Inside :meth:`StepPublication.one_submission`
every submission is joined into one, in order: the start of a step hands over its keyed
blocks, its unpins and its finished requests' tails as one batch, so the publishing thread
wakes once for them, not three times (each wake-up can make the engine's main thread wait for
the GIL while it launches a step's kernels).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from vllm_artifact.core.buffer import join_rows
from vllm_artifact.core.keys import ObjectKey
from vllm_artifact.core.publisher import BlockRun, Lease, PinChange, Publisher
from vllm_artifact.core.request_state import RequestState
from vllm_artifact.errors import InternalError

__all__ = ["StepPublication"]

logger = logging.getLogger("vllm.artifact.tracker")


class StepPublication:
    """The tracker's side of the publisher (single owner, not thread-safe)."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        block_size: int,
        block_id: Callable[[bytes], int],
        lease_seconds: float,
    ) -> None:
        self._publisher = publisher
        self._block_size = block_size
        self._block_id = block_id
        self._pinned: dict[int, ObjectKey] = {}  # id of a KV block -> its object, pinned
        # Tails queued for one submission (:meth:`one_tail_submission`), or None.
        self._tail_runs: list[BlockRun | PinChange] | None = None
        # Keys handles' objects to lease, queued with the tails: full blocks before them (one
        # may have just lost its KV pin), tails after (they are published first).
        self._lease_seconds = lease_seconds
        self._lease_blocks: list[ObjectKey] = []
        self._lease_tails: list[ObjectKey] = []
        # Submissions joined by :meth:`one_submission`, or None.
        self._joined: list[BlockRun | PinChange | Lease] | None = None

    def claim_pin(self, state: RequestState, index: int) -> bool:
        """Record that the object of the request's block ``index`` is pinned for its KV block;
        False if that KV block's object is pinned already (one pin per KV block)."""
        block_id = self._block_id(state.hashes[index])
        if block_id in self._pinned:
            return False
        self._pinned[block_id] = state.keys[index]
        return True

    def keyed_blocks(self, state: RequestState) -> list[BlockRun | PinChange]:
        """The request's complete blocks whose KV block hash has arrived, as runs of
        consecutive blocks, followed by one pin per block the KV cache holds (every hashed
        full block is cached by vLLM's prefix cache) that is not pinned yet."""
        unkeyed = state.unkeyed
        if not unkeyed:
            return []
        if len(unkeyed) == 1:  # the common case: one block completed (decode)
            return self._keyed_block(state)
        ready = sorted(index for index in unkeyed if index < len(state.keys))
        runs: list[BlockRun | PinChange] = []
        pins = [state.keys[index] for index in ready if self.claim_pin(state, index)]
        while ready:
            first = end = ready.pop(0)
            while ready and ready[0] == end + 1:
                end = ready.pop(0)
            blocks = [unkeyed.pop(index) for index in range(first, end + 1)]
            runs.append(
                BlockRun(state.keys[first : end + 1], _one_array(blocks), first * self._block_size)
            )
        if pins:
            runs.append(PinChange(pins, pin=True))
        return runs

    def _keyed_block(self, state: RequestState) -> list[BlockRun | PinChange]:
        """:meth:`keyed_blocks` of a request with exactly one unkeyed block."""
        ((index, rows),) = state.unkeyed.items()
        if index >= len(state.keys):
            return []
        del state.unkeyed[index]
        key = state.keys[index]
        run: list[BlockRun | PinChange] = [BlockRun([key], rows, index * self._block_size)]
        if self.claim_pin(state, index):
            run.append(PinChange([key], pin=True))
        return run

    def submit(self, runs: list[BlockRun | PinChange]) -> None:
        """Queue one publication: every block first, then their pins in one change (the
        publisher writes consecutive block runs as one store batch)."""
        if not runs:
            return
        blocks = [run for run in runs if isinstance(run, BlockRun)]
        pins = [key for run in runs if isinstance(run, PinChange) for key in run.keys]
        if not all(run.pin for run in runs if isinstance(run, PinChange)):
            raise InternalError("a step's publication may only add pins")
        self._hand([*blocks, PinChange(pins, pin=True)] if pins else blocks)

    @contextlib.contextmanager
    def one_submission(self) -> Iterator[None]:
        """Everything submitted inside goes to the publisher as one submission, in order (no
        reads may happen inside: a joined key is not queued until the end). Nested use joins
        the outer one."""
        if self._joined is not None:
            yield
            return
        self._joined = []
        try:
            yield
        finally:
            runs, self._joined = self._joined, None
            if runs:
                self._publisher.submit(runs)

    def _hand(self, runs: Sequence[BlockRun | PinChange | Lease]) -> None:
        """To the publisher now, or with the joined submission."""
        if self._joined is not None:
            self._joined += runs
        else:
            self._publisher.submit(runs)

    def flush(self, keys: Sequence[ObjectKey]) -> None:
        """Wait until those of ``keys`` still queued are published (or failed)."""
        self._publisher.flush(keys)

    def kv_evicted(self, block_ids: Iterable[int]) -> None:
        """The KV cache dropped these blocks: their objects may now be evicted from the store
        (ids of blocks never pinned are ignored)."""
        unpin = []
        for block_id in block_ids:
            key = self._pinned.pop(int(block_id), None)
            if key is not None:
                unpin.append(key)
        if unpin:
            self._hand([PinChange(unpin, pin=False)])

    def kv_cleared(self) -> None:
        """The KV cache dropped every block (prefix-cache reset)."""
        if self._pinned:
            self._hand([PinChange(list(self._pinned.values()), pin=False)])
            self._pinned.clear()

    @contextlib.contextmanager
    def one_tail_submission(self) -> Iterator[None]:
        """Tails added inside go to the publisher together: one store batch for a step's
        finished requests, not one each (a prefill-heavy step finishes many; the publisher's
        thread holds the GIL for every batch's fixed cost). Nested use joins the outer one."""
        if self._tail_runs is not None:
            yield
            return
        self._tail_runs = []
        try:
            yield
        finally:
            runs, self._tail_runs = self._tail_runs, None
            try:
                self._submit_tails(runs)
            except Exception:  # a tail is optional: never let it fail the step
                logger.exception("vllm-artifact: %d tails not published", len(runs))

    def add_tail(self, run: BlockRun, *, lease: bool) -> None:
        """Publish a finished request's tail (with the current tail submission, if any);
        ``lease``: a keys handle names it."""
        if self._tail_runs is not None:
            self._tail_runs.append(run)
        else:
            self.submit([run])
        if lease:
            self._lease_tails += run.keys

    def lease_blocks(self, keys: Iterable[ObjectKey]) -> None:
        """Lease these full blocks' objects (a keys handle names them) with the next tails."""
        self._lease_blocks += keys

    def _submit_tails(self, runs: list[BlockRun | PinChange]) -> None:
        """Tails, with the leases of keys handles around them (see ``_lease_blocks``)."""
        blocks, self._lease_blocks = self._lease_blocks, []
        tails, self._lease_tails = self._lease_tails, []
        if not (blocks or tails):
            self.submit(runs)
            return
        seconds = self._lease_seconds
        leases: list[BlockRun | PinChange | Lease] = [Lease(blocks, seconds)] if blocks else []
        leases += runs
        if tails:
            leases.append(Lease(tails, seconds))
        self._hand(leases)


def _one_array(blocks: list[np.ndarray]) -> np.ndarray:
    """Consecutive blocks of one request as one array: a view when they lie back to back in
    one array (the blocks one :meth:`RequestRowBuffer.append` completed, e.g. a prefill
    chunk's: ``RequestTracker._capture`` files them in order), else a copy. That array may be
    a buffer of another shape and type (``core/recycled_arrays.py``): the view is cut from its
    bytes."""
    first, last = blocks[0], blocks[-1]
    if len(blocks) == 1:
        return first
    base = first.base
    if type(base) is np.ndarray and base.flags.c_contiguous and all(b.base is base for b in blocks):
        origin = base.__array_interface__["data"][0]
        start = first.__array_interface__["data"][0] - origin
        end = last.__array_interface__["data"][0] - origin + last.nbytes
        if end - start == len(blocks) * first.nbytes and first.flags.c_contiguous:
            flat = base.reshape(-1).view(np.uint8)
            return flat[start:end].view(first.dtype).reshape(-1, *first.shape[1:])
    return join_rows(blocks)
