"""Worker side of the Artifact Connector: capture on every TP rank, one writer on rank zero.

Runs inside vLLM's Model Runner V2 (installed by ``hooks/worker_factory.py``) as the
:class:`~vllm_artifact.contract.WorkerConnector` it expects (``begin_step``, ``prepare_output``,
``close``; the pending step is a :class:`~vllm_artifact.contract.PendingStep`); when and on
which thread MRV2 calls each is in :mod:`vllm_artifact.contract`.

vLLM's ``RoutedExpertsCapturer`` (as :class:`~.capture.BatchedEagerCapturer`, which joins an
eager step's layers once) takes each step's router top-k on every TP rank (capture joins TP
collectives). On TP rank zero this module cuts each request's rows out of the step (dropping
rejected draft tokens) and hands them, with the scheduler's facts, to the pure
:class:`~vllm_artifact.core.tracker.RequestTracker`, which buffers, publishes (in the
background) and emits rows, reading KV-cache hits from the /dev/shm store and failing single
requests closed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_artifact.contract import (
    PendingStep,
    StepResult,
    StorageWorkerConnector,
    WorkerConnector,
)
from vllm_artifact.core.buffer import copy_rows
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.handoff import KeysContext
from vllm_artifact.core.publisher import MEMORY_STORE_INLINE_FROM_BLOCKS, Publisher
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch
from vllm_artifact.core.store import ObjectStore, ShmStore
from vllm_artifact.core.store.node_stores import NodeStores
from vllm_artifact.core.store.shm_arena import ArenaGeometry
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.errors import InternalError
from vllm_artifact.integration.capture import BatchedEagerCapturer, batching_applies
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.engine_store import (
    EngineStore,
    open_backend,
    record_weight_version,
)
from vllm_artifact.integration.kv_events import eviction_id
from vllm_artifact.integration.namespace import model_identity, moe_layer_ids, r3_layout
from vllm_artifact.integration.vllm_contract import ArtifactStepMetadata

if TYPE_CHECKING:
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = logging.getLogger("vllm.artifact.worker")

#: Store capacity "auto" holds this many times the R3 of every block the KV cache can hold,
#: so store eviction (least recently used first) lags far behind KV eviction.
AUTO_CAPACITY_FACTOR = 2


def offloaded_kv_blocks(vllm_config: Any, kv_cache_config: Any) -> int:
    """KV blocks a KV offload connector can hold besides the engine's KV cache (vLLM 0.32's
    ``--kv-offloading-size`` becomes ``cpu_bytes_to_use`` of the offloading connector), so
    ``auto`` capacity covers every block a prefix hit can be served from."""
    transfer = vllm_config.kv_transfer_config
    offload_bytes = (
        (transfer.kv_connector_extra_config or {}).get("cpu_bytes_to_use") if transfer else None
    )
    kv_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
    if not offload_bytes or not kv_bytes or not kv_cache_config.num_blocks:
        return 0
    # Bytes of one block on this rank; if the offload size is for all ranks this overcounts,
    # which only makes the store larger.
    return int(float(offload_bytes) * kv_cache_config.num_blocks // kv_bytes)


@dataclass
class PendingArtifactStep:
    """One step's capture snapshot until MRV2's output thread consumes it."""

    connector: ArtifactWorkerConnector
    request_ids: list[str]
    token_starts: np.ndarray
    query_start_loc: np.ndarray
    snapshot: torch.Tensor | None
    #: Why the step has no snapshot (its requests fail closed in process_output).
    error: InternalError | None = None
    rows: np.ndarray | None = None
    num_sampled: np.ndarray | None = None
    num_rejected: np.ndarray | None = None
    #: ``rows`` lies in pinned host memory (torch's caching host allocator): a GPU copy.
    pinned: bool = False

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Start the device-to-host copy (MRV2 calls this on its output copy stream)."""
        self.num_sampled = num_sampled
        self.num_rejected = num_rejected
        if self.snapshot is not None:
            self.pinned = self.snapshot.is_cuda
            self.rows = self.snapshot.to("cpu", non_blocking=True).numpy()

    def take_rows(self, arrays: RecycledArrays | None = None) -> np.ndarray | None:
        """The step's rows, in memory that is the caller's to keep. Views of them outlive the
        step (a prompt's rows held across chunks, rows sent to the frontend) and would keep a
        GPU copy's whole page-locked buffer alive with them, so that buffer is copied out
        (into ``arrays``' reused memory if given) and released here: the pinned memory in use
        stays that of the steps in flight."""
        rows, self.rows = self.rows, None
        if rows is not None and self.pinned:
            # The last reference to the pinned buffer goes with the view.
            rows = copy_rows(rows, arrays)
        return rows

    def process_output(self) -> StepResult:
        return self.connector.process_output(self)


