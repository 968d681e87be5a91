"""Rank zero's per-request R3 bookkeeping: capture -> buffer -> publish -> emit (pure Python).

The vLLM worker connector feeds this class the facts of each engine step and gets back, per
request, the rows to hand to the scheduler (or a failure). It is free of vLLM so every rule
below is unit-tested without an engine:

* rows are tracked by request and logical token index; a request may start at a non-zero token
  (the KV cache served its prefix) and recomputed tokens replace what was captured before;
* a complete block is published once its KV block hash is known (hashes of generated tokens
  arrive a step after their block completes), on the background publisher, never inline, and
  stays pinned in the store until the KV cache evicts its block;
* rows are emitted once per sampled step; rows the KV cache served are read from the store
  after flushing the publisher (so a block completed by another request is durable first);
* any error for one request becomes an :class:`R3Failure` for that request only.

A step arrives column-wise (:class:`StepBatch`, what the model runner has anyway). Requests in
steady decode (one new row, nothing pending, cursors in step) take a vectorized path: one
buffer write for all of them and their rows kept column-wise in the :class:`StepResult`, so the
per-step cost of a big decode batch stays far below a GPU step; every other entry takes the
general per-request path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from vllm_artifact.contract import EmittedRows, StepResult, TailBlock
from vllm_artifact.core.buffer import RequestRowBuffer, copy_blocks, gather_rows
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.keys import KeyCache, Namespace, ObjectKey, tail_block_key
from vllm_artifact.core.publisher import BackgroundPublisher, BlockRun, Lease, PinChange
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.contract import ObjectStore
from vllm_artifact.errors import ArtifactError, InternalError

__all__ = ["RequestTracker", "StepBatch", "StepRows", "eviction_id", "eviction_ids"]

logger = logging.getLogger("vllm.artifact.tracker")


def eviction_id(block_hash: bytes | int) -> int:
    """The 64-bit id vLLM's KV cache events give a block (its hash's last 8 bytes, big
    endian, as with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); raw hashes map to the same id."""
    if isinstance(block_hash, int):
        return block_hash & _ID_MASK
    return int.from_bytes(bytes(block_hash)[-8:], "big")


def eviction_ids(block_hashes: Sequence[bytes | int]) -> list[int]:
    """:func:`eviction_id` of each hash of a KV event. vLLM's default ints already are their
    ids (64-bit), which ``min``/``max`` confirm in C; a call per hash, for hundreds of evictions
    a step, would cost more (benchmarks/bench_connector_step.py --workload prefill)."""
    if not block_hashes:
        return []
    try:
        if min(block_hashes) >= 0 and max(block_hashes) <= _ID_MASK:  # type: ignore[operator]
            return list(block_hashes)  # type: ignore[arg-type]
    except TypeError:  # raw bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        pass
    return [eviction_id(h) for h in block_hashes]


def _joined(blocks: list[np.ndarray]) -> np.ndarray:
    """Consecutive blocks of one request as one array: a view when they lie back to back in
    one array (the blocks one :meth:`RequestRowBuffer.append` completed, e.g. a prefill
    chunk's: :meth:`RequestTracker._capture` files them in order), else a copy."""
    first, last = blocks[0], blocks[-1]
    if len(blocks) == 1:
        return first
    base = first.base
    if type(base) is np.ndarray and base.flags.c_contiguous and all(b.base is base for b in blocks):
        origin = base.__array_interface__["data"][0]
        start = first.__array_interface__["data"][0] - origin
        end = last.__array_interface__["data"][0] - origin + last.nbytes
        row = base.strides[0]
        if end - start == len(blocks) * first.nbytes and start % row == 0:
            return base[start // row : end // row]
    return np.concatenate(blocks)


_ID_MASK = (1 << 64) - 1

#: A step's whole-block store reads: (first token, keys) -> the rows read (and verified).
_StepReads = dict[tuple[int, tuple[ObjectKey, ...]], np.ndarray]


class StepRows(NamedTuple):
    """One request's share of an engine step."""

    request_id: str
    token_start: int  # the scheduler's first token of this step (may be optimistic, see below)
    num_scheduled: int  # tokens scheduled this step (drafts included)
    rows: np.ndarray  # captured rows with rejected draft tokens already cut off
    sampled: bool  # the step sampled a token for this request (the scheduler takes rows)


class StepBatch(NamedTuple):
    """One finished engine step, column-wise: entry ``i`` is request ``request_ids[i]``, which
    ran from token ``token_starts[i]`` (possibly optimistic) with ``num_scheduled[i]`` tokens
    (drafts included); its kept rows (rejected drafts cut) are
    ``rows[row_starts[i]:row_ends[i]]``; ``sampled[i]`` says the scheduler takes rows."""

    request_ids: Sequence[str]
    token_starts: np.ndarray
    num_scheduled: np.ndarray
    row_starts: np.ndarray
    row_ends: np.ndarray
    sampled: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, entries: Sequence[StepRows]) -> StepBatch:
        """A batch from per-request entries (tests and callers without step arrays)."""
        lengths = np.array([len(entry.rows) for entry in entries], dtype=np.int64)
        ends = np.cumsum(lengths)
        rows = (
            np.concatenate([entry.rows for entry in entries])
            if entries
            else np.zeros((0, 1, 1), np.uint8)
        )
        return cls(
            [entry.request_id for entry in entries],
            np.array([entry.token_start for entry in entries], dtype=np.int64),
            np.array([entry.num_scheduled for entry in entries], dtype=np.int64),
            ends - lengths,
            ends,
            np.array([entry.sampled for entry in entries], dtype=bool),
            rows,
        )


@dataclass
class _Track:
    """A request's state. While its slot is in steady decode (``RequestTracker._ready_at``),
    the cursors below are stale and the slot's entry is the truth; see ``_leave_fast``."""

    emit_cursor: int  # first token whose row the scheduler has not received yet
    slot: int = -1  # its row-buffer slot once it has captured rows
    keys: list[ObjectKey] = field(default_factory=list)  # block i -> keys[i]
    hashes: list[bytes] = field(default_factory=list)  # block i -> its KV block hash
    unkeyed: dict[int, np.ndarray] = field(default_factory=dict)  # complete blocks, no hash yet
    pending_start: int | None = None  # token of the first captured, unemitted row
    pending: list[np.ndarray] = field(default_factory=list)
    pending_count: int = 0  # rows in ``pending``
    capture_end: int | None = None  # token after the last captured row
    scheduled_end: int = 0  # the scheduler's (possibly optimistic) end of the last step
    finished: bool = False
    tail: TailBlock | None = None  # the terminal partial block to publish at teardown
    lease: bool = False  # a keys handle names its objects: lease them at teardown
    failure: R3Failure | None = None
    failure_sent: bool = False


class RequestTracker:
    """Per-request state of the single R3 writer (not thread-safe: the caller serializes)."""

    def __init__(
        self,
        layout: R3Layout,
        model_id: str,
        store: ObjectStore,
        publisher: BackgroundPublisher,
        *,
        buffer_max_bytes: int,
        lease_seconds: float = 600.0,
    ) -> None:
        self._layout = layout
        self._model_id = model_id
        self._store = store
        self._publisher = publisher
        self._buffer = RequestRowBuffer(layout, max_bytes=buffer_max_bytes)
        self._tracks: dict[str, _Track] = {}
        # The request ids of each started, unfinished step, oldest first (a step list per
        # step, not a counter per request: no per-request work at either end of a step).
        self._steps_in_flight: list[Sequence[str]] = []
        # Per buffer slot: the token a steady-decode step must start at, or -1 (general path).
        self._ready_at = np.full(64, -1, dtype=np.int64)
        self._pinned: dict[int, ObjectKey] = {}  # eviction id of a KV block -> object pinned
        self.namespace = Namespace(model_id, layout, "default")
        self._key_cache = KeyCache()  # a prefix hit's blocks were keyed when published
        self.unmatched_evictions = 0  # KV evictions of blocks we never pinned
        self.reads = 0  # objects read for KV-cache hits
        self.tails_published = 0
        # Tails queued for one submission (:meth:`_one_tail_submission`), or None.
        self._tail_runs: list[BlockRun | PinChange] | None = None
        # Keys handles' objects to lease, queued with the tails: full blocks before them (one
        # may have just lost its KV pin), tails after (they are published first).
        self._lease_seconds = lease_seconds
        self._lease_blocks: list[ObjectKey] = []
        self._lease_tails: list[ObjectKey] = []

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracks

    # ------------------------------------------------------------ scheduler facts

    def set_weight_version(self, weight_version: str) -> bool:
        """Key later blocks under ``weight_version``; True if it changed."""
        if weight_version == self.namespace.weight_version:
            return False
        self.namespace = Namespace(self._model_id, self._layout, weight_version)
        return True

    def reset(self) -> None:
        """Forget every request (vLLM reset its prefix cache, with nothing in flight)."""
        for request_id in list(self._tracks):
            self._teardown(request_id)

    def admit(self, request_id: str, emit_start: int) -> None:
        """A scheduled request; rows before ``emit_start`` are never returned."""
        if request_id not in self._tracks:
            self._tracks[request_id] = _Track(emit_cursor=int(emit_start))

    def add_block_hashes(self, request_id: str, block_hashes: Iterable[bytes]) -> None:
        """KV block hashes of the request's next full blocks, in order."""
        self.add_block_hashes_of({request_id: block_hashes})

    def add_block_hashes_of(self, updates: Mapping[str, Iterable[bytes]]) -> None:
        """:meth:`add_block_hashes` for many requests (one step's), published as one batch."""
        tracks = self._tracks
        updated = [
            (track, list(map(bytes, block_hashes)))
            for request_id, block_hashes in updates.items()
            if (track := tracks.get(request_id)) is not None
        ]
        if not updated:
            return
        # The step's keys in one call: one new block each for most requests in decode.
        every = updated[0][1] if len(updated) == 1 else [h for _, hs in updated for h in hs]
        keys = self._key_cache.keys_of(self.namespace, every)
        ready: list[BlockRun | PinChange] = []
        at = 0
        for track, hashes in updated:
            track.hashes.extend(hashes)
            track.keys.extend(keys[at : at + len(hashes)])
            at += len(hashes)
            ready += self._keyed_blocks(track)
        self._submit(ready)

    def kv_evicted(self, eviction_ids: Iterable[int]) -> None:
        """The KV cache dropped these blocks (ids from :func:`eviction_id`): their objects may
        now be evicted from the store.

        Objects of blocks the KV cache holds stay pinned (published pinned, see
        :meth:`_keyed_blocks`), so store capacity never drops R3 that a KV hit still needs.
        """
        unpin = []
        for block_id in eviction_ids:
            key = self._pinned.pop(int(block_id), None)
            if key is None:
                self.unmatched_evictions += 1
            else:
                unpin.append(key)
        if unpin:
            self._publisher.submit([PinChange(unpin, pin=False)])

    def kv_cleared(self) -> None:
        """The KV cache dropped every block (prefix-cache reset)."""
        if self._pinned:
            self._publisher.submit([PinChange(list(self._pinned.values()), pin=False)])
            self._pinned.clear()

    @property
    def pinned(self) -> int:
        """Objects pinned because the KV cache still holds their block."""
        return len(self._pinned)

    def finish(
        self, request_id: str, tail: TailBlock | None = None, *, lease: bool = False
    ) -> None:
        """Finished, aborted or preempted: once no step covers the request, its terminal
        partial block is published when ``tail`` (as the scheduler hashed it) is given, and any
        other unpublished rows go. With ``lease`` (a keys handle names its objects) its
        objects stay pinned for the lease."""
        track = self._tracks.get(request_id)
        if track is None:
            return
        self._leave_fast(track)
        track.finished = True
        track.tail = tail
        track.lease = lease
        if not self._in_flight(request_id):
            self._teardown(request_id)

    def finish_all(
        self, finished: Iterable[tuple[str, TailBlock | None]], leased: Container[str] = ()
    ) -> None:
        """:meth:`finish` for each ``(request_id, tail)`` (leased if in ``leased``); the tails
        go to the publisher as one submission."""
        with self._one_tail_submission():
            for request_id, tail in finished:
                self.finish(request_id, tail=tail, lease=request_id in leased)

    # ---------------------------------------------------------------- the step

    def step_started(self, request_ids: Sequence[str]) -> None:
        """A step of these requests runs; :meth:`step_finished` gets the same ids, in the
        order steps were started."""
        tracks = self._tracks
        if not all(map(tracks.__contains__, request_ids)):
            for request_id in request_ids:
                if request_id not in tracks:
                    tracks[request_id] = _Track(emit_cursor=0)
                    tracks[request_id].failure = R3Failure(
                        "internal",
                        f"R3 for request {request_id}: scheduled without its metadata; its R3 "
                        "cannot be trusted (an internal error of vllm-artifact: please report it)",
                    )
        self._steps_in_flight.append(request_ids)

    def _step_done(self, request_ids: Sequence[str]) -> None:
        """Forget the started step of these request ids (the same list, else an equal one)."""
        steps = self._steps_in_flight
        for i, started in enumerate(steps):
            if started is request_ids:
                del steps[i]
                return
        for i, started in enumerate(steps):
            if list(started) == list(request_ids):
                del steps[i]
                return

    def _in_flight(self, request_id: str) -> bool:
        """Some started step covers the request (its rows are still to come)."""
        return any(request_id in ids for ids in self._steps_in_flight)

    def step_finished(self, step: StepBatch) -> StepResult:
        """Record one finished step; returns each request's new rows or its failure."""
        ids = step.request_ids
        self._step_done(ids)
        tracks = self._tracks
        slots = self._buffer.slots_of(ids)
        fast = (
            (slots >= 0)
            & (self._ready_at[slots] == step.token_starts)
            & (step.row_ends - step.row_starts == 1)
            & (step.num_scheduled == 1)
            & step.sampled
        )
        result = StepResult()
        outputs = result.entries
        ready: list[BlockRun | PinChange] = []
        fast_entries = np.flatnonzero(fast)
        if len(fast_entries):
            ready += self._decode_fast(step, fast_entries, slots, result)
        slow_entries = np.flatnonzero(~fast).tolist() if len(fast_entries) < len(ids) else []
        to_emit: list[tuple[str, _Track, int]] = []
        for i in slow_entries:
            request_id = ids[i]
            track = tracks[request_id]
            self._leave_fast(track)
            if track.failure is not None:
                continue
            try:
                entry = StepRows(
                    request_id,
                    int(step.token_starts[i]),
                    int(step.num_scheduled[i]),
                    step.rows[int(step.row_starts[i]) : int(step.row_ends[i])],
                    bool(step.sampled[i]),
                )
                token_end = self._capture(entry, track)
                ready += self._keyed_blocks(track)
            except Exception as error:  # one request's fault must not stop the engine
                self._fail(request_id, track, error)
            else:
                if entry.sampled and track.emit_cursor <= token_end:
                    to_emit.append((request_id, track, token_end))
        # Publish first: a request of this step may hit a block another one just completed.
        self._submit(ready)
        step_reads: _StepReads = {}
        for request_id, track, token_end in to_emit:
            try:
                outputs[request_id] = self._emit(track, token_end, step_reads)
            except Exception as error:
                self._fail(request_id, track, error)
        with self._one_tail_submission():
            for i in slow_entries:
                request_id = ids[i]
                if request_id not in tracks:
                    continue
                track = tracks[request_id]
                if track.failure is not None and not track.failure_sent:
                    outputs[request_id] = track.failure
                    track.failure_sent = True
                if track.finished and not self._in_flight(request_id):
                    self._teardown(request_id)
                else:
                    self._enter_fast(request_id, track)
        return result

    def _decode_fast(
        self,
        step: StepBatch,
        entries: np.ndarray,
        slots: np.ndarray,
        result: StepResult,
    ) -> list[BlockRun | PinChange]:
        """Steady-decode entries: one row each, written and emitted for all of them at once."""
        slots = slots[entries]
        # int64 like the buffer's arrays: writing MRV2's int32 positions into them would cast
        # in a loop that releases the GIL (see buffer._as_items).
        tokens = step.token_starts[entries].astype(np.int64)
        rows = gather_rows(step.rows, step.row_starts[entries])  # a copy: does not pin the step
        completed = self._buffer.append_one_each(slots, tokens, rows)
        self._ready_at[slots] = tokens + 1
        ids = step.request_ids
        result.decode_ids = (
            list(ids) if len(entries) == len(ids) else [ids[i] for i in entries.tolist()]
        )
        result.decode_token_starts = tokens.tolist()
        result.decode_rows = rows
        ready: list[BlockRun | PinChange] = []
        pins: list[ObjectKey] = []
        tracks, bs = self._tracks, self._layout.block_size
        for entry, block_index, block in zip(
            entries[completed.positions].tolist(),
            completed.block_indices.tolist(),
            completed.rows,
            strict=True,
        ):
            track = tracks[ids[entry]]
            if block_index < len(track.keys) and not track.unkeyed:
                # The usual: the block's KV hash came with this step (its tokens were known).
                key = track.keys[block_index]
                ready.append(BlockRun([key], block, block_index * bs))
                if self._claim_pin(track, block_index):
                    pins.append(key)
            else:
                track.unkeyed[block_index] = block
                ready += self._keyed_blocks(track)
        if pins:
            ready.append(PinChange(pins, pin=True))
        return ready

    def _enter_fast(self, request_id: str, track: _Track) -> None:
        """Let the request's next steps take the steady-decode path if its state allows."""
        end = track.capture_end
        if (
            track.slot >= 0
            and end is not None
            and track.failure is None
            and not track.finished
            and track.pending_count == 0
            and track.emit_cursor == end
            and track.scheduled_end == end
            and self._buffer.end(request_id) == end
        ):
            self._ready_at[track.slot] = end

    def _leave_fast(self, track: _Track) -> None:
        """Bring the request's cursors back from its steady-decode slot (general path next)."""
        if track.slot < 0:
            return
        token = int(self._ready_at[track.slot])
        if token >= 0:
            track.emit_cursor = track.capture_end = track.scheduled_end = token
            track.pending_start = token
            self._ready_at[track.slot] = -1

    # -------------------------------------------------------------- internals

    def _capture(self, entry: StepRows, track: _Track) -> int:
        """Buffer one step's rows of a request; returns the token after the last row."""
        token_start = entry.token_start
        if track.capture_end is not None and token_start > track.capture_end:
            # Async scheduling planned this step before the previous step's rejected drafts
            # were known; the model ran it from the true position, right after our last row.
            if track.capture_end >= track.scheduled_end:
                raise ArtifactError(
                    f"R3 rows for tokens {track.capture_end}..{token_start} were never captured"
                )
            token_start = track.capture_end
        track.scheduled_end = token_start + entry.num_scheduled
        rows = entry.rows
        if track.slot < 0:
            track.slot = self._buffer.slot(entry.request_id)
            if track.slot >= len(self._ready_at):
                grown = np.full(max(2 * len(self._ready_at), track.slot + 1), -1, np.int64)
                grown[: len(self._ready_at)] = self._ready_at
                self._ready_at = grown
        blocks = self._buffer.append(entry.request_id, token_start, rows)
        token_end = token_start + len(rows)
        if track.pending_start is None:
            track.pending_start = token_start
        elif token_start < track.pending_start + track.pending_count:
            # Recomputed tokens replace what was captured before.
            keep = max(token_start - track.pending_start, 0)
            merged = np.concatenate(track.pending) if track.pending else rows[:0]
            track.pending = [merged[:keep]]
            track.pending_count = keep
        track.pending.append(rows)
        track.pending_count += len(rows)
        track.capture_end = token_end
        for i in range(blocks.num_blocks):
            track.unkeyed[blocks.first_block + i] = blocks.block(i, self._layout.block_size)
        return token_end

    def _keyed_blocks(self, track: _Track) -> list[BlockRun | PinChange]:
        """Complete blocks whose KV block hash has arrived, as runs of consecutive blocks,
        followed by one pin per block the KV cache holds (every hashed full block is cached
        by vLLM's prefix cache) that is not pinned yet; :meth:`kv_evicted` drops it."""
        unkeyed = track.unkeyed
        if not unkeyed:
            return []
        if len(unkeyed) == 1:  # the common case: one block completed (decode)
            return self._keyed_block(track)
        ready = sorted(index for index in unkeyed if index < len(track.keys))
        runs: list[BlockRun | PinChange] = []
        pins = [track.keys[index] for index in ready if self._claim_pin(track, index)]
        bs = self._layout.block_size
        while ready:
            first = end = ready.pop(0)
            while ready and ready[0] == end + 1:
                end = ready.pop(0)
            blocks = [track.unkeyed.pop(index) for index in range(first, end + 1)]
            runs.append(BlockRun(track.keys[first : end + 1], _joined(blocks), first * bs))
        if pins:
            runs.append(PinChange(pins, pin=True))
        return runs

    def _keyed_block(self, track: _Track) -> list[BlockRun | PinChange]:
        """:meth:`_keyed_blocks` of a track with exactly one unkeyed block."""
        ((index, rows),) = track.unkeyed.items()
        if index >= len(track.keys):
            return []
        del track.unkeyed[index]
        key = track.keys[index]
        run: list[BlockRun | PinChange] = [BlockRun([key], rows, index * self._layout.block_size)]
        if self._claim_pin(track, index):
            run.append(PinChange([key], pin=True))
        return run

    def _claim_pin(self, track: _Track, index: int) -> bool:
        """Record that block ``index``'s object is pinned for its KV block; False if that KV
        block's object is pinned already (one pin per KV block, dropped by :meth:`kv_evicted`)."""
        block_id = eviction_id(track.hashes[index])
        if block_id in self._pinned:
            return False
        self._pinned[block_id] = track.keys[index]
        return True

    @contextlib.contextmanager
    def _one_tail_submission(self) -> Iterator[None]:
        """Tails published inside go to the publisher together: one store batch for a step's
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

    def _submit_tails(self, runs: list[BlockRun | PinChange]) -> None:
        """Tails, with the leases of keys handles around them (see ``_lease_blocks``)."""
        blocks, self._lease_blocks = self._lease_blocks, []
        tails, self._lease_tails = self._lease_tails, []
        if not (blocks or tails):
            self._submit(runs)
            return
        seconds = self._lease_seconds
        leases: list[BlockRun | PinChange | Lease] = [Lease(blocks, seconds)] if blocks else []
        leases += runs
        if tails:
            leases.append(Lease(tails, seconds))
        self._publisher.submit(leases)

    def _submit(self, runs: list[BlockRun | PinChange]) -> None:
        """Queue one publication: every block first, then their pins in one change (the
        publisher writes consecutive block runs as one store batch)."""
        if not runs:
            return
        blocks = [run for run in runs if isinstance(run, BlockRun)]
        pins = [key for run in runs if isinstance(run, PinChange) for key in run.keys]
        if not all(run.pin for run in runs if isinstance(run, PinChange)):
            raise InternalError("a step's publication may only add pins")
        self._publisher.submit([*blocks, PinChange(pins, pin=True)] if pins else blocks)

    def _emit(
        self,
        track: _Track,
        token_end: int,
        step_reads: _StepReads | None = None,
    ) -> EmittedRows:
        """Rows ``[emit_cursor, token_end)``: store rows for a prefix hit, then captured rows."""
        emit_start, pending_start = track.emit_cursor, track.pending_start
        if pending_start is None:
            raise InternalError("rows are emitted before any was captured")
        if emit_start < pending_start:
            # One array for the span, the store rows read straight into it: no second copy
            # of the prefix (a concatenation that size releases the GIL, see buffer._as_items).
            rows = self._layout.empty(token_end - emit_start)
            at = pending_start - emit_start
            self._read_span(track, emit_start, rows[:at], step_reads)
            for part in track.pending:
                n = min(len(part), len(rows) - at)
                rows[at : at + n] = part[:n]
                at += n
        else:
            pending = track.pending
            rows = pending[0] if len(pending) == 1 else np.concatenate(pending)
            rows = rows[emit_start - pending_start : token_end - pending_start]
        track.pending = []
        track.pending_count = 0
        track.pending_start = token_end
        track.emit_cursor = token_end
        return EmittedRows(emit_start, rows)

    def _read_span(
        self,
        track: _Track,
        start: int,
        out: np.ndarray,
        step_reads: _StepReads | None = None,
    ) -> None:
        """Rows ``[start, start + len(out))`` from the store into ``out`` (KV-cache hits;
        fails closed).

        With ``step_reads`` (this step's whole-block reads so far), requests of one step with
        the same prefix hit (a shared prompt, a group of samples of one prompt) copy the rows
        the first of them read and verified instead of reading them again: a store read has
        a fixed cost of some 40 small numpy calls."""
        bs = self._layout.block_size
        end = start + len(out)
        first, last = start // bs, -(-end // bs)
        if last > len(track.keys):
            raise ArtifactError(
                f"the KV cache served tokens up to {end} but only {len(track.keys) * bs} have "
                "block hashes; R3 for them cannot be located"
            )
        keys = track.keys[first:last]
        whole = start == first * bs and end == last * bs  # whole blocks (the usual prefix hit)
        span = (start, tuple(keys))
        if whole and step_reads is not None and (earlier := step_reads.get(span)) is not None:
            copy_blocks(out, earlier, bs)
            return
        self._publisher.flush(keys)  # only if some are still queued
        if whole:
            self._store.read_into(keys, out, token_start=start)
            if step_reads is not None:
                step_reads[span] = out
        else:
            blocks = self._layout.empty((last - first) * bs)
            self._store.read_into(keys, blocks, token_start=first * bs)
            out[:] = blocks[start - first * bs : end - first * bs]
        self.reads += last - first

    def _fail(self, request_id: str, track: _Track, error: Exception) -> None:
        """Fail this request closed; typed store errors say why, anything else is a bug."""
        reason = error.reason if isinstance(error, ArtifactError) else "internal"
        message = f"R3 (routed experts) for request {request_id} is unavailable ({reason}): {error}"
        if not isinstance(error, ArtifactError):
            logger.exception("vllm-artifact: unexpected error for request %s", request_id)
            message += " (an internal error of vllm-artifact: please report it)"
        if reason == "missing" and self.namespace.weight_version != "default":
            message += (
                f" The weight version is now {self.namespace.weight_version!r}: tokens the KV "
                "cache kept from older weights have no R3 under it; reset the prefix cache "
                "after every weight update (POST /reset_prefix_cache, LLM.reset_prefix_cache())."
            )
        logger.error("vllm-artifact: %s", message)
        track.failure = R3Failure(reason, message)
        track.pending = []
        track.pending_count = 0  # buffered rows go at teardown (the slot stays ours till then)

    def _teardown(self, request_id: str) -> None:
        """Forget a finished or aborted request: unpublished rows go, published blocks stay."""
        track = self._tracks.pop(request_id, None)
        if track is not None and track.slot >= 0:
            self._ready_at[track.slot] = -1
        with self._one_tail_submission():
            if track is not None and track.lease and track.failure is None:
                self._lease_blocks += track.keys
            if request_id not in self._buffer:
                return
            if track is not None and track.tail is not None and track.failure is None:
                try:
                    self._publish_tail(request_id, track, track.tail)
                except Exception:  # a tail is optional: never let it fail the step
                    logger.exception("vllm-artifact: request %s: tail not published", request_id)
        if request_id in self._buffer:
            self._buffer.drop(request_id)

    def _publish_tail(self, request_id: str, track: _Track, tail: TailBlock) -> None:
        """The rows of the scheduler's tail become one object keyed by the tail hash.

        Rank zero may hold rows past the scheduler's last token (speculative decoding
        verified drafts beyond ``max_tokens``, which vLLM then dropped): they may even have
        completed the tail's block, which then waits unkeyed. Only the scheduler's rows are
        published; a gap before the tail (unkeyed earlier blocks) publishes nothing.
        """
        bs = self._layout.block_size
        index, n = tail.start // bs, tail.num_tokens
        rows: np.ndarray | None = None
        if tail.start % bs or any(i < index for i in track.unkeyed):
            rows = None
        elif index in track.unkeyed:
            rows = track.unkeyed[index][:n]
            self._buffer.drop(request_id)
        else:
            buffered = self._buffer.take_tail(request_id)
            if buffered.token_start == tail.start and len(buffered.rows) >= n:
                rows = buffered.rows[:n]
        if rows is None or len(rows) != n:
            logger.warning(
                "vllm-artifact: request %s finished without the rows of its last %d tokens "
                "from token %d; the tail is not published",
                request_id,
                n,
                tail.start,
            )
            return
        key = tail_block_key(self.namespace, tail.hash, n)
        run = BlockRun([key], np.ascontiguousarray(rows), tail.start)
        if self._tail_runs is not None:
            self._tail_runs.append(run)
        else:
            self._submit([run])
        if track.lease:
            self._lease_tails.append(key)
        self.tails_published += 1
