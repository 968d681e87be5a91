"""Worker side of the Artifact Connector: capture on every TP rank, one writer on rank zero.

Runs inside vLLM's Model Runner V2 (installed by ``hooks/worker_factory.py``) as the
:class:`~vllm_artifact.contract.WorkerConnector` it expects (``begin_step``, ``prepare_output``,
``close``; the pending step is a :class:`~vllm_artifact.contract.PendingStep`); when and on
which thread MRV2 calls each is in :mod:`vllm_artifact.contract`.

vLLM's ``RoutedExpertsCapturer`` (as :class:`~.capture.BatchedEagerCapturer`, which joins an
eager step's layers once) takes each step's router top-k on every TP rank (capture joins TP
collectives). On TP rank zero this module cuts each request's rows out of the step (dropping
rejected draft tokens) and hands them, with the scheduler's facts, to the pure
:class:`~vllm_artifact.core.tracker.RequestTracker`, which buffers, publishes and emits rows,
reading KV-cache hits from the /dev/shm store and failing single requests closed: in this
process, or with ``--artifact-tracker process`` in a process of its own
(``tracker_process.py``), fed each step's rows through shared memory.
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
from vllm_artifact.core.handoff import KeysContext
from vllm_artifact.core.publisher import Publisher
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch
from vllm_artifact.core.step_facts import StepFacts, apply_step_facts
from vllm_artifact.core.store import ObjectStore
from vllm_artifact.core.store.shm_arena import ArenaGeometry
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.errors import InternalError
from vllm_artifact.integration.capture import BatchedEagerCapturer, batching_applies
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.engine_store import (
    EngineStore,
    record_weight_version,
)
from vllm_artifact.integration.namespace import model_identity, moe_layer_ids, r3_layout
from vllm_artifact.integration.output_side import OutputSetup, open_output_side
from vllm_artifact.integration.switch_interval import SwitchInterval
from vllm_artifact.integration.tracker_process import ANSWER_TIMEOUT_S, TrackerProcess
from vllm_artifact.integration.tracker_service import TrackerCounters
from vllm_artifact.integration.vllm_contract import ArtifactStepMetadata

if TYPE_CHECKING:
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata
    from vllm.v1.worker.gpu.input_batch import InputBatch

logger = logging.getLogger("vllm.artifact.worker")

#: Store capacity "auto" holds this many times the R3 of every block the KV cache can hold,
#: so store eviction (least recently used first) lags far behind KV eviction.
AUTO_CAPACITY_FACTOR = 2


def step_facts(metadata: ArtifactStepMetadata) -> StepFacts:
    """vLLM's step metadata as the tracker's plain :class:`StepFacts`."""
    return StepFacts(
        weight_version=metadata.weight_version,
        generation=metadata.generation,
        admitted=metadata.requests,
        block_hashes=metadata.block_hashes,
        kv_cleared=metadata.kv_cleared,
        kv_evicted=metadata.kv_evicted,
        finished=tuple(metadata.finished_requests),
        tails=metadata.tails,
        leases=frozenset(metadata.leases),
        first_rows_room=metadata.first_rows_room,
    )


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
    #: The step's number, in the order steps were started (the tracker process's answers).
    seq: int = 0
    #: Recorded after a GPU copy: it has landed once this completes.
    copy_done: torch.cuda.Event | None = None

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        """Start the device-to-host copy (MRV2 calls this on its output copy stream)."""
        self.num_sampled = num_sampled
        self.num_rejected = num_rejected
        if self.snapshot is not None:
            self.pinned = self.snapshot.is_cuda
            self.rows = self.snapshot.to("cpu", non_blocking=True).numpy()
            if self.pinned and self.connector.tracks_in_a_process:
                # The tracker process is sent the rows once they land (not in-engine: there
                # process_output is called after MRV2 waited for the copy).
                self.copy_done = torch.cuda.Event()
                self.copy_done.record()

    def copied(self, wait: bool = False) -> bool:
        """The rows are in host memory (``wait``: once they are); False before
        ``enqueue_cpu_copy``."""
        if self.num_sampled is None:
            return False
        if self.copy_done is not None:
            if wait:
                self.copy_done.synchronize()
            elif not self.copy_done.query():
                return False
        return True

    def columns(self, rows: np.ndarray) -> dict[str, Any]:
        """The step's columns besides its rows, as :class:`StepBatch` takes them."""
        sampled, rejected = self.num_sampled, self.num_rejected
        if sampled is None or rejected is None:
            raise InternalError("process_output ran before enqueue_cpu_copy")
        n = len(self.request_ids)
        starts, ends = self.query_start_loc[:-1], self.query_start_loc[1:]
        return dict(
            request_ids=self.request_ids,
            token_starts=self.token_starts,
            num_scheduled=ends - starts,
            row_starts=starts,
            row_ends=ends - rejected[:n],
            sampled=sampled[:n] > 0,
        )

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
        self._init_state()
        if kv_cache_config is not None:
            self.initialize_output_storage(kv_cache_config)

    def _init_state(self) -> None:
        """Every attribute the engine-facing methods use besides the capturer, model and
        config, output side closed (benchmarks drive those methods without a model)."""
        self._lock = threading.Lock()  # the step thread and (several GPUs) the output thread
        self._generation = 0
        self._facts_due: list[StepFacts] = []  # begun steps' facts, applied in prepare_output
        self._step_active = False
        self._output_ready = False
        self._engine_store: EngineStore | None = None
        self._store: ObjectStore | None = None
        self._publisher: Publisher | None = None
        self._tracker: RequestTracker | None = None
        self._process: TrackerProcess | None = None  # --artifact-tracker process
        self._switch_interval: SwitchInterval | None = None  # rank zero's, while open
        self._steps_started = 0
        self._keys_context: KeysContext | None = None  # sent to the scheduler once

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
        setup = OutputSetup(
            config=config,
            family=self._store_family(),
            dp_rank=vllm_config.parallel_config.data_parallel_rank,
            layout=self._layout,
            model_id=self._model_id,
            capacity=self._capacity(config, kv_hash_blocks),
            kv_hash_blocks=kv_hash_blocks,
            buffer_max_bytes=max(
                self._layout.block_nbytes * 4 * scheduler_config.max_num_seqs,
                scheduler_config.max_num_batched_tokens * self._layout.row_nbytes * 4,
            ),
        )
        if config.tracker == "process":
            self._process = TrackerProcess(setup, max_rows=scheduler_config.max_num_batched_tokens)
            address = self._process.address
        else:
            side = open_output_side(setup)
            self._engine_store, self._publisher = side.engine_store, side.publisher
            self._tracker, self._store = side.tracker, side.store
            address = side.engine_store.address
        self._keys_context = KeysContext(address, self._model_id, self._layout)
        self._switch_interval = SwitchInterval(config.switch_interval_ms)

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
    def tracks_in_a_process(self) -> bool:
        """``--artifact-tracker process`` (whether or not the process is up right now)."""
        return self._process is not None

    @property
    def tracker_pid(self) -> int | None:
        """The tracker process's pid (``--artifact-tracker process``), else None."""
        return None if self._process is None else self._process.pid

    @property
    def steps_answered_here(self) -> int:
        """Steady-decode steps answered by the engine without waiting for the tracker process
        (``core/local_decode.py``); 0 without one."""
        return 0 if self._process is None else self._process.answered_here

    def _counters(self) -> tuple[int, int, int]:
        """The tracker's reads, adoptions and tails published, wherever it runs."""
        if self._process is not None:
            return self._process.counters
        return TrackerCounters.of(self._tracker)

    @property
    def reads(self) -> int:
        """Objects read from the store for KV-cache hits (tests and metrics)."""
        return self._counters()[0]

    @property
    def adopted(self) -> int:
        """Objects of those read from another engine's store on the node (and adopted)."""
        return self._counters()[1]

    @property
    def tails_published(self) -> int:
        """Terminal partial blocks published (requests that finished normally)."""
        return self._counters()[2]

    def flush_publications(self, timeout: float = 30.0) -> None:
        """Wait until every object submitted so far is published (or failed): counts read
        after it do not race the background writer (the tracker process's counters are those
        of its answer to this)."""
        if self._process is not None:
            with self._lock:
                self._process.flush(timeout)
        elif self._publisher is not None:
            with self._lock:
                self._apply_due_facts()
            self._publisher.flush(timeout=timeout)

    # ------------------------------------------------------------ step hooks

    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None:
        """Take the scheduler's request, block-hash and finish updates for this step. It runs
        before the step's forward is queued, which waits for it: the tracker process gets them
        at once (a message); the engine's own tracker applies them in :meth:`prepare_output`,
        once the forward is queued (at once for a step without a forward, which prepares no
        output). The tracker takes a step's facts and the last step's output in either order:
        with several GPUs the worker's output-copy thread processes that output while this
        thread starts the step (on one GPU this thread does both, in turn)."""
        self._step_active = metadata is not None
        self._capturer.step_started()
        tracker, process = self._tracker, self._process
        if (tracker is None and process is None) or metadata is None:
            return
        if not isinstance(metadata, ArtifactStepMetadata):
            raise InternalError(
                f"the step metadata is a {type(metadata).__name__}, not vllm-artifact's "
                "(the scheduler is not ours: see --enable-routed-experts)"
            )
        facts = step_facts(metadata)
        if process is not None:
            with self._lock:
                # The last step first, if its rows have landed: the process works on it while
                # this thread launches this step.
                process.send_copied()
                process.begin(facts)
            return
        self._facts_due.append(facts)
        if not metadata.runs_forward:
            with self._lock:
                self._apply_due_facts()

    def _apply_due_facts(self) -> None:
        """Apply the begun steps' facts to the engine's tracker, in order (the caller holds
        the lock)."""
        tracker, due = self._tracker, self._facts_due
        if tracker is None or not due:
            return
        self._facts_due = []
        for facts in due:
            if apply_step_facts(tracker, facts, self._generation):
                logger.info("vllm-artifact: weight version now %r", facts.weight_version)
                if self._store is not None:
                    record_weight_version(self._store, facts.weight_version)
            self._generation = facts.generation

    def prepare_output(self, input_batch: InputBatch) -> PendingArtifactStep | None:
        """Snapshot this step's rows for the asynchronous copy (rank zero only)."""
        if (self._tracker is None and self._process is None) or not self._step_active:
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
            seq=self._steps_started,
        )
        self._steps_started += 1
        with self._lock:
            if self._process is not None:
                self._process.send_copied()
                self._process.step_started(request_ids)
                self._process.queue_step(pending)
            elif self._tracker is not None:
                self._apply_due_facts()  # this step's and any before it, now the forward is queued
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
            return StepResult.unprocessed(pending.request_ids, error)

    def _process_output(self, pending: PendingArtifactStep) -> StepResult:
        if self._process is not None:
            result = self._answer_from_process(pending)
        else:
            if pending.error is not None:
                raise pending.error
            arrays = None if self._tracker is None else self._tracker.arrays
            rows = pending.take_rows(arrays)
            if rows is None or self._tracker is None:
                raise InternalError("process_output ran before enqueue_cpu_copy")
            columns = pending.columns(rows)
            if rows.dtype != self._layout.dtype:  # only top-1 models with exactly 256 experts
                rows = rows.astype(self._layout.dtype)
            # vLLM leaves dense layers 0 (expert 0's id): mark them, see core/schema.py.
            self._layout.mark_dense(rows)
            with self._lock:
                result = self._tracker.step_finished(StepBatch(rows=rows, **columns))
        if self._keys_context is not None:
            result.keys_context, self._keys_context = self._keys_context, None
        return result

    def _answer_from_process(self, pending: PendingArtifactStep) -> StepResult:
        """The tracker process's answer for ``pending``, waited for without the connector's
        lock: meanwhile the step thread's ``begin_step`` sends the next step's facts (inside
        ``execute_model``, before the forward is queued) instead of waiting for this answer."""
        while True:
            with self._lock:
                process = self._process
                if process is None:
                    raise InternalError("the R3 tracker process was closed")
                if process.answer_at_hand(pending):
                    return process.step_result(pending)
            if not process.wait_for_answers(ANSWER_TIMEOUT_S):
                with self._lock:  # nothing came: step_result waits once more and judges
                    return process.step_result(pending)

    def close(self) -> None:
        with self._lock:
            if self._switch_interval is not None:
                self._switch_interval.restore()
                self._switch_interval = None
            if self._process is not None:
                self._process.close()
                self._process = None
            if self._publisher is not None:
                self._publisher.close()
                self._publisher = None
            if self._engine_store is not None:
                self._engine_store.close()
                self._engine_store = None
                self._store = None


if TYPE_CHECKING:  # mypy holds both classes to the contract's protocols
    _connector: type[WorkerConnector] = ArtifactWorkerConnector
    _storage: type[StorageWorkerConnector] = ArtifactWorkerConnector
    _pending: type[PendingStep] = PendingArtifactStep
