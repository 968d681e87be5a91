"""The Artifact Connector's contract with vLLM: who calls what, when, where, and what crosses.

It sits at the package top and imports no vLLM at runtime (vLLM's types appear in annotations
only), like ``errors.py``, because both the pure core (whose tracker builds the
worker->scheduler results) and the integration layer (whose connectors vLLM calls) import it.
The two halves that need vLLM at runtime are in ``integration/vllm_contract.py``: the
metadata class that extends vLLM's, and the import-time check that vLLM's connector classes
still have every method below.

One engine step
---------------

Processes: the EngineCore (the scheduler; also the workers with the in-process executor) and
one worker process per GPU (multiprocess executor). Calls 1-5 of step N+1 may run before 6
of step N (async scheduling keeps one step in flight).

1. ``SchedulerConnector.build_connector_meta(scheduler_output, requests)``: EngineCore,
   busy-loop thread, at the end of ``Scheduler.schedule``. Returns the step's
   :class:`ArtifactStepFields` joined with vLLM's own step metadata (emit starts of new
   requests, new KV block hashes, finished requests); vLLM sends it to every worker in the
   ``SchedulerOutput``.
2. ``WorkerConnector.begin_step(metadata)``: every TP rank, the worker's execute thread,
   in ``GPUModelRunner.execute_model`` before the forward. TP rank zero applies it (admits
   requests, keys and publishes blocks, unpins evicted ones, tears finished requests down);
   the others only capture.
3. ``WorkerConnector.prepare_output(input_batch)``: same thread, in
   ``GPUModelRunner.sample_tokens`` after sampling. Rank zero snapshots the step's captured
   routing on the device and returns a :class:`PendingStep` (None elsewhere, and for a step
   ``begin_step`` did not announce).
4. ``PendingStep.enqueue_cpu_copy(num_sampled=..., num_rejected=...)``: same thread, with
   MRV2's output copy stream current (``AsyncOutput``); starts the device-to-host copy.
5. ``PendingStep.process_output()``: where the step's output is collected, after the copy
   event: the worker's async output thread (multiprocess executor, async scheduling), its
   execute thread (without async scheduling), or the EngineCore thread that waits for the
   step (in-process executor). Returns the step's :class:`StepResult`, which vLLM carries to
   the scheduler in ``ModelRunnerOutput.aux_output_connector_output`` (pickled between
   processes).
6. ``SchedulerConnector.take_output(request, output)``: EngineCore, busy-loop thread, in
   ``Scheduler.update_from_output``, once per request that emits output this step (the same
   ``output`` each time). Returns the request's rows for vLLM to append to its routed experts
   (or, at its end, a keys-only request's handle); never raises.
7. ``SchedulerConnector.request_finished(request)``: EngineCore, busy-loop thread, when a
   request finishes, is aborted or is preempted. What it queues (the finish, the tail's
   hash) goes to the workers with the next step's metadata (1).

vLLM 0.34 adds four calls (:class:`HitCappingSchedulerConnector`,
:class:`StorageWorkerConnector`): the scheduler asks ``max_cache_hit(request)`` and
``cap_external_hit(request, num_local, num_external)`` at a request's prefix-cache lookup and
tells ``request_loading(request, num_tokens)`` of asynchronous KV loads (EngineCore, busy-loop
thread); Model Runner V2 builds the worker connector without the KV cache layout (also during
memory profiling) and then calls ``initialize_output_storage(kv_cache_config)`` once the KV
cache is allocated (the worker's execute thread, before warm-up). Ours never caps a hit: the
KV cache stays authoritative (``docs/compatibility.md``, "vLLM versions").

Around these, our scheduler (``integration/scheduler.py``) feeds the scheduler connector KV
evictions (in ``schedule``), each step's failures before vLLM processes the step, and turns
failures found during ``take_output`` into errored requests after it; ``close()`` runs on
each worker at shutdown.

Failure semantics: a request whose R3 cannot be delivered completely becomes an
:class:`~vllm_artifact.core.failure.R3Failure` in the step result (or a late failure on the
scheduler side); the scheduler finishes it with an error. Steps 2-6 never raise for one
request's fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.handoff import KeysContext
from vllm_artifact.core.npy import byte_offset
from vllm_artifact.errors import InternalError

if TYPE_CHECKING:
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.input_batch import InputBatch

__all__ = [
    "ArtifactStepFields",
    "EmittedRows",
    "HitCappingSchedulerConnector",
    "PendingStep",
    "SchedulerConnector",
    "StepResult",
    "StorageWorkerConnector",
    "TailBlock",
    "WorkerConnector",
]

# ------------------------------------------------------------------ scheduler -> worker


class TailBlock(NamedTuple):
    """A finished request's terminal partial block as the scheduler hashed it: tokens
    ``[start, start + num_tokens)``, ``start`` on a block boundary."""

    hash: bytes
    start: int
    num_tokens: int


@dataclass(kw_only=True)
class ArtifactStepFields:
    """What our scheduler connector adds to vLLM's step metadata (``AuxOutputConnectorMetadata``:
    generation, emit starts of new requests, new block hashes, finished requests); the class
    that joins both is ``integration.vllm_contract.ArtifactStepMetadata``."""

    #: The weight version the worker keys this step's objects under.
    weight_version: str
    #: Requests that finished normally (not aborted, preempted or failed) with a terminal
    #: partial block: request id -> its hash, first token and token count. The hash is
    #: computed like a KV block hash (same function, parent hash and extra keys) over the
    #: tail's tokens.
    tails: dict[str, TailBlock] = field(default_factory=dict)
    #: Blocks the KV cache evicted since the last step (ids from ``eviction_id``), and whether
    #: it dropped every block (prefix-cache reset): their objects stop being pinned.
    kv_evicted: list[int] = field(default_factory=list)
    kv_cleared: bool = False
    #: Keys-only requests answered with a handle since the last step: rank zero leases the
    #: objects the handle names (``--artifact-keys-lease``).
    leases: list[str] = field(default_factory=list)
    #: New requests whose first rows may reach the frontend as a ``.npy`` file with room for
    #: the rest (``core/row_file.py``; requests the engine ends itself): request id -> the
    #: rows still to come at most (its token budget less one).
    first_rows_room: dict[str, int] = field(default_factory=dict)
    #: Whether the step runs a forward pass (vLLM runs none for a step without scheduled
    #: tokens, and then never prepares its output): rank zero applies the step's facts once
    #: the forward is queued, or at once for a step without one.
    runs_forward: bool = True


# ------------------------------------------------------------------ worker -> scheduler


class EmittedRows(NamedTuple):
    """Rows for tokens ``[token_start, token_start + len(rows))``."""

    token_start: int
    rows: np.ndarray


class _RowsInFile(NamedTuple):
    """Emitted rows pickled as where they lie in their file (``StepResult.files``)."""

    token_start: int
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(
        cls, entry: EmittedRows | R3Failure, file: np.ndarray | None
    ) -> EmittedRows | R3Failure | _RowsInFile:
        if file is None or not isinstance(entry, EmittedRows):
            return entry
        rows = entry.rows
        offset = byte_offset(rows, file)
        if not rows.flags.c_contiguous or not 0 <= offset <= file.nbytes - rows.nbytes:
            return entry
        return cls(entry.token_start, offset, rows.shape, rows.dtype.str)

    def rows_in(self, file: np.ndarray) -> EmittedRows:
        count = int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize
        data = file[self.offset : self.offset + count]
        return EmittedRows(self.token_start, data.view(self.dtype).reshape(self.shape))


@dataclass
class StepResult:
    """One step's rows for the scheduler: requests in steady decode column-wise (one row
    each, no per-request object), every other request's rows or failure in ``entries``.

    It crosses the worker -> scheduler process boundary as is (pickled), so a decode batch
    costs one array and one list there too; :meth:`rows_by_id` is the scheduler's lookup.
    """

    entries: dict[str, EmittedRows | R3Failure] = field(default_factory=dict)
    decode_ids: list[str] = field(default_factory=list)
    decode_token_starts: list[int] = field(default_factory=list)
    decode_rows: np.ndarray | None = None  # [len(decode_ids), layers, top_k]
    #: Where rank zero's store is and what its keys are made of; sent with the first step
    #: (the scheduler builds keys-only handles from it).
    keys_context: KeysContext | None = None
    #: request id -> the file (``core/row_file.py``) its emitted rows are the data part of.
    #: Pickled, such rows travel as their place in the file, which travels once.
    files: dict[str, np.ndarray] = field(default_factory=dict)
    # request id -> (token_start, rows), built on first lookup (one C-level pass)
    _rows_by_id: dict[str, tuple[int, np.ndarray]] | None = field(
        default=None, repr=False, compare=False
    )

    def __getstate__(self) -> dict[str, object]:
        state = {**self.__dict__, "_rows_by_id": None}  # rebuilt lazily on the other side
        if self.files:
            state["entries"] = {
                rid: _RowsInFile.of(entry, self.files.get(rid))
                for rid, entry in self.entries.items()
            }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        files, entries = state.get("files"), state["entries"]
        if files:
            state["entries"] = {
                rid: entry.rows_in(files[rid]) if isinstance(entry, _RowsInFile) else entry
                for rid, entry in entries.items()
            }
        self.__dict__.update(state)

    def rows_by_id(self, decode: list[int] | None = None) -> dict[str, tuple[int, np.ndarray]]:
        """Every request's ``(token_start, rows)`` this step (failed ones excluded); with
        ``decode``, of the decode columns only those at these positions."""
        rows_by_id = self._rows_by_id
        if rows_by_id is not None and decode is None:
            return rows_by_id
        rows_by_id = {
            rid: entry for rid, entry in self.entries.items() if isinstance(entry, EmittedRows)
        }
        if self.decode_ids:
            rows = self.decode_rows
            if rows is None:
                raise InternalError("a step result names decode requests but has no rows")
            if decode is None:
                views = zip(self.decode_token_starts, rows[:, None], strict=True)
                rows_by_id.update(zip(self.decode_ids, views, strict=True))
                self._rows_by_id = rows_by_id
            else:
                ids, starts = self.decode_ids, self.decode_token_starts
                rows_by_id.update((ids[i], (starts[i], rows[i : i + 1])) for i in decode)
        return rows_by_id

    @classmethod
    def unprocessed(cls, request_ids: Sequence[str], error: Exception) -> StepResult:
        """A step that could not be processed: each of its requests fails (an internal error
        of ours; the engine goes on)."""
        failure = R3Failure(
            "internal",
            f"R3 (routed experts) of this step could not be processed: {error} (an internal "
            "error of vllm-artifact: please report it)",
        )
        return cls(entries=dict.fromkeys(request_ids, failure))

    def failures(self) -> dict[str, R3Failure]:
        """The requests that failed this step."""
        return {rid: e for rid, e in self.entries.items() if isinstance(e, R3Failure)}


# ------------------------------------------------------------------ who vLLM calls


class SchedulerConnector(Protocol):
    """What vLLM's ``Scheduler`` calls on ``aux_output_connector`` (vLLM's
    ``AuxOutputSchedulerConnector`` has the same methods)."""

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> AuxOutputConnectorMetadata: ...

    def take_output(self, request: Request, output: object) -> np.ndarray | None:
        """``output`` is whatever the worker's step output carries (ours: a
        :class:`StepResult`, or None on a step without one)."""
        ...

    def request_finished(self, request: Request) -> None: ...


class HitCappingSchedulerConnector(SchedulerConnector, Protocol):
    """vLLM 0.34's scheduler connector: also asked how long a prefix hit may be."""

    def max_cache_hit(self, request: Request) -> int | None: ...

    def cap_external_hit(self, request: Request, num_local: int, num_external: int) -> int: ...

    def request_loading(self, request: Request, num_tokens: int) -> None: ...


class PendingStep(Protocol):
    """One step's capture between ``prepare_output`` and ``process_output`` (vLLM's
    ``PendingAuxOutput``). MRV2 passes ``enqueue_cpu_copy``'s arguments by keyword."""

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None: ...

    def process_output(self) -> StepResult: ...


class WorkerConnector(Protocol):
    """What Model Runner V2 calls on ``aux_output_connector`` (vLLM's
    ``AuxOutputWorkerConnector`` has the same methods)."""

    def begin_step(self, metadata: AuxOutputConnectorMetadata | None) -> None: ...

    def prepare_output(self, input_batch: InputBatch) -> PendingStep | None: ...

    def close(self) -> None: ...


class StorageWorkerConnector(WorkerConnector, Protocol):
    """vLLM 0.34's worker connector: built before the KV cache exists, given its layout
    after."""

    def initialize_output_storage(self, kv_cache_config: KVCacheConfig) -> None: ...
