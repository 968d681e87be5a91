"""Worker side of the Artifact Connector: capture on every TP rank, one writer on rank zero.

Runs inside vLLM's Model Runner V2 (installed by ``hooks/worker_factory.py``) with the duck
type MRV2 expects from its AuxOutput connector: ``begin_step(metadata)`` before the forward,
``prepare_output(input_batch)`` after it (returns a pending step whose ``enqueue_cpu_copy`` runs
on the copy stream and whose ``process_output`` yields the step's per-request result), and
``close()``.

Data flow for one request (rank zero only; other TP ranks only capture, since router capture
joins TP collectives):

1. vLLM's ``RoutedExpertsCapturer`` writes this step's router top-k rows on the device.
2. ``process_output`` cuts the request's rows out of the step (dropping rejected draft tokens),
   appends them to the logical row buffer by token index, and hands every completed full
   block whose KV block hash is known to the background publisher (store writes never run on
   the step path).
3. Rows are emitted to the scheduler once per sampled step. Rows the KV cache served (a
   prefix hit) were not computed here: they are read from the store, after waiting for any
   queued publication. If they are missing or corrupt the request gets a
   :class:`RequestFailure` (the scheduler finishes it with an error); other requests go on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_artifact.core.buffer import RequestRowBuffer
from vllm_artifact.core.keys import Namespace, ObjectKey, full_block_keys
from vllm_artifact.core.publisher import BackgroundPublisher, BlockRun
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore, check_shm_space
from vllm_artifact.core.store.shm_arena import ArenaGeometry
from vllm_artifact.errors import ArtifactError, WriterConflictError
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.namespace import model_identity, moe_layer_ids, r3_layout
from vllm_artifact.integration.transport import (
    ArtifactStepMetadata,
    AuxRequestOutput,
    RequestFailure,
    StepOutput,
)

logger = logging.getLogger("vllm.artifact.worker")

#: Store capacity "auto" holds this many times the R3 of every block the KV cache can hold,
#: so store eviction (least recently used first) lags far behind KV eviction.
AUTO_CAPACITY_FACTOR = 2


@dataclass
class _Track:
    """Rank zero's view of one running request."""

    emit_cursor: int  # first token whose row the scheduler has not received yet
    keys: list[ObjectKey] = field(default_factory=list)  # block i -> keys[i]
    unkeyed: dict[int, np.ndarray] = field(default_factory=dict)  # complete blocks, no hash yet
    pending_start: int | None = None  # token of the first captured, unemitted row
    pending: list[np.ndarray] = field(default_factory=list)
    capture_end: int | None = None  # token after the last captured row
    scheduled_end: int = 0  # the scheduler's (possibly optimistic) end of the last step
    in_flight: int = 0  # prepared steps not yet processed
    finished: bool = False
    failure: RequestFailure | None = None
    failure_sent: bool = False

    def pending_rows(self) -> int:
        return sum(len(rows) for rows in self.pending)


