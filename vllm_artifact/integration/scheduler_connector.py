"""Scheduler side of the Artifact Connector (runs on the EngineCore scheduling thread).

Builds on vLLM's ``AuxOutputSchedulerConnector`` for the transport it already does well
(incremental block-hash shipping, per-step emit cursors, slicing each step's rows to the
request's executed tokens) and adds what the Artifact Connector needs:

* the weight version travels with every step's metadata, so the worker keys objects under
  the weights that produced them;
* a request that finished normally gets its terminal partial block hashed like a KV block
  (same hash function, parent and extra keys), so the worker can publish it as an object;
* the KV cache's block evictions are forwarded, so the worker unpins exactly the objects no
  KV block can hit any more;
* a request that asks for ``routed_experts_format="keys"`` gets, instead of its rows, an
  :class:`~vllm_artifact.core.handoff.R3Keys` handle on its terminal output (the keys of its
  blocks in rank zero's store); its rows are never shipped to the frontend;
* a request whose end the engine decides (no stop strings, which the frontend matches, and
  not a resumable streaming-input request) gets its rows in two arrays, its prompt's with its
  first token and the rest on its terminal output, not one small array per step: vLLM's
  transport sends each array over 256 bytes as a frame of its own, and a 256-request decode
  batch's per-step frames cost the engine core's output thread and the frontend more CPU than
  the rest of R3 (``docs/design.md``, "A request's rows cross to the frontend in two parts");
  where the worker made its first rows the data part of a ``.npy`` file with room for the
  rest (a prefix hit, ``core/row_file.py``), that file goes instead and the frontend adopts it;
* a worker-reported :class:`~vllm_artifact.core.failure.R3Failure` is recorded instead of
  tripping vLLM's assertion (which would kill the engine); the scheduler then finishes that
  request with an error.

Two of vLLM's methods are replaced with leaner versions of the same contract, because they run
for every scheduled request on every step (benchmarks/bench_connector_step.py):
``build_connector_meta`` sends a request's emit start only when the worker first sees it (our
worker reads it only then) and packs hashes only for requests that have new ones;
``take_output`` reads the worker's column-wise :class:`~vllm_artifact.contract.StepResult`.
When vLLM calls each method, and on which thread, is in :mod:`vllm_artifact.contract`.

Everything here is O(new hashes + scheduled requests) per step (a decode step's held rows are
written with a few numpy calls, ``core/held_rows.py``); at a held request's end one copy of its
generated tokens' rows.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.aux_output_connector.connector import PackedBlockHashes
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_artifact.contract import SchedulerConnector, StepResult, TailBlock
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.handoff import R3_FORMAT_OPTION, KeysContext, R3Keys, RowsDigest
from vllm_artifact.core.held_rows import HeldRows
from vllm_artifact.core.keys import (
    DEFAULT_WEIGHT_VERSION,
    KeyCache,
    Namespace,
    ObjectKey,
    check_weight_version,
    tail_block_key,
)
from vllm_artifact.core.objects_digest import ObjectsDigest, handle_digest
from vllm_artifact.core.row_file import file_transport
from vllm_artifact.errors import ArtifactError, InternalError
from vllm_artifact.integration.hooks import require
from vllm_artifact.integration.kv_events import eviction_ids
from vllm_artifact.integration.request_rows import emit_start, executed_rows
from vllm_artifact.integration.seams import SchedulerConnectorBase
from vllm_artifact.integration.vllm_contract import ArtifactStepMetadata

logger = logging.getLogger("vllm.artifact.scheduler")

#: Finishes whose last rows become a tail object; aborted, preempted and failed requests keep
#: only their published full blocks.
_PUBLISH_TAIL_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
)
_RUNNING = RequestStatus.RUNNING
require(
    "resumable" in inspect.signature(Request.__init__).parameters
    and "max_tokens" in Request.__init__.__code__.co_names
    and "stop" in getattr(SamplingParams, "__struct_fields__", ()),
    "scheduler_connector",
    "vLLM's Request(resumable=...), Request.max_tokens or SamplingParams.stop changed (which "
    "requests can end in the frontend, and the room their first rows leave)",
)


class ArtifactSchedulerConnector(SchedulerConnectorBase):
    """vLLM's scheduler connector (through the series' seam, ``integration/seams``) with
    the Artifact Connector's additions (module docstring)."""

    def __init__(
        self,
        kv_cache_manager: Any = None,
        kv_connector: Any = None,
        *,
        hash_fn: Callable[[Any], bytes] | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        super().__init__(kv_cache_manager, kv_connector)
        require(
            all(
                isinstance(getattr(self, name, None), kind)
                for name, kind in (
                    ("_sent_hash_counts", dict),
                    ("_finished_requests", dict),
                    ("_generation", int),
                )
            ),
            "scheduler",
            "vLLM's AuxOutputSchedulerConnector state changed (_sent_hash_counts, "
            "_finished_requests, _generation)",
        )
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._hash_fn = hash_fn
        self._hash_block_size = hash_block_size
        self._tails: dict[str, TailBlock] = {}
        self._kv_evicted: list[int] = []
        self._kv_cleared = False
        self._step_output: StepResult | None = None  # the step output take_output last saw
        self._step_error: InternalError | None = None  # why that step's rows are unusable
        self._step_rows: dict[str, tuple[int, np.ndarray]] = {}
        # Keys-only handoff: request id -> keys of its KV blocks so far (made a step at a
        # time, so the request's end costs a few hashes, not one per block), and rank zero's
        # store and key context (arrives with the worker's first step output).
        self._keys_requests: dict[str, list[ObjectKey]] = {}
        # ... the digest of the rows they would have returned (the handle carries it, so it
        # resolves to exactly these rows or not at all), this step's rows, and the ids whose
        # handle was answered, sent to rank zero to lease the handle's objects.
        self._keys_digests: dict[str, RowsDigest | ObjectsDigest] = {}
        self._keys_rows: dict[str, tuple[int, np.ndarray]] = {}
        self._leases: list[str] = []
        self._keys_context: KeysContext | None = None
        # Keys-only requests that share a prompt prefix (the samples of one prompt, the turns
        # of a conversation) share its blocks' keys: made once on this thread, not per request.
        self._key_cache = KeyCache()
        # The keys' namespace, made once per rank-zero context and weight version (making one
        # costs microseconds, asked for by every running keys-only request every step).
        self._namespace: tuple[KeysContext, str, Namespace] | None = None
        # Requests whose rows are held until their last step (module docstring): those whose
        # first rows have not gone out yet, then the rows of their steps since.
        self._hold_pending: set[str] = set()
        self._held = HeldRows()
        # Requests whose rows could not be taken this step (a broken invariant of ours): the
        # scheduler fails them after vLLM's processing of the step (take_late_failures).
        self._late_failures: dict[str, R3Failure] = {}

    def observe_kv_evictions(self, ids: list[int]) -> None:
        """The KV cache evicted the blocks with these eviction ids (``kv_events``): the
        worker unpins their objects."""
        self._kv_evicted += ids

    def observe_kv_cleared(self) -> None:
        """The KV cache dropped every block (prefix-cache reset)."""
        self._kv_cleared = True
        self._kv_evicted.clear()

    def observe_kv_events(self, events: list[Any] | None) -> None:
        """The same from vLLM's KV cache events (``BlockRemoved``, ``AllBlocksCleared``)."""
        for event in events or ():
            if isinstance(event, BlockRemoved):
                self.observe_kv_evictions(eviction_ids(event.block_hashes))
            elif isinstance(event, AllBlocksCleared):
                self.observe_kv_cleared()

    def request_finished(self, request: Request) -> None:
        """Also hash the terminal partial block of a request that finished normally.

        vLLM calls this on preemption too, with the request still running: its rows so far
        (held rows, a keys-only request's digest) stay, since it resumes where it stopped."""
        if (
            request.status in _PUBLISH_TAIL_STATUSES
            and request.request_id in self._sent_hash_counts
            and request.request_id not in self._tails  # a keys handle computed it already
        ):
            tail = self._tail_hash(request)
            if tail is not None:
                self._tails[request.request_id] = tail
        if request.is_finished():
            self._keys_requests.pop(request.request_id, None)
            self._keys_digests.pop(request.request_id, None)
            self._hold_pending.discard(request.request_id)  # aborted or failed: rows not sent
            self._held.discard(request.request_id)
        super().request_finished(request)

    def _tail_hash(self, request: Any) -> TailBlock | None:
        """Hash of the rows after the last full block, like a KV block hash of those tokens.

        Rows exist for every token but the last sampled one, so the tail covers tokens
        ``[full * bs, num_tokens - 1)``; its parent is the last full block's hash.
        """
        if self._hash_fn is None or self._hash_block_size is None:
            return None
        bs = self._hash_block_size
        executed = request.num_tokens - 1
        full = executed // bs
        if executed <= full * bs or len(request.block_hashes) < full:
            return None
        tokens = request.all_token_ids[full * bs : executed]
        parent = request.block_hashes[full - 1] if full else None
        extra_keys, _ = generate_block_hash_extra_keys(request, full * bs, executed, 0)
        tail_hash = bytes(hash_block_tokens(self._hash_fn, parent, tokens, extra_keys))
        return TailBlock(tail_hash, full * bs, len(tokens))

    def set_weight_version(self, weight_version: str) -> None:
        """Key objects of later steps under ``weight_version`` (vLLM's weight-version API);
        a version keys cannot carry raises here, before any step uses it."""
        self.weight_version = check_weight_version(weight_version)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> ArtifactStepMetadata:
        """vLLM's per-step metadata (emit starts of requests the worker has not seen or that
        come back after preemption, new block hashes, finished requests) and ours."""
        scheduled = scheduler_output.num_scheduled_tokens
        sent = self._sent_hash_counts
        new_requests: dict[str, int] = {}
        first_rows_room: dict[str, int] = {}
        hashes: dict[str, PackedBlockHashes] = {}
        # Only requests with new hashes (or new ones) go on, picked in one comprehension: in
        # steady decode that is about one request in a block size.
        sent_count = sent.get
        changed = [rid for rid in scheduled if len(requests[rid].block_hashes) != sent_count(rid)]
        for request_id in changed:
            block_hashes = requests[request_id].block_hashes
            num_sent = sent.get(request_id)
            if num_sent is None:
                num_sent = sent[request_id] = 0
                request = requests[request_id]
                new_requests[request_id] = emit_start(request)
                params = request.sampling_params
                extra_args = params.extra_args if params is not None else None
                if extra_args and extra_args.get(R3_FORMAT_OPTION) == "keys":
                    self._keys_requests.setdefault(request_id, [])  # kept across preemption
                elif (
                    params is not None
                    and not params.stop
                    and not request.resumable
                    and request_id not in self._held.slots  # held rows survive preemption
                ):
                    self._hold_pending.add(request_id)
                    # the rows after its first ones: its generated tokens' but the last
                    first_rows_room[request_id] = max(0, request.max_tokens - 1)
            if len(block_hashes) != num_sent:
                hashes[request_id] = self._pack(block_hashes, num_sent)
                sent[request_id] = len(block_hashes)
        # A request not scheduled this step (async scheduling) may still have new hashes.
        if len(sent) != len(scheduled):
            for request_id, num_sent in sent.items():
                if request_id in scheduled:
                    continue
                block_hashes = requests[request_id].block_hashes
                if len(block_hashes) != num_sent:
                    hashes[request_id] = self._pack(block_hashes, num_sent)
                    sent[request_id] = len(block_hashes)
        finished, self._finished_requests = self._finished_requests, {}
        hashes.update((rid, packed) for rid, packed in finished.items() if packed is not None)
        tails, self._tails = self._tails, {}
        evicted, self._kv_evicted = self._kv_evicted, []
        cleared, self._kv_cleared = self._kv_cleared, False
        leases, self._leases = self._leases, []
        return ArtifactStepMetadata(
            self._generation,
            new_requests,
            hashes,
            tuple(finished),
            weight_version=self.weight_version,
            tails=tails,
            kv_evicted=evicted,
            kv_cleared=cleared,
            leases=leases,
            first_rows_room=first_rows_room,
            runs_forward=scheduler_output.total_num_scheduled_tokens > 0,
        )

    def _pack(self, block_hashes: Any, num_sent: int) -> PackedBlockHashes:
        """The hashes after the first ``num_sent`` (there are some), packed by vLLM."""
        packed = self._pack_new(block_hashes, num_sent)
        if packed is None:
            raise InternalError(f"vLLM packed no block hashes after the first {num_sent}")
        return packed

    def observe_step(self, output: object) -> dict[str, R3Failure]:
        """Every worker step output passes here first (also steps that sample nothing, whose
        rows vLLM never takes): keep rank zero's key context; return the failed requests."""
        if not isinstance(output, StepResult):
            return {}
        if output.keys_context is not None:
            self._keys_context = output.keys_context
        return output.failures()

    def take_output(self, request: Request, output: object) -> np.ndarray | None:
        """This step's rows of ``request`` up to its last executed token; None when there
        are none (or it failed). ``output`` is what the worker's step output carries (vLLM
        declares its own type there; ours is a :class:`StepResult`, checked once per step).
        vLLM calls this once per request with the same step output,
        so the step's lookup table is built once. Runs inside vLLM's ``update_from_output``:
        it never raises (that would kill the engine); a request whose rows cannot be taken
        is failed after the step (:meth:`take_late_failures`)."""
        try:  # (free unless it raises: no wrapper call on this per-request path)
            if output is not self._step_output:
                self._new_step_output(output)
            if self._step_error is not None:
                raise self._step_error
            request_id = request.request_id
            entry = self._step_rows.get(request_id)
            if entry is None:  # no rows this step, held already (a decode step), or keys-only
                keys = self._keys_requests.get(request_id)
                if keys is not None:
                    if (  # steady decode: its row was held, no new block to key
                        request.status is _RUNNING
                        and len(request.block_hashes) == len(keys)
                        and request_id not in self._keys_rows
                    ):
                        return None
                    return self._keys_output(request, keys)
                if request_id in self._held.slots:
                    return None if request.status is _RUNNING else self._held_end(request)
                return None
            token_start, step_rows = entry
            rows = executed_rows(request, token_start, step_rows)
            if request_id in self._held.slots:
                if rows is not None:
                    self._held.add(request_id, token_start, rows)
                return None if request.status is _RUNNING else self._held_end(request)
            if rows is not None and request_id in self._hold_pending:
                # Held (module docstring): its first rows (the prompt's) go out at once, so
                # that its end copies only its generated tokens' rows; the rest wait for it.
                self._hold_pending.discard(request_id)
                if not request.is_finished():
                    self._held.hold(request_id, token_start + len(rows))
                # Made a file with room for the rest: the frontend adopts it (row_file.py).
                step = self._step_output
                file = None if step is None else step.files.get(request_id)
                transport = None if file is None else file_transport(file, rows)
                if transport is not None:
                    return transport
            return rows
        except Exception as error:
            self._late_failures[request.request_id] = _internal_failure(request, error)
            return None

    def _held_end(self, request: Any) -> np.ndarray | None:
        """A held request that is not running: at its end its held rows in one array; none
        while it waits (preempted, or a step of async scheduling that ran past it)."""
        if not request.is_finished():
            return None
        return self._held.take(request.request_id, request.num_tokens - 1)

    def take_late_failures(self) -> dict[str, R3Failure]:
        """Requests :meth:`take_output` could not serve this step (usually none)."""
        if not self._late_failures:
            return {}
        failures, self._late_failures = self._late_failures, {}
        return failures

    def _new_step_output(self, output: object) -> None:
        """The step's rows by request id; keys-only requests take none (their handle instead)."""
        if output is not None and not isinstance(output, StepResult):
            raise InternalError(
                f"the worker's step output is a {type(output).__name__}, not vllm-artifact's "
                "StepResult (the worker connector is not ours)"
            )
        self._step_output = output
        self._step_rows = self._keys_rows = {}
        self._step_error = None
        try:
            step_rows = {} if output is None else self._rows_not_held(output)
        except Exception as error:  # every request of the step fails, none gets other rows
            self._step_error = InternalError(f"the step's R3 rows could not be sorted: {error}")
            raise self._step_error from error
        if self._keys_requests and not step_rows.keys().isdisjoint(self._keys_requests):
            self._keys_rows = {
                rid: rows for rid, rows in step_rows.items() if rid in self._keys_requests
            }
            step_rows = {
                rid: rows for rid, rows in step_rows.items() if rid not in self._keys_requests
            }
        self._step_rows = step_rows

    def _rows_not_held(self, output: StepResult) -> dict[str, tuple[int, np.ndarray]]:
        """The step's rows by request id, less the decode rows of held requests, which are
        held here with a few numpy calls for all of them (``HeldRows.record_step``)."""
        held = None
        if output.decode_ids and output.decode_rows is not None:
            held = self._held.record_step(
                output.decode_ids, output.decode_token_starts, output.decode_rows
            )
        if held is None:
            return output.rows_by_id()
        return output.rows_by_id(decode=np.flatnonzero(~held).tolist())

    def _keys_output(self, request: Any, keys: list[ObjectKey]) -> np.ndarray | None:
        """A keys-only request's output: none while it runs (its new blocks' keys are made),
        at its end its :class:`R3Keys` handle in vLLM's routed-experts transport (see
        ``R3Keys.to_transport``).

        Keys are made exactly as rank zero makes them (same namespace: model, layout, the
        weight version this connector sends with every step), from the request's KV block
        hashes and the tail hash that :meth:`request_finished` sends to the worker.
        """
        context, bs = self._keys_context, self._hash_block_size
        namespace = None
        if context is not None and bs is not None:
            made = self._namespace
            if made is None or made[0] is not context or made[1] != self.weight_version:
                made = self._namespace = (
                    context,
                    self.weight_version,
                    context.namespace(self.weight_version),
                )
            namespace = made[2]
            block_hashes = request.block_hashes
            if len(block_hashes) > len(keys):
                keys += self._key_cache.keys_of(namespace, list(block_hashes[len(keys) :]))
        rid = request.request_id
        entry = self._keys_rows.get(rid)
        if entry is not None:  # the rows the array path would return this step
            token_start, step_rows = entry
            rows = executed_rows(request, token_start, step_rows)
            if rows is not None and rid in self._held.slots:
                self._held.add(rid, token_start, rows)
            elif rows is not None:  # its first rows (the prompt's) go into the digest at once,
                # the rest are held as the array path holds them (a decode step's rows of all
                # such requests in a few numpy calls) and go in at its end
                digest = self._keys_digests.get(rid)
                if digest is None:
                    digest = self._keys_digests[rid] = handle_digest(context, bs, token_start, keys)
                digest.add(rows)
                if request.status is _RUNNING:
                    self._held.hold(rid, token_start + len(rows))
        finished = request.is_finished() and request.status in _PUBLISH_TAIL_STATUSES
        if namespace is None or context is None or bs is None:
            if finished:  # never answer a finished keys-only request without its handle
                raise InternalError("rank zero's store address has not arrived")
            return None
        if not finished:
            return None
        executed = request.num_tokens - 1
        first_row = min(request.sampling_params.routed_experts_prompt_start, executed)
        first_block, full = first_row // bs, executed // bs
        keys = keys[first_block:full]
        last_block_tokens, tail_key = bs, None
        if executed > full * bs:
            tail = self._tail_hash(request)
            if tail is None:
                raise InternalError("the hash of its last, partial block cannot be made")
            self._tails[rid] = tail  # request_finished sends it to the worker
            tail_key = tail_block_key(namespace, tail.hash, tail.num_tokens)
            keys.append(tail_key)
            last_block_tokens = tail.num_tokens
        digest = self._keys_digests.get(rid) or handle_digest(context, bs, first_row, [])
        if rid in self._held.slots:
            held = self._held.take(rid, executed)
            if held is not None:
                digest.add(held)
        if digest.rows != executed - first_row:
            raise InternalError(
                f"keys-only request {rid}: {digest.rows} rows seen, {executed - first_row} expected"
            )
        if isinstance(digest, ObjectsDigest):
            if digest.token_start != first_row:
                raise InternalError(
                    f"keys-only request {rid}: rows from {first_row}, not {digest.token_start}"
                )
            digests = {"objects_xxh3": digest.finish(tail_key)}
        else:
            digests = {"rows_xxh3": digest.hexdigest()}
        self._leases.append(request.request_id)
        handle = R3Keys.of(
            store=context.store,
            layout=context.layout.canonical(),
            block_size=bs,
            token_start=first_block * bs,
            first_row=first_row,
            num_rows=executed - first_row,
            keys=keys,
            last_block_tokens=last_block_tokens,
            trusted=True,
            **digests,
        )
        return handle.to_transport()


def _internal_failure(request: Any, error: Exception) -> R3Failure:
    """A request failed by a broken invariant of ours: logged with its trace, answered with
    a message that says so."""
    logger.exception("vllm-artifact: R3 of request %s cannot be delivered", request.request_id)
    reason = error.reason if isinstance(error, ArtifactError) else "internal"
    return R3Failure(
        reason,
        f"R3 (routed experts) for request {request.request_id} is unavailable ({reason}): "
        f"{error} (an internal error of vllm-artifact: please report it)",
    )


if TYPE_CHECKING:  # mypy holds the class to the contract's protocol
    _connector: type[SchedulerConnector] = ArtifactSchedulerConnector
