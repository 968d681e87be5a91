"""Rank zero's per-request R3 bookkeeping: capture -> buffer -> publish -> emit (pure Python).

The vLLM worker connector feeds this class the facts of each engine step and gets back, per
request, the rows to hand to the scheduler (or a failure). It is free of vLLM so every rule
below is unit-tested without an engine:

* rows are tracked by request and logical token index; a request may start at a non-zero token
  (the KV cache served its prefix) and recomputed tokens replace what was captured before;
* a complete block is published once its KV block hash is known (hashes of generated tokens
  arrive a step after their block completes), on the background publisher, never inline, and
  stays pinned in the store until the KV cache evicts its block (:mod:`.step_publication`);
* rows are emitted once per sampled step; rows the KV cache served are read from the store
  after flushing the publisher (so a block completed by another request is durable first);
* any error for one request becomes an :class:`R3Failure` for that request only.

A step arrives column-wise (:class:`~vllm_artifact.core.step_batch.StepBatch`). Requests in
steady decode take the vectorized path of :mod:`.steady_decode`; every other entry takes the
per-request path here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

import numpy as np

from vllm_artifact.contract import EmittedRows, StepResult, TailBlock
from vllm_artifact.core.buffer import RequestRowBuffer, copy_rows_into, join_rows
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.hit_reads import HitReads, StepReads
from vllm_artifact.core.keys import (
    DEFAULT_WEIGHT_VERSION,
    KeyCache,
    Namespace,
    ObjectKey,
    tail_block_key,
)
from vllm_artifact.core.publisher import BlockRun, PinChange, Publisher
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.request_state import Cursors, RequestState
from vllm_artifact.core.row_file import rows_with_room
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.steady_decode import SteadyDecode
from vllm_artifact.core.step_batch import StepBatch, StepRows
from vllm_artifact.core.step_publication import StepPublication
from vllm_artifact.core.store.contract import ObjectStore
from vllm_artifact.core.store.node_stores import NodeStores
from vllm_artifact.errors import ArtifactError, InternalError

__all__ = ["RequestTracker"]

logger = logging.getLogger("vllm.artifact.tracker")


class RequestTracker:
    """Per-request state of the single R3 writer (not thread-safe: the caller serializes).

    ``block_id`` maps a KV block hash to the id the scheduler reports its eviction under
    (:meth:`kv_evicted`); the integration layer knows vLLM's KV events and supplies it.
    ``node_stores`` (the engine's store and its family's on the node) serves KV hits on blocks
    another engine computed; without it only ``store`` is read."""

    def __init__(
        self,
        layout: R3Layout,
        model_id: str,
        store: ObjectStore,
        publisher: Publisher,
        *,
        buffer_max_bytes: int,
        block_id: Callable[[bytes], int],
        lease_seconds: float = 600.0,
        node_stores: NodeStores | None = None,
    ) -> None:
        self._layout = layout
        self._model_id = model_id
        self._publication = StepPublication(
            publisher,
            block_size=layout.block_size,
            block_id=block_id,
            lease_seconds=lease_seconds,
        )
        self._hits = HitReads(layout, store, self._publication, node_stores)
        #: Memory of the step's row arrays (the step's copy out of pinned memory, completed
        #: blocks, emitted rows), reused once nothing refers to it (core/recycled_arrays.py).
        self.arrays = RecycledArrays()
        self._buffer = RequestRowBuffer(layout, max_bytes=buffer_max_bytes, arrays=self.arrays)
        self._steady = SteadyDecode(self._buffer)
        self._requests: dict[str, RequestState] = {}
        # The request ids of each started, unfinished step, oldest first (a step list per
        # step, not a counter per request: no per-request work at either end of a step).
        self._steps_in_flight: list[Sequence[str]] = []
        self.namespace = Namespace(model_id, layout, DEFAULT_WEIGHT_VERSION)
        self._key_cache = KeyCache()  # a prefix hit's blocks were keyed when published
        self.tails_published = 0

    @property
    def reads(self) -> int:
        """Objects read from the stores for KV-cache hits."""
        return self._hits.reads

    @property
    def adopted(self) -> int:
        """Objects of those read from another engine's store on the node (and adopted)."""
        return self._hits.adopted

    # ------------------------------------------------------------ scheduler facts

    def set_weight_version(self, weight_version: str) -> bool:
        """Key later blocks under ``weight_version``; True if it changed."""
        if weight_version == self.namespace.weight_version:
            return False
        self.namespace = Namespace(self._model_id, self._layout, weight_version)
        return True

    def reset(self) -> None:
        """Forget every request (vLLM reset its prefix cache, with nothing in flight)."""
        for request_id in list(self._requests):
            self._teardown(request_id)

    def admit(self, request_id: str, emit_start: int, first_rows_room: int | None = None) -> None:
        """A scheduled request; rows before ``emit_start`` are never returned. With
        ``first_rows_room``, its first rows may be emitted as a file with room for that many
        more (``StepResult.files``)."""
        if request_id not in self._requests:
            self._requests[request_id] = RequestState(
                Cursors(emit=int(emit_start)), first_rows_room=first_rows_room
            )

    def admit_lost(self, request_ids: Iterable[str], failure: R3Failure) -> None:
        """Requests whose rows an earlier tracker held (a tracker process that went): each
        fails with ``failure`` at its next step instead of being taken for unknown."""
        for request_id in request_ids:
            if request_id not in self._requests:
                self._requests[request_id] = RequestState(Cursors(emit=0), failure=failure)

    def add_block_hashes(self, updates: Mapping[str, Iterable[bytes]]) -> None:
        """KV block hashes of each request's next full blocks, in order (one step's), published
        as one batch."""
        requests = self._requests
        updated = [
            (state, list(map(bytes, block_hashes)))
            for request_id, block_hashes in updates.items()
            if (state := requests.get(request_id)) is not None
        ]
        if not updated:
            return
        # The step's keys in one call: one new block each for most requests in decode.
        every = updated[0][1] if len(updated) == 1 else [h for _, hs in updated for h in hs]
        keys = self._key_cache.keys_of(self.namespace, every)
        ready: list[BlockRun | PinChange] = []
        at = 0
        for state, hashes in updated:
            state.hashes.extend(hashes)
            state.keys.extend(keys[at : at + len(hashes)])
            at += len(hashes)
            ready += self._publication.keyed_blocks(state)
        self._publication.submit(ready)

    def one_submission(self) -> AbstractContextManager[None]:
        """The publications, unpins and tails of the calls inside go to the publisher as one
        submission (a step's start: one wake-up of the publishing thread, not three)."""
        return self._publication.one_submission()

    def kv_evicted(self, block_ids: Iterable[int]) -> None:
        """The KV cache dropped these blocks (ids as ``block_id`` makes them): their objects
        are unpinned and may now be evicted from the store."""
        self._publication.kv_evicted(block_ids)

    def kv_cleared(self) -> None:
        """The KV cache dropped every block (prefix-cache reset)."""
        self._publication.kv_cleared()

    def finish(
        self, request_id: str, tail: TailBlock | None = None, *, lease: bool = False
    ) -> None:
        """Finished, aborted or preempted: once no step covers the request, its terminal
        partial block is published when ``tail`` (as the scheduler hashed it) is given, and any
        other unpublished rows go. With ``lease`` (a keys handle names its objects) its
        objects stay pinned for the lease."""
        state = self._requests.get(request_id)
        if state is None:
            return
        self._cursors(state)
        state.finished = True
        state.tail = tail
        state.lease = lease
        if not self._in_flight(request_id):
            self._teardown(request_id)

    def finish_all(
        self, finished: Iterable[tuple[str, TailBlock | None]], leased: Container[str] = ()
    ) -> None:
        """:meth:`finish` for each ``(request_id, tail)`` (leased if in ``leased``); the tails
        go to the publisher as one submission."""
        with self._publication.one_tail_submission():
            for request_id, tail in finished:
                self.finish(request_id, tail=tail, lease=request_id in leased)

    # ---------------------------------------------------------------- the step

    def step_started(self, request_ids: Sequence[str]) -> None:
        """A step of these requests runs; :meth:`step_finished` gets the same ids, in the
        order steps were started."""
        requests = self._requests
        if not all(map(requests.__contains__, request_ids)):
            for request_id in request_ids:
                if request_id not in requests:
                    requests[request_id] = RequestState(
                        Cursors(emit=0),
                        failure=R3Failure(
                            "internal",
                            f"R3 for request {request_id}: scheduled without its metadata; its "
                            "R3 cannot be trusted (an internal error of vllm-artifact: please "
                            "report it)",
                        ),
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
        requests = self._requests
        slots = self._buffer.slots_of(ids)
        steady = self._steady.select(step, slots)
        result = StepResult()
        outputs = result.entries
        ready: list[BlockRun | PinChange] = []
        steady_entries = np.flatnonzero(steady)
        if len(steady_entries):
            completed = self._steady.write(step, steady_entries, slots, result)
            ready += self._completed_blocks(
                [ids[i] for i in steady_entries[completed.positions].tolist()],
                completed.block_indices.tolist(),
                completed.rows,
            )
        other_entries = np.flatnonzero(~steady).tolist() if len(steady_entries) < len(ids) else []
        to_emit: list[tuple[str, RequestState, Cursors, int]] = []
        for i in other_entries:
            request_id = ids[i]
            state = requests[request_id]
            cursors = self._cursors(state)
            if state.failure is not None:
                continue
            try:
                entry = step.entry(i)
                token_end = self._capture(entry, state, cursors)
                ready += self._publication.keyed_blocks(state)
            except Exception as error:  # one request's fault must not stop the engine
                self._fail(request_id, state, error)
            else:
                if entry.sampled and cursors.emit <= token_end:
                    to_emit.append((request_id, state, cursors, token_end))
        # Publish first: a request of this step may hit a block another one just completed.
        self._publication.submit(ready)
        step_reads: StepReads = {}
        for request_id, state, cursors, token_end in to_emit:
            try:
                outputs[request_id] = self._emit(
                    state, cursors, token_end, step_reads, result.files, request_id
                )
            except Exception as error:
                result.files.pop(request_id, None)
                self._fail(request_id, state, error)
        with self._publication.one_tail_submission():
            for i in other_entries:
                request_id = ids[i]
                if request_id not in requests:
                    continue
                state = requests[request_id]
                if state.failure is not None and not state.failure_sent:
                    outputs[request_id] = state.failure
                    state.failure_sent = True
                if state.finished and not self._in_flight(request_id):
                    self._teardown(request_id)
                else:
                    self._maybe_steady(request_id, state)
        return result

    def _completed_blocks(
        self, request_ids: list[str], block_indices: list[int], blocks: Iterable[np.ndarray]
    ) -> list[BlockRun | PinChange]:
        """Blocks the steady-decode rows completed (block ``block_indices[i]`` of request
        ``request_ids[i]``), keyed and pinned, or kept until their hash arrives."""
        ready: list[BlockRun | PinChange] = []
        pins: list[ObjectKey] = []
        requests, block_size = self._requests, self._layout.block_size
        for request_id, block_index, block in zip(request_ids, block_indices, blocks, strict=True):
            state = requests[request_id]
            if block_index < len(state.keys) and not state.unkeyed:
                # The usual: the block's KV hash came with this step (its tokens were known).
                key = state.keys[block_index]
                ready.append(BlockRun([key], block, block_index * block_size))
                if self._publication.claim_pin(state, block_index):
                    pins.append(key)
            else:
                state.unkeyed[block_index] = block
                ready += self._publication.keyed_blocks(state)
        if pins:
            ready.append(PinChange(pins, pin=True))
        return ready

    def _maybe_steady(self, request_id: str, state: RequestState) -> None:
        """Let the request's next steps take the steady-decode path if its state allows."""
        cursors = state.cursors
        if cursors is None:
            return
        end = cursors.capture_end
        if (
            state.slot >= 0
            and end is not None
            and state.failure is None
            and not state.finished
            and state.pending_count == 0
            and cursors.emit == end
            and cursors.scheduled_end == end
            and self._buffer.end(request_id) == end
        ):
            self._steady.enter(state.slot, end)
            state.cursors = None

    def _cursors(self, state: RequestState) -> Cursors:
        """The request's cursors, taking it out of steady decode if it is in it."""
        if state.cursors is None:
            token = self._steady.leave(state.slot)
            if token is None:
                raise InternalError("a request has no cursors and is not in steady decode")
            state.cursors = Cursors.at(token)
        return state.cursors

    # -------------------------------------------------------------- internals

    def _capture(self, entry: StepRows, state: RequestState, cursors: Cursors) -> int:
        """Buffer one step's rows of a request; returns the token after the last row."""
        token_start = entry.token_start
        if cursors.capture_end is not None and token_start > cursors.capture_end:
            # Async scheduling planned this step before the previous step's rejected drafts
            # were known; the model ran it from the true position, right after our last row.
            if cursors.capture_end >= cursors.scheduled_end:
                raise ArtifactError(
                    f"R3 rows for tokens {cursors.capture_end}..{token_start} were never captured"
                )
            token_start = cursors.capture_end
        cursors.scheduled_end = token_start + entry.num_scheduled
        rows = entry.rows
        if state.slot < 0:
            state.slot = self._buffer.slot(entry.request_id)
            self._steady.reserve(state.slot)
        blocks = self._buffer.append(entry.request_id, token_start, rows)
        token_end = token_start + len(rows)
        if cursors.pending_start is None:
            cursors.pending_start = token_start
        elif token_start < cursors.pending_start + state.pending_count:
            # Recomputed tokens replace what was captured before.
            keep = max(token_start - cursors.pending_start, 0)
            merged = join_rows(state.pending, self.arrays) if state.pending else rows[:0]
            state.pending = [merged[:keep]]
            state.pending_count = keep
        state.pending.append(rows)
        state.pending_count += len(rows)
        cursors.capture_end = token_end
        for i in range(blocks.num_blocks):
            state.unkeyed[blocks.first_block + i] = blocks.block(i, self._layout.block_size)
        return token_end

    def _emit(
        self,
        state: RequestState,
        cursors: Cursors,
        token_end: int,
        step_reads: StepReads,
        files: dict[str, np.ndarray],
        request_id: str,
    ) -> EmittedRows:
        """Rows ``[emit, token_end)``: store rows for a prefix hit, then captured rows. A
        request's first such array may be made the data part of a file (``files``)."""
        emit_start, pending_start = cursors.emit, cursors.pending_start
        if pending_start is None:
            raise InternalError("rows are emitted before any was captured")
        room, state.first_rows_room = state.first_rows_room, None
        if emit_start < pending_start:
            # One array for the span, the store rows read straight into it: no second copy
            # of the prefix (a concatenation that size releases the GIL, see buffer._as_items).
            # Where the frontend may adopt it, it is a file with room (core/row_file.py).
            file, rows = rows_with_room(token_end - emit_start, room, self._layout, self.arrays)
            if file is not None:
                files[request_id] = file
            at = pending_start - emit_start
            self._hits.read_span(state, emit_start, rows[:at], self.namespace, step_reads)
            for part in state.pending:
                count = min(len(part), len(rows) - at)
                copy_rows_into(rows[at : at + count], part[:count])  # keeps the GIL
                at += count
        else:
            pending = state.pending
            rows = join_rows(pending, self.arrays)
            rows = rows[emit_start - pending_start : token_end - pending_start]
        state.pending = []
        state.pending_count = 0
        cursors.pending_start = token_end
        cursors.emit = token_end
        return EmittedRows(emit_start, rows)

    def _fail(self, request_id: str, state: RequestState, error: Exception) -> None:
        """Fail this request closed; typed store errors say why, anything else is a bug."""
        reason = error.reason if isinstance(error, ArtifactError) else "internal"
        message = f"R3 (routed experts) for request {request_id} is unavailable ({reason}): {error}"
        if not isinstance(error, ArtifactError):
            logger.exception("vllm-artifact: unexpected error for request %s", request_id)
            message += " (an internal error of vllm-artifact: please report it)"
        if reason == "missing" and self.namespace.weight_version != DEFAULT_WEIGHT_VERSION:
            message += (
                f" The weight version is now {self.namespace.weight_version!r}: tokens the KV "
                "cache kept from older weights have no R3 under it; reset the prefix cache "
                "after every weight update (POST /reset_prefix_cache, LLM.reset_prefix_cache())."
            )
        logger.error("vllm-artifact: %s", message)
        state.failure = R3Failure(reason, message)
        state.pending = []
        state.pending_count = 0  # buffered rows go at teardown (the slot stays ours till then)

    def _teardown(self, request_id: str) -> None:
        """Forget a finished or aborted request: unpublished rows go, published blocks stay."""
        state = self._requests.pop(request_id, None)
        if state is not None and state.slot >= 0:
            self._steady.leave(state.slot)
        with self._publication.one_tail_submission():
            if state is not None and state.lease and state.failure is None:
                self._publication.lease_blocks(state.keys)
            if request_id not in self._buffer:
                return
            if state is not None and state.tail is not None and state.failure is None:
                try:
                    self._publish_tail(request_id, state, state.tail)
                except Exception:  # a tail is optional: never let it fail the step
                    logger.exception("vllm-artifact: request %s: tail not published", request_id)
        if request_id in self._buffer:
            self._buffer.drop(request_id)

    def _publish_tail(self, request_id: str, state: RequestState, tail: TailBlock) -> None:
        """The rows of the scheduler's tail become one object keyed by the tail hash.

        Rank zero may hold rows past the scheduler's last token (speculative decoding
        verified drafts beyond ``max_tokens``, which vLLM then dropped): they may even have
        completed the tail's block, which then waits unkeyed. Only the scheduler's rows are
        published; a gap before the tail (unkeyed earlier blocks) publishes nothing.
        """
        block_size = self._layout.block_size
        index, count = tail.start // block_size, tail.num_tokens
        rows: np.ndarray | None = None
        if tail.start % block_size or any(i < index for i in state.unkeyed):
            rows = None
        elif index in state.unkeyed:
            rows = state.unkeyed[index][:count]
            self._buffer.drop(request_id)
        else:
            buffered = self._buffer.take_tail(request_id)
            if buffered.token_start == tail.start and len(buffered.rows) >= count:
                rows = buffered.rows[:count]
        if rows is None or len(rows) != count:
            logger.warning(
                "vllm-artifact: request %s finished without the rows of its last %d tokens "
                "from token %d; the tail is not published",
                request_id,
                count,
                tail.start,
            )
            return
        key = tail_block_key(self.namespace, tail.hash, count)
        run = BlockRun([key], np.ascontiguousarray(rows), tail.start)
        self._publication.add_tail(run, lease=state.lease)
        self.tails_published += 1