@dataclass
class PendingArtifactStep:
    """One step's capture snapshot until MRV2's output thread consumes it."""

    connector: ArtifactWorkerConnector
    request_ids: list[str]
    token_starts: np.ndarray
    query_start_loc: np.ndarray
    snapshot: torch.Tensor
    rows: np.ndarray | None = None
    num_sampled: np.ndarray | None = None
    num_rejected: np.ndarray | None = None

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Start the device-to-host copy (MRV2 calls this on its output copy stream)."""
        self.num_sampled = num_sampled
        self.num_rejected = num_rejected
        self.rows = self.snapshot.to("cpu", non_blocking=True).numpy()

    def process_output(self) -> StepOutput:
        return self.connector.process_output(self)


class ArtifactWorkerConnector:
    """Capture on every rank; buffer, publish and emit on the output rank (TP rank zero)."""

    def __init__(self, *, model: torch.nn.Module, vllm_config: Any, kv_cache_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            bind_routed_experts_capturer,
        )
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        scheduler_config = vllm_config.scheduler_config
        self._capturer = RoutedExpertsCapturer(
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            vllm_config=vllm_config,
        )
        bind_routed_experts_capturer(model, self._capturer)
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._generation = 0
        self._step_active = False
        self._store: ShmStore | None = None
        self._publisher: BackgroundPublisher | None = None
        self.reads = 0  # objects served to prefix hits (observable in tests and metrics)
        if not get_tp_group().is_first_rank:
            return

        config = ArtifactConfig.from_vllm_config(vllm_config)
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config
        )
        num_layers, top_k = self._capturer.shape_per_token
        self._layout: R3Layout = r3_layout(
            num_layers=num_layers,
            top_k=top_k,
            num_experts=vllm_config.model_config.get_num_experts(),
            block_size=hash_block_size,
            moe_layers=moe_layer_ids(model),
        )
        self._model_id = model_identity(vllm_config)
        self._namespace = Namespace(self._model_id, self._layout, "default")
        kv_hash_blocks = kv_cache_config.num_blocks * (scheduler_block_size // hash_block_size)
        capacity = self._capacity(config, kv_hash_blocks)
        check_shm_space(config.root, capacity)
        dp_rank = vllm_config.parallel_config.data_parallel_rank
        self._store = self._open_store(config, capacity, dp_rank)
        self._publisher = BackgroundPublisher(self._store)
        self._buffer = RequestRowBuffer(
            self._layout,
            max_bytes=max(
                self._layout.block_nbytes * 4 * scheduler_config.max_num_seqs,
                scheduler_config.max_num_batched_tokens * self._layout.row_nbytes * 4,
            ),
        )
        logger.info(
            "vllm-artifact: R3 store root=%s name=%s capacity=%.1f MiB ttl=%.0f s "
            "(KV holds %d blocks of %d tokens) namespace: %s",
            config.root,
            self._store.name,
            capacity / 2**20,
            config.ttl_seconds,
            kv_hash_blocks,
            hash_block_size,
            self._namespace.describe(),
        )
        slots = self._store.geometry.slot_count
        if slots < kv_hash_blocks:
            logger.warning(
                "vllm-artifact: --artifact-capacity %.1f MiB holds %d R3 blocks but the KV cache "
                "can hold %d: a prefix hit on an evicted object fails that request; raise "
                "--artifact-capacity (or use auto) to avoid it",
                capacity / 2**20,
                slots,
                kv_hash_blocks,
            )

    # --------------------------------------------------------------- startup

    def _capacity(self, config: ArtifactConfig, kv_hash_blocks: int) -> int:
        """Arena bytes: ``auto`` fits ``AUTO_CAPACITY_FACTOR`` objects per KV block, with the
        store's own index and header overhead included."""
        if config.capacity == "auto":
            slots = AUTO_CAPACITY_FACTOR * kv_hash_blocks
            return ArenaGeometry(self._layout, slots).file_nbytes
        return int(config.capacity)

    def _open_store(self, config: ArtifactConfig, capacity: int, dp_rank: int) -> ShmStore:
        """Open this engine's store; a second live engine on the same root gets its own."""
        identity = f"{self._model_id}\n{self._layout.canonical()}".encode()
        base = f"r3-{hashlib.blake2b(identity, digest_size=6).hexdigest()}-dp{dp_rank}"
        for name in (base, f"{base}-pid{os.getpid()}"):
            try:
                return ShmStore.create_or_open_writer(
                    config.root,
                    name,
                    layout=self._layout,
                    capacity_bytes=capacity,
                    ttl_seconds=config.ttl_seconds,
                )
            except WriterConflictError:
                logger.info("vllm-artifact: store %s has a live writer; using another", name)
        raise WriterConflictError(f"no free R3 store name under {config.root} for {base}")

    @property
    def store(self) -> ShmStore | None:
        return self._store

    # ------------------------------------------------------------ step hooks

    def begin_step(self, metadata: ArtifactStepMetadata | None) -> None:
        """Apply the scheduler's request, block-hash and finish updates for this step."""
        self._step_active = metadata is not None
        if self._store is None or metadata is None:
            return
        step = metadata.step
        with self._lock:
            if metadata.weight_version != self._namespace.weight_version:
                self._namespace = Namespace(self._model_id, self._layout, metadata.weight_version)
                logger.info("vllm-artifact: weight version now %r", metadata.weight_version)
            if step.generation != self._generation:
                # vLLM resets the prefix cache only with no output in flight.
                for request_id in list(self._tracks):
                    self._teardown(request_id)
                self._generation = step.generation
            for request_id, emit_start in step.requests.items():
                if request_id not in self._tracks:
                    self._tracks[request_id] = _Track(emit_cursor=int(emit_start))
            ready: list[BlockRun] = []
            for request_id, packed in step.block_hashes.items():
                track = self._tracks.get(request_id)
                if track is None:
                    continue
                track.keys.extend(full_block_keys(self._namespace, packed))
                ready += self._keyed_blocks(track)
            self._submit(ready)
            for request_id in step.finished_requests:
                track = self._tracks.get(request_id)
                if track is None:
                    continue
                track.finished = True
                if track.in_flight == 0:
                    self._teardown(request_id)

    def prepare_output(self, input_batch: Any) -> PendingArtifactStep | None:
        """Snapshot this step's rows for the asynchronous copy (rank zero only)."""
        if self._store is None or not self._step_active:
            return None
        self._step_active = False  # one prepare per begin_step (dummy runs get none)
        request_ids = list(input_batch.req_ids)
        query_start_loc = np.array(input_batch.query_start_loc_np[: len(request_ids) + 1])
        pending = PendingArtifactStep(
            connector=self,
            request_ids=request_ids,
            token_starts=np.array(input_batch.num_computed_tokens_np[: len(request_ids)]),
            query_start_loc=query_start_loc,
            snapshot=self._capturer.snapshot_routing_data(int(query_start_loc[-1])),
        )
        with self._lock:
            for request_id in request_ids:
                track = self._tracks.get(request_id)
                if track is None:
                    track = self._tracks[request_id] = _Track(emit_cursor=0)
                    track.failure = RequestFailure(
                        "internal",
                        f"vllm-artifact saw request {request_id} scheduled without its "
                        "metadata; its R3 cannot be trusted. Please report this as a bug.",
                    )
                track.in_flight += 1
        return pending

    def process_output(self, pending: PendingArtifactStep) -> StepOutput:
        """Turn one consumed snapshot into per-request rows (or failures)."""
        rows, sampled, rejected = pending.rows, pending.num_sampled, pending.num_rejected
        assert rows is not None and sampled is not None and rejected is not None, (
            "vllm-artifact: process_output ran before enqueue_cpu_copy"
        )
        outputs: StepOutput = {}
        with self._lock:
            emit_later: list[tuple[str, _Track, int]] = []
            ready: list[BlockRun] = []
            for i, request_id in enumerate(pending.request_ids):
                track = self._tracks[request_id]
                track.in_flight -= 1
                if track.failure is None:
                    start, end = (
                        int(pending.query_start_loc[i]),
                        int(pending.query_start_loc[i + 1]),
                    )
                    kept = rows[start : end - int(rejected[i])]
                    try:
                        token_end = self._capture(
                            request_id, track, int(pending.token_starts[i]), end - start, kept
                        )
                        ready += self._keyed_blocks(track)
                    except ArtifactError as error:
                        self._fail(request_id, track, error)
                    else:
                        if int(sampled[i]) > 0 and track.emit_cursor <= token_end:
                            emit_later.append((request_id, track, token_end))
            # Publish first: a request of this step may hit a block another one just completed.
            self._submit(ready)
            for request_id, track, token_end in emit_later:
                try:
                    outputs[request_id] = self._emit(track, token_end)
                except ArtifactError as error:
                    self._fail(request_id, track, error)
            for request_id in pending.request_ids:
                settled = self._tracks.get(request_id)
                if settled is None:
                    continue
                track = settled
                if track.failure is not None and not track.failure_sent:
                    outputs[request_id] = track.failure
                    track.failure_sent = True
                if track.finished and track.in_flight == 0:
                    self._teardown(request_id)
        return outputs

    def close(self) -> None:
        with self._lock:
            if self._publisher is not None:
                self._publisher.close()
                self._publisher = None
            if self._store is not None:
                self._store.close()
                self._store = None

    # -------------------------------------------------------------- internals

    def _capture(
        self, request_id: str, track: _Track, token_start: int, num_scheduled: int, rows: np.ndarray
    ) -> int:
        """Buffer one step's rows of a request; returns the token after the last row."""
        if track.capture_end is not None and token_start > track.capture_end:
            # Async scheduling planned this step before the previous step's rejected drafts
            # were known; the model ran it from the true position, right after our last row.
            if track.capture_end >= track.scheduled_end:
                raise ArtifactError(
                    f"request {request_id}: R3 rows for tokens {track.capture_end}.."
                    f"{token_start} were never captured"
                )
            token_start = track.capture_end
        track.scheduled_end = token_start + num_scheduled
        self._buffer.append(request_id, token_start, rows)
        token_end = token_start + len(rows)
        if track.pending_start is None:
            track.pending_start = token_start
        elif token_start < track.pending_start + track.pending_rows():
            # Recomputed tokens replace what was captured before.
            keep = max(token_start - track.pending_start, 0)
            merged = np.concatenate(track.pending) if track.pending else rows[:0]
            track.pending = [merged[:keep]]
        track.pending.append(rows)
        track.capture_end = token_end
        blocks = self._buffer.take_full_blocks(request_id)
        for i in range(blocks.num_blocks):
            track.unkeyed[blocks.first_block + i] = blocks.block(i, self._layout.block_size)
        return token_end

    def _keyed_blocks(self, track: _Track) -> list[BlockRun]:
        """Complete blocks whose KV block hash has arrived, as runs of consecutive blocks."""
        ready = sorted(index for index in track.unkeyed if index < len(track.keys))
        runs: list[BlockRun] = []
        bs = self._layout.block_size
        while ready:
            first = end = ready.pop(0)
            while ready and ready[0] == end + 1:
                end = ready.pop(0)
            blocks = [track.unkeyed.pop(index) for index in range(first, end + 1)]
            rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
            runs.append(BlockRun(track.keys[first : end + 1], rows, first * bs))
        return runs

    def _submit(self, runs: list[BlockRun]) -> None:
        if runs and self._publisher is not None:
            self._publisher.submit(runs)

    def _emit(self, track: _Track, token_end: int) -> AuxRequestOutput:
        """Rows ``[emit_cursor, token_end)``: store rows for a prefix hit, then captured rows."""
        emit_start = track.emit_cursor
        assert track.pending_start is not None
        parts: list[np.ndarray] = []
        if emit_start < track.pending_start:
            parts.append(self._read_span(track, emit_start, track.pending_start))
            parts += track.pending
            base = emit_start
        else:
            parts += track.pending
            base = track.pending_start
        rows = np.concatenate(parts) if len(parts) > 1 else parts[0]
        rows = rows[emit_start - base : token_end - base]
        track.pending = []
        track.pending_start = token_end
        track.emit_cursor = token_end
        return AuxRequestOutput(emit_start, rows)

    def _read_span(self, track: _Track, start: int, end: int) -> np.ndarray:
        """Rows ``[start, end)`` from the store (KV-cache hits; fails closed)."""
        assert self._store is not None and self._publisher is not None
        bs = self._layout.block_size
        first, last = start // bs, -(-end // bs)
        if last > len(track.keys):
            raise ArtifactError(
                f"the KV cache served tokens up to {end} but only {len(track.keys) * bs} have "
                "block hashes; R3 for them cannot be located"
            )
        self._publisher.flush()
        out = self._layout.empty((last - first) * bs)
        self._store.read_into(track.keys[first:last], out, token_start=first * bs)
        self.reads += last - first
        return out[start - first * bs : end - first * bs]

    def _fail(self, request_id: str, track: _Track, error: ArtifactError) -> None:
        message = (
            f"R3 (routed experts) for request {request_id} is unavailable ({error.reason}): {error}"
        )
        if error.reason == "missing" and self._namespace.weight_version != "default":
            message += (
                f" The weight version is now {self._namespace.weight_version!r}: tokens the KV "
                "cache kept from older weights have no R3 under it; reset the prefix cache "
                "after every weight update (POST /reset_prefix_cache, LLM.reset_prefix_cache())."
            )
        logger.error("vllm-artifact: %s", message)
        track.failure = RequestFailure(error.reason, message)
        track.pending = []
        if request_id in self._buffer:
            self._buffer.drop(request_id)

    def _teardown(self, request_id: str) -> None:
        """Forget a finished or aborted request: unpublished rows go, published blocks stay."""
        self._tracks.pop(request_id, None)
        if request_id in self._buffer:
            self._buffer.drop(request_id)