class ArtifactWorkerConnector:
    """Capture on every rank; buffer, publish and emit on the output rank (TP rank zero)."""

    def __init__(
        self, *, model: torch.nn.Module, vllm_config: Any, kv_cache_config: Any = None
    ) -> None:
        """Bind the capturer (every rank); with ``kv_cache_config`` (vLLM 0.32) also open
        the output side, else vLLM 0.34 calls :meth:`initialize_output_storage` later."""
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            bind_routed_experts_capturer,
        )

        scheduler_config = vllm_config.scheduler_config
        self._capturer = BatchedEagerCapturer(
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            vllm_config=vllm_config,
        )
        bind_routed_experts_capturer(model, self._capturer)
        if batching_applies(vllm_config):
            self._capturer.batch_eager_steps(len(moe_layer_ids(model)))
        self._model = model
        self._vllm_config = vllm_config
        self._lock = threading.Lock()  # MRV2's output thread and the step thread both call in
        self._generation = 0
        self._step_active = False
        self._output_ready = False
        self._engine_store: EngineStore | None = None
        self._store: ObjectStore | None = None
        self._node_stores: NodeStores | None = None
        self._publisher: Publisher | None = None
        self._tracker: RequestTracker | None = None
        self._keys_context: KeysContext | None = None  # sent to the scheduler once
        if kv_cache_config is not None:
            self.initialize_output_storage(kv_cache_config)

    def initialize_output_storage(self, kv_cache_config: Any) -> None:
        """Open the store, publisher and tracker on the output rank (TP rank zero), once the
        KV cache's layout is known; a second call (vLLM re-initialising) keeps them."""
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        if self._output_ready:
            return
        self._output_ready = True
        if not get_tp_group().is_first_rank:
            return
        model, vllm_config = self._model, self._vllm_config
        scheduler_config = vllm_config.scheduler_config
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
        # Blocks a prefix hit can come from: the engine's KV cache and a KV offload's CPU tier.
        kv_blocks = kv_cache_config.num_blocks + offloaded_kv_blocks(vllm_config, kv_cache_config)
        kv_hash_blocks = kv_blocks * (scheduler_block_size // hash_block_size)
        capacity = self._capacity(config, kv_hash_blocks)
        dp_rank = vllm_config.parallel_config.data_parallel_rank
        self._engine_store = open_backend(
            config,
            family=self._store_family(),
            dp_rank=dp_rank,
            layout=self._layout,
            capacity=capacity,
        )
        self._store = self._engine_store.store
        # With /dev/shm, KV hits on blocks another engine of this node computed (a PD
        # producer, a shared KV tier) read their R3 from that engine's store.
        self._node_stores = self._engine_store.node_stores
        # A memory store's large batches are written inline (core/publisher.py says why).
        self._publisher = Publisher(
            self._store,
            inline_from_blocks=(
                MEMORY_STORE_INLINE_FROM_BLOCKS if self._store.writes_local_memory else None
            ),
        )
        self._tracker = RequestTracker(
            self._layout,
            self._model_id,
            self._store,
            self._publisher,
            buffer_max_bytes=max(
                self._layout.block_nbytes * 4 * scheduler_config.max_num_seqs,
                scheduler_config.max_num_batched_tokens * self._layout.row_nbytes * 4,
            ),
            block_id=eviction_id,
            lease_seconds=config.keys_lease_seconds,
            node_stores=self._node_stores,
        )
        self._keys_context = KeysContext(self._engine_store.address, self._model_id, self._layout)
        logger.info(
            "vllm-artifact: R3 store %s (%s) capacity=%.1f MiB ttl=%.0f s "
            "(KV, offloaded KV included, holds %d blocks of %d tokens) namespace: %s",
            self._engine_store.address.describe(),
            config.backend,
            capacity / 2**20,
            config.ttl_seconds,
            kv_hash_blocks,
            hash_block_size,
            self._tracker.namespace.describe(),
        )
        if isinstance(self._store, ShmStore):
            self._log_shm_store(self._store, capacity, kv_hash_blocks)

    def _log_shm_store(self, store: ShmStore, capacity: int, kv_hash_blocks: int) -> None:
        """What a restarted engine recovered, and a capacity below the KV cache's R3."""
        recovery = store.recovery
        if recovery is not None and (recovery.objects or recovery.recreated):
            logger.info(
                "vllm-artifact: R3 store %s: %s; %d objects kept, %d half-written and %d "
                "invalid slots dropped",
                store.name,
                recovery.reason,
                recovery.objects,
                recovery.dropped_partial,
                recovery.dropped_invalid,
            )
        slots = store.geometry.slot_count
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

    def _store_family(self) -> str:
        """The name prefix of every store of this model and R3 layout (all DP ranks and
        engines): the stores whose objects this engine may read."""
        identity = f"{self._model_id}\n{self._layout.canonical()}".encode()
        return f"r3-{hashlib.blake2b(identity, digest_size=6).hexdigest()}-dp"

    @property
    def store(self) -> ObjectStore | None:
        return self._store

    @property
    def reads(self) -> int:
        """Objects read from the store for KV-cache hits (tests and metrics)."""
        return 0 if self._tracker is None else self._tracker.reads

    @property
    def adopted(self) -> int:
        """Objects of those read from another engine's store on the node (and adopted)."""
        return 0 if self._tracker is None else self._tracker.adopted

    @property
    def tails_published(self) -> int:
        """Terminal partial blocks published (requests that finished normally)."""
        return 0 if self._tracker is None else self._tracker.tails_published

    def flush_publications(self, timeout: float = 30.0) -> None:
        """Wait until every object submitted so far is published (or failed): counts read
        after it do not race the background writer."""
        publisher = self._publisher
        if publisher is not None:
            publisher.flush(timeout=timeout)

    # ------------------------------------------------------------ step hooks

    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None:
        """Apply the scheduler's request, block-hash and finish updates for this step."""
        self._step_active = metadata is not None
        self._capturer.step_started()
        tracker = self._tracker
        if tracker is None or metadata is None:
            return
        if not isinstance(metadata, ArtifactStepMetadata):
            raise InternalError(
                f"the step metadata is a {type(metadata).__name__}, not vllm-artifact's "
                "(the scheduler is not ours: see --enable-routed-experts)"
            )
        with self._lock, tracker.one_submission():
            if tracker.set_weight_version(metadata.weight_version):
                logger.info("vllm-artifact: weight version now %r", metadata.weight_version)
                if self._store is not None:
                    record_weight_version(self._store, metadata.weight_version)
            if metadata.generation != self._generation:
                tracker.reset()  # vLLM resets the prefix cache only with no output in flight
                self._generation = metadata.generation
            for request_id, emit_start in metadata.requests.items():
                tracker.admit(request_id, int(emit_start))
            tracker.add_block_hashes(metadata.block_hashes)
            # After publishing (and pinning) newly keyed blocks: a block may be evicted already.
            if metadata.kv_cleared:
                tracker.kv_cleared()
            tracker.kv_evicted(metadata.kv_evicted)
            tails = metadata.tails
            tracker.finish_all(
                ((rid, tails.get(rid)) for rid in metadata.finished_requests),
                leased=frozenset(metadata.leases),
            )

    def prepare_output(self, input_batch: InputBatch) -> PendingArtifactStep | None:
        """Snapshot this step's rows for the asynchronous copy (rank zero only)."""
        if self._tracker is None or not self._step_active:
            return None
        self._step_active = False  # one prepare per begin_step (dummy runs get none)
        request_ids = list(input_batch.req_ids)
        query_start_loc = np.array(input_batch.query_start_loc_np[: len(request_ids) + 1])
        snapshot, error = None, None
        try:
            snapshot = self._capturer.snapshot_routing_data(int(query_start_loc[-1]))
        except InternalError as refused:  # the step's requests fail closed, the engine goes on
            logger.error("vllm-artifact: the step's routed experts: %s", refused)
            error = refused
        pending = PendingArtifactStep(
            connector=self,
            request_ids=request_ids,
            token_starts=np.array(input_batch.num_computed_tokens_np[: len(request_ids)]),
            query_start_loc=query_start_loc,
            snapshot=snapshot,
            error=error,
        )
        with self._lock:
            self._tracker.step_started(request_ids)
        return pending

    def process_output(self, pending: PendingArtifactStep) -> StepResult:
        """Turn one consumed snapshot into per-request rows (or failures). Runs on MRV2's
        output thread: it never raises (that would kill the worker); a step that cannot be
        processed fails its requests."""
        try:
            return self._process_output(pending)
        except Exception as error:
            logger.exception("vllm-artifact: a step's R3 could not be processed")
            failure = R3Failure(
                "internal",
                f"R3 (routed experts) of this step could not be processed: {error} (an internal "
                "error of vllm-artifact: please report it)",
            )
            return StepResult(entries=dict.fromkeys(pending.request_ids, failure))

    def _process_output(self, pending: PendingArtifactStep) -> StepResult:
        if pending.error is not None:
            raise pending.error
        arrays = None if self._tracker is None else self._tracker.arrays
        rows = pending.take_rows(arrays)
        sampled, rejected = pending.num_sampled, pending.num_rejected
        if rows is None or sampled is None or rejected is None or self._tracker is None:
            raise InternalError("process_output ran before enqueue_cpu_copy")
        if rows.dtype != self._layout.dtype:  # only top-1 models with exactly 256 experts
            rows = rows.astype(self._layout.dtype)
        # vLLM leaves dense layers 0 (expert 0's id): mark them, see core/schema.py.
        self._layout.mark_dense(rows)
        n = len(pending.request_ids)
        starts, ends = pending.query_start_loc[:-1], pending.query_start_loc[1:]
        step = StepBatch(
            request_ids=pending.request_ids,
            token_starts=pending.token_starts,
            num_scheduled=ends - starts,
            row_starts=starts,
            row_ends=ends - rejected[:n],
            sampled=sampled[:n] > 0,
            rows=rows,
        )
        with self._lock:
            result = self._tracker.step_finished(step)
        if self._keys_context is not None:
            result.keys_context, self._keys_context = self._keys_context, None
        return result

    def close(self) -> None:
        with self._lock:
            if self._publisher is not None:
                self._publisher.close()
                self._publisher = None
            if self._engine_store is not None:
                self._engine_store.close()
                self._engine_store = None
                self._store = self._node_stores = None


if TYPE_CHECKING:  # mypy holds both classes to the contract's protocols
    _connector: type[WorkerConnector] = ArtifactWorkerConnector
    _storage: type[StorageWorkerConnector] = ArtifactWorkerConnector
    _pending: type[PendingStep] = PendingArtifactStep
