"""Per-step CPU cost of the Artifact Connector vs vLLM's own, driven with synthetic steps.

On a GPU a big-MoE decode step takes ~20-40 ms; what the connector adds per step is the figure
that matters, and on CPU the tiny model's step time hides it. This drives, through the same
methods the engine calls, both our connectors and vLLM 0.32's own AuxOutput connectors:

* scheduler thread: ``request_finished``, ``build_connector_meta``, ``take_output`` per request;
* rank-zero worker: ``begin_step``, ``prepare_output``, ``enqueue_cpu_copy``,
  ``process_output`` (the capturer is a stand-in returning the step's rows as a CPU tensor);

with the facts of a decode-heavy batch: 256 concurrent decoding requests, DeepSeek-V3-sized R3
(58 layers x top-8, uint8), 16-token blocks; each step every request decodes one token (a
block's hash arrives the step after it fills); every few steps a request finishes and a new one
arrives with a 1024-token prefix hit whose R3 is read from the store; the KV cache, full as in
steady state, evicts up to 16 blocks of finished requests per step (KV cache events: ours
unpins their store objects, as every published block is pinned while the KV cache holds it).
Block hashes are sha256 digests, as vLLM's. The configurations run alternately in rounds
(machine drift hits them alike), each with its own state: ours, vLLM's own, and ours with
every request's rows returned each step instead of held until its end ("ours, per step": what
holding costs the scheduler thread; what it saves elsewhere is ``bench_transport``'s).

Prints, per step, for each side and configuration the median and p90 of the step thread's CPU
time (``time.thread_time``: the measure of the targets from issue 6, ours <= 0.3 ms on the
scheduler thread and <= 0.5 ms on the worker's) and of its wall time, which also counts the
time it waits for the GIL while the store writer thread (ours: the publisher; vLLM's: its
background store thread) holds it; and that writer thread's own CPU per step, in the run and
with each store's writes of the run redone alone on one thread afterwards (no GIL contention).
The worker's steps are also shown split into those where a request with a prefix hit arrives
(ours reads its R3 from the store) and the others, with the mean time the step thread waited
for the GIL (wall minus CPU).
``--workload prefill`` drives prefill-heavy steps instead (no target: the issue's are for
decode): chunked prefill of 1025-token prompts whose first 256 tokens are a prefix hit read
from the store, 8192 tokens per step, 4 output tokens each, so about 512 blocks complete and
ten requests arrive and finish in every step. ``--workload prefill-hits`` has the shape of the
H200 harness's prefill workload (``tools/gpu/perf``): 2049-token prompts whose first 1536
tokens are a prefix hit, 16 output tokens; ``--workload decode-batch`` that of its decode
workload: 256 requests of 257 prompt tokens and 256 output tokens, admitted within the token
budget and decoding together to their end.

``--tracker process`` runs ours with its tracker in the tracker process; ``--gpu-step-ms``
pauses after each step (outside the timed parts) for the time a GPU step would give the store
writer and the tracker process.

Run: ``.venv/bin/python benchmarks/bench_connector_step.py [--rounds R] [--steps S]
[--workload decode|prefill|prefill-hits|decode-batch] [--tracker engine|process]
[--gpu-step-ms MS]``
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch
from copy_floor import copy_floor_seconds
from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
from vllm.distributed.aux_output_connector.routed_experts import (
    RoutedExpertsBuffer,
    routed_experts_keys,
)
from vllm.distributed.aux_output_connector.store import (
    BackgroundBlockObjectStore,
    BlockObject,
    BlockObjectStore,
)
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
from vllm.distributed.kv_events import BlockRemoved
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import BlockHash, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from vllm_artifact.core.handoff import R3_FORMAT_OPTION, KeysContext, R3Keys, StoreAddress
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION, Namespace, full_block_keys
from vllm_artifact.core.publisher import (
    MEMORY_STORE_INLINE_FROM_BLOCKS,
    BlockRun,
    Publisher,
    Submission,
)
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.kv_events import eviction_id
from vllm_artifact.integration.output_side import OutputSetup
from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector
from vllm_artifact.integration.tracker_process import TrackerProcess
from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector

LAYOUT = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
CONCURRENCY = 256
PREFIX_BLOCKS = 64  # 1024-token prefix hit for new requests
NEW_REQUEST_EVERY = 4  # steps
EVICTIONS_PER_STEP = 16  # a full KV cache frees about as many blocks as the batch fills
# --workload prefill: the shape of bench_e2e's prefill workload at DeepSeek-V3's R3 size.
PREFILL_TOKEN_BUDGET = 8192  # tokens per step (max_num_batched_tokens), chunked prefill
PREFILL_MAX_RUNNING = 64


class PrefillShape(NamedTuple):
    prompt_blocks: int  # 16-token blocks of each prompt (plus one token)
    shared_blocks: int  # of them, a shared prefix: a prefix hit read from the store
    output_tokens: int
    max_running: int = PREFILL_MAX_RUNNING  # requests at once


PREFILL_SHAPES = {
    "prefill": PrefillShape(PREFIX_BLOCKS, 16, 4),  # 1025 tokens, a 256-token hit
    # the H200 harness's prefill workload (tools/gpu/perf): 2049 tokens, a 1536-token hit
    "prefill-hits": PrefillShape(128, 96, 16),
    # the harness's decode workload: 256 requests of 257 prompt tokens (no hit) and 256
    # output tokens, admitted in chunks of the token budget, decoding together to their end
    "decode-batch": PrefillShape(16, 0, 256, CONCURRENCY),
}
PREFILL_EVICTIONS_PER_STEP = PREFILL_TOKEN_BUDGET // LAYOUT.block_size
WARM_UP_STEPS = 20
TARGET_SCHEDULER_MS = 0.3
PER_STEP = "ours, per step"
#: ``--keys``: ours with every request asking for the keys-only handoff.
KEYS = "ours, keys"
#: ``--tracker process``: ours runs its tracker in the tracker process.
TRACKER_PROCESS = False  # the configuration of ours that holds no rows
#: ``--gpu-step-ms``: a pause after each step, outside the timed parts.
STEP_GAP_S = 0.0
TARGET_WORKER_MS = 0.5


def block_hash(tag: int, i: int) -> bytes:
    """A 32-byte block hash that looks like vLLM's (sha256): KV events and our pins key a
    block by its hash's last 8 bytes, so they must differ between blocks."""
    return hashlib.sha256(tag.to_bytes(8, "little") + i.to_bytes(8, "little")).digest()


# the shared prefix every hit reads, as long as the longest hit of any workload
SHARED_BLOCKS = max(PREFIX_BLOCKS, *(shape.shared_blocks for shape in PREFILL_SHAPES.values()))
PREFIX_HASHES = [block_hash(0, i) for i in range(SHARED_BLOCKS)]


class FakeRequest:
    """The attributes the scheduler connectors read from a vLLM ``Request``."""

    def __init__(
        self,
        request_id: str,
        prefix_tag: int,
        own_tag: int,
        prompt_blocks: int,
        shared_blocks: int | None = None,
        max_tokens: int = 4096,
    ) -> None:
        """``shared_blocks`` of the ``prompt_blocks`` (all by default) carry ``prefix_tag``'s
        hashes; the KV cache holds them, so the request's first step starts after them (or at
        its last prompt token, if the whole prompt is shared)."""
        bs = LAYOUT.block_size
        shared = prompt_blocks if shared_blocks is None else shared_blocks
        self.request_id = request_id
        self.tag = own_tag  # blocks after the shared prefix are this request's own
        self.own_from = 0 if prefix_tag == own_tag else shared  # first own block
        self.num_prompt_tokens = prompt_blocks * bs + 1
        self.num_tokens = self.num_prompt_tokens
        self.max_tokens = max_tokens  # decode: a budget its random end comes before
        self.block_hashes = [block_hash(prefix_tag, i) for i in range(shared)]
        self.block_hashes += [block_hash(own_tag, i) for i in range(shared, prompt_blocks)]
        # Tokens in the KV cache (bench state; the connectors read it from the input batch).
        self.num_computed = self.num_tokens - 1 if shared == prompt_blocks else shared * bs
        # No stop strings: ours holds the rows until the request's end (bench_transport.py).
        self.sampling_params = SimpleNamespace(
            routed_experts_prompt_start=0, extra_args=None, stop=[]
        )
        self.resumable = False
        self.status = RequestStatus.RUNNING
        self.lora_request = None
        self.mm_features: list[object] = []
        self.cache_salt = None
        self.prompt_embeds = None

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return self.status != RequestStatus.RUNNING

    @property
    def all_token_ids(self) -> list[int]:
        return [7] * self.num_tokens

    def decode_one(self) -> None:
        self.num_computed = self.num_tokens
        self.num_tokens += 1
        full = self.num_tokens // LAYOUT.block_size
        while len(self.block_hashes) < full:
            self.block_hashes.append(block_hash(self.tag, len(self.block_hashes)))


class StandInCapturer:
    """Returns the step's rows like vLLM's capturer snapshot (a CPU tensor here)."""

    rows: np.ndarray

    def step_started(self) -> None:
        pass

    def snapshot_routing_data(self, num_rows: int) -> torch.Tensor:
        return torch.from_numpy(self.rows[:num_rows])


class WriteLog:
    """A configuration's store writes of the run, for the replay. A step's writes are copied
    after the step's timed part, into chunks of memory of their own: kept as they are, every
    step's fresh arrays (ours) or payloads (vLLM's) would stay alive, so the next step's
    allocations would land on fresh pages and pay page faults a server does not (it frees
    them once written and reuses the memory)."""

    CHUNK_BYTES = 64 << 20  # glibc maps allocations this big with mmap, apart from the heap

    def __init__(self, copy_write: Callable[[Any, WriteLog], Any]) -> None:
        self.writes: list[Any] = []
        self._copy_write = copy_write
        self._pending: list[Any] = []
        self._chunk = np.empty(0, dtype=np.uint8)
        self._used = 0

    def add(self, write: Any) -> None:
        """In the step: keep a reference only."""
        self._pending.append(write)

    def settle(self) -> None:
        """After the step's timed part: copy its writes, drop the references."""
        self.writes.extend(self._copy_write(write, self) for write in self._pending)
        self._pending.clear()

    def keep(self, data: np.ndarray | bytes) -> np.ndarray:
        """A copy of ``data`` (for bytes: as a uint8 array) in the log's own memory."""
        src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        nbytes = src.nbytes
        if self._used + nbytes > len(self._chunk):
            self._chunk, self._used = np.empty(max(self.CHUNK_BYTES, nbytes), np.uint8), 0
        kept = self._chunk[self._used : self._used + nbytes].view(src.dtype).reshape(src.shape)
        kept[...] = src
        self._used += nbytes
        return kept


class Config:
    """One connector pair with its own requests; :meth:`step` times one engine step."""

    def __init__(
        self,
        name: str,
        scheduler: Any,
        worker: Any,
        capturer: StandInCapturer,
        write_log: WriteLog,
        replay_writes: Callable[[], float],
        workload: str = "decode",
    ) -> None:
        self.name = name
        self.workload = workload
        self.prefill_shape = PREFILL_SHAPES.get(workload)  # None: the decode workload
        self.write_log = write_log
        # CPU seconds of redoing every store write of the run on the main thread, alone.
        self.replay_writes = replay_writes
        self.scheduler = scheduler
        self.worker = worker
        self.capturer = capturer
        self.rng = np.random.default_rng(0)
        self.requests: dict[str, FakeRequest] = {}
        self.next_id = 0
        self.steps = 0
        # Blocks of finished requests, oldest first: what a full KV cache evicts next.
        self.evictable: collections.deque[bytes] = collections.deque()
        self.stopped: list[FakeRequest] = []  # prefill: finished in the last step
        self.scheduler_ms: list[float] = []  # CPU time of the step thread (the targets)
        self.worker_ms: list[float] = []
        self.scheduler_wall_ms: list[float] = []  # wall time: also waits for the GIL
        self.worker_wall_ms: list[float] = []
        self.hit_steps: list[bool] = []  # a new request with a prefix hit arrived that step
        self.writer_cpu_ms = 0.0  # CPU of the background store writer over writer_steps steps
        self.writer_steps = 0
        self.timed_steps = 0
        # Ours unpins the store objects of evicted KV blocks; vLLM's own store pins nothing.
        self.observe_kv_events = getattr(scheduler, "observe_kv_events", None)

    def _ramp_up(self) -> None:
        """The batch fills over its first ``block_size`` steps, so its requests' blocks
        complete spread over the steps (about CONCURRENCY / block_size per step), as in a
        real batch, not all in one step."""
        for _ in range(CONCURRENCY // LAYOUT.block_size):
            request = self._new_request(hit=False)
            # Its prompt's R3 is not asked for: the first step emits from its last token on.
            request.sampling_params.routed_experts_prompt_start = request.num_prompt_tokens - 1
            self.requests[request.request_id] = request

    def _new_request(
        self, hit: bool, shared_blocks: int | None = None, prompt_blocks: int = PREFIX_BLOCKS
    ) -> FakeRequest:
        own = 1000 + self.next_id
        prefix_tag = 0 if hit else own
        shape = self.prefill_shape
        request = FakeRequest(
            f"r{self.next_id}",
            prefix_tag,
            own,
            prompt_blocks,
            shared_blocks,
            **({} if shape is None else {"max_tokens": shape.output_tokens}),
        )
        self.next_id += 1
        if self.name == KEYS:
            request.sampling_params.extra_args = {R3_FORMAT_OPTION: "keys"}
        return request

    def _schedule_decode(self) -> tuple[list[FakeRequest], dict[str, int], bool]:
        """Every request decodes one token; every few steps one finishes and a new one with
        a prefix hit arrives (its first step computes only the token after the prefix)."""
        requests = self.requests
        finished: list[FakeRequest] = []
        if len(requests) < CONCURRENCY:
            self._ramp_up()
        elif self.steps % NEW_REQUEST_EVERY == 0:
            victim = next(iter(requests.values()))
            del requests[victim.request_id]
            victim.status = RequestStatus.FINISHED_LENGTH_CAPPED
            finished.append(victim)
            self.evictable.extend(victim.block_hashes[victim.own_from :])
            new = self._new_request(hit=True)
            requests[new.request_id] = new
        return finished, dict.fromkeys(requests, 1), bool(finished)

    def _schedule_prefill(self) -> tuple[list[FakeRequest], dict[str, int], bool]:
        """vLLM's chunked prefill within a token budget: the running requests first (decode
        tokens, the rest of a chunked prompt), then new requests while the budget lasts."""
        finished, self.stopped = self.stopped, []
        scheduled: dict[str, int] = {}
        budget = PREFILL_TOKEN_BUDGET

        def schedule(request: FakeRequest) -> None:
            nonlocal budget
            n = min(request.num_tokens - request.num_computed, budget)
            scheduled[request.request_id] = n
            budget -= n

        for request in self.requests.values():
            if not budget:
                break
            schedule(request)
        arrived = False
        shape = self.prefill_shape
        assert shape is not None  # a prefill workload
        while budget and len(self.requests) < shape.max_running:
            request = self._new_request(
                hit=True, shared_blocks=shape.shared_blocks, prompt_blocks=shape.prompt_blocks
            )
            self.requests[request.request_id] = request
            schedule(request)
            arrived = True
        return finished, scheduled, arrived

    def step(self) -> None:
        shape = self.prefill_shape
        prefill = shape is not None
        finished, scheduled, hit = self._schedule_prefill() if prefill else self._schedule_decode()
        requests = self.requests
        batch = [requests[request_id] for request_id in scheduled]
        counts = list(scheduled.values())
        n = len(batch)
        scheduler_output = SimpleNamespace(
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(counts)
        )
        query_start_loc = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        input_batch = SimpleNamespace(
            req_ids=list(scheduled),
            query_start_loc_np=query_start_loc,
            num_computed_tokens_np=np.array([r.num_computed for r in batch], dtype=np.int32),
        )
        self.capturer.rows = self.rng.integers(
            0, 256, (int(query_start_loc[-1]), 58, 8), dtype=np.uint8
        )
        # A request samples once its scheduled tokens reach its last token (a chunk of a
        # longer prompt samples nothing).
        completes = [r.num_computed + c == r.num_tokens for r, c in zip(batch, counts, strict=True)]
        num_sampled = np.array(completes, dtype=np.int32)
        num_rejected = np.zeros(n, dtype=np.int32)

        evictions = PREFILL_EVICTIONS_PER_STEP if prefill else EVICTIONS_PER_STEP
        evicted = [self.evictable.popleft() for _ in range(min(evictions, len(self.evictable)))]
        events = [
            BlockRemoved([maybe_convert_block_hash(BlockHash(h)) for h in evicted], medium="GPU")
        ]

        c0, t0 = time.thread_time(), time.perf_counter()
        if self.observe_kv_events is not None:
            self.observe_kv_events(events)
        for request in finished:
            self.scheduler.request_finished(request)
        metadata = self.scheduler.build_connector_meta(scheduler_output, requests)
        c1, t1 = time.thread_time(), time.perf_counter()
        self.worker.begin_step(metadata)
        pending = self.worker.prepare_output(input_batch)
        pending.enqueue_cpu_copy(num_sampled, num_rejected)
        output = pending.process_output()
        c2, t2 = time.thread_time(), time.perf_counter()
        # vLLM appends the sampled token (and stops a request at its length) before it asks
        # the connector for the step's rows, of the requests that sampled.
        sampled: list[FakeRequest] = []
        stopped: list[FakeRequest] = []
        for request, count, done in zip(batch, counts, completes, strict=True):
            if not done:
                request.num_computed += count
                continue
            request.decode_one()
            sampled.append(request)
            if shape is not None and request.num_output_tokens >= shape.output_tokens:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                stopped.append(request)
        c2b, t2b = time.thread_time(), time.perf_counter()
        taken = [self.scheduler.take_output(request, output) for request in sampled]
        c3, t3 = time.thread_time(), time.perf_counter()
        if isinstance(self.scheduler, ArtifactSchedulerConnector) and self.name in ("ours", KEYS):
            running = [r for r, rows in zip(sampled, taken, strict=True) if not r.is_finished()]
            assert all(r.request_id in self.scheduler._held.slots for r in running)
            if self.name == KEYS:  # no rows, and a handle at the end
                ended = [rows for r, rows in zip(sampled, taken, strict=True) if r.is_finished()]
                assert all(R3Keys.is_transport(rows) for rows in ended), "a handle each"
        else:
            assert all(rows is not None and len(rows) for rows in taken), "every request has rows"
        for request in stopped:  # vLLM frees them; request_finished runs in the next step
            del requests[request.request_id]
            self.evictable.extend(request.block_hashes[request.own_from :])
        self.stopped.extend(stopped)
        self.write_log.settle()
        self.steps += 1
        if self.steps > WARM_UP_STEPS:
            self.scheduler_ms.append((c1 - c0 + c3 - c2b) * 1e3)
            self.worker_ms.append((c2 - c1) * 1e3)
            self.scheduler_wall_ms.append((t1 - t0 + t3 - t2b) * 1e3)
            self.worker_wall_ms.append((t2 - t1) * 1e3)
            self.hit_steps.append(hit)
            self.timed_steps += 1
        if STEP_GAP_S:  # --gpu-step-ms: the time a GPU step gives other threads and processes
            time.sleep(STEP_GAP_S)

    def run(self, steps: int) -> None:
        """``steps`` steps, adding the store writer thread's CPU time while timed steps ran."""
        before = writer_cpu_seconds(self.writer_thread)
        timed_before = self.timed_steps
        for _ in range(steps):
            self.step()
        if self.timed_steps > timed_before:  # rounds with timed steps (warm-up steps included)
            self.writer_cpu_ms += (writer_cpu_seconds(self.writer_thread) - before) * 1e3
            self.writer_steps += steps

    @property
    def writer_thread(self) -> str:
        """The thread that writes the store (ours: all but its inline batches)."""
        return WRITER_THREADS[self.name]


#: The background thread that writes the store, per configuration.
WRITER_THREADS = {
    "ours": "vllm-artifact-publisher",
    PER_STEP: "vllm-artifact-publisher-per-step",
    KEYS: "vllm-artifact-publisher-keys",
    "vLLM's own": "vllm-aux-output-writer",
}


def writer_cpu_seconds(name: str) -> float:
    """CPU seconds so far of the live thread called ``name`` (its per-thread CPU clock); 0
    with ``--tracker process`` (ours writes in the tracker process)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    if name == WRITER_THREADS["ours"] and TRACKER_PROCESS:
        return 0.0
    raise RuntimeError(f"no thread {name!r}: the store writer did not start")


def bare_worker(capturer: StandInCapturer) -> ArtifactWorkerConnector:
    """The worker connector's engine-facing methods, without a model to bind to; its output
    side (store, tracker or tracker process) is the caller's to set. It keeps the
    interpreter's GIL switch interval (no ``SwitchInterval``)."""
    worker = object.__new__(ArtifactWorkerConnector)
    worker._capturer = capturer  # type: ignore[assignment]
    worker._init_state()
    worker._layout = LAYOUT
    return worker


def ours_in_a_tracker_process(root: str, workload: str) -> tuple[Config, Callable[[], None]]:
    """Ours with ``--artifact-tracker process``: the step thread's CPU is the engine's share
    (sending facts and rows, taking answers); the tracker's own work runs in that process."""
    namespace = Namespace("bench", LAYOUT, DEFAULT_WEIGHT_VERSION)
    # The tracker process reopens the store, and a reopened store's objects are unpinned (a
    # restart's): the shared prefix must outlive the run's writes without its pin, so the
    # store holds them all (a few GiB of /dev/shm, touched as written).
    capacity = 3 << 30
    with ShmStore.create_or_open_writer(
        root, "bench-dp0", layout=LAYOUT, capacity_bytes=capacity
    ) as store:  # the shared prefix, published by an earlier request
        prefix_rows = np.random.default_rng(1).integers(
            0, 256, (SHARED_BLOCKS * 16, 58, 8), dtype=np.uint8
        )
        store.put_blocks(full_block_keys(namespace, PREFIX_HASHES), prefix_rows, 0)
    setup = OutputSetup(
        config=ArtifactConfig(enabled=True, root=Path(root), capacity=capacity, tracker="process"),
        family="bench-dp",
        dp_rank=0,
        layout=LAYOUT,
        model_id="bench",
        capacity=capacity,
        kv_hash_blocks=0,
        buffer_max_bytes=512 << 20,
    )
    capturer = StandInCapturer()
    worker = bare_worker(capturer)
    worker._process = TrackerProcess(setup, max_rows=PREFILL_TOKEN_BUDGET + CONCURRENCY)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    scheduler = ArtifactSchedulerConnector(hash_fn=hash_fn, hash_block_size=LAYOUT.block_size)
    log = WriteLog(lambda runs, log: runs)
    config = Config("ours", scheduler, worker, capturer, log, lambda: 0.0, workload)

    def close() -> None:
        # core/local_decode.py: steps of steady decode only, answered without waiting
        print(f"  worker    ours: {worker.steps_answered_here} steps answered by the engine itself")
        worker.close()

    return config, close


class PerStepRowsScheduler(ArtifactSchedulerConnector):
    """Ours, holding no request's rows: every step's rows are returned that step."""

    def build_connector_meta(self, scheduler_output: Any, requests: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output, requests)
        self._hold_pending.clear()
        return meta


def ours(
    root: str, workload: str, name: str = "ours", *, background: bool = False
) -> tuple[Config, Callable[[], None]]:
    """Ours; its large store batches written inline on the step thread as in the engine (a
    /dev/shm store), or with ``background`` all on the publishing thread (as for a network
    store)."""
    store = ShmStore.create_or_open_writer(
        root, name.replace(" ", "").replace(",", "-"), layout=LAYOUT, capacity_bytes=256 << 20
    )
    inline = store.writes_local_memory and not background
    publisher = Publisher(
        store, inline_from_blocks=MEMORY_STORE_INLINE_FROM_BLOCKS if inline else None
    )
    publisher._thread.name = WRITER_THREADS[name]

    def copy_runs(runs: list[Submission], log: WriteLog) -> list[Submission]:
        return [
            run._replace(rows=log.keep(run.rows)) if isinstance(run, BlockRun) else run
            for run in runs
        ]

    log = WriteLog(copy_runs)
    submit = publisher.submit

    def recording_submit(runs: Sequence[Submission]) -> bool:
        log.add(list(runs))
        return submit(runs)

    publisher.submit = recording_submit  # type: ignore[method-assign]

    def replay_writes() -> float:
        """The publisher's work of the run, on a fresh store (it never touches the prefix)."""
        with ShmStore.create_or_open_writer(
            root, "replay-" + WRITER_THREADS[name], layout=LAYOUT, capacity_bytes=256 << 20
        ) as fresh:
            replayer = Publisher(fresh)
            started = time.thread_time()
            for runs in log.writes:
                replayer._publish(runs)
            seconds = time.thread_time() - started
            replayer.close()
        assert not replayer.failures
        return seconds

    tracker = RequestTracker(
        LAYOUT, "bench", store, publisher, buffer_max_bytes=512 << 20, block_id=eviction_id
    )
    # The shared prefix was published by an earlier request.
    prefix_rows = np.random.default_rng(1).integers(
        0, 256, (SHARED_BLOCKS * 16, 58, 8), dtype=np.uint8
    )
    store.put_blocks(full_block_keys(tracker.namespace, PREFIX_HASHES), prefix_rows, 0)
    capturer = StandInCapturer()
    worker = bare_worker(capturer)
    # No engine store: the store is closed after the worker (close below).
    worker._store, worker._publisher, worker._tracker = store, publisher, tracker
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    kind = ArtifactSchedulerConnector if name in ("ours", KEYS) else PerStepRowsScheduler
    scheduler = kind(hash_fn=hash_fn, hash_block_size=LAYOUT.block_size)
    if name == KEYS:  # as the worker's first step output would bring it
        scheduler._keys_context = KeysContext(
            StoreAddress(root=store.root, name=store.name), "bench", LAYOUT
        )
    config = Config(name, scheduler, worker, capturer, log, replay_writes, workload)

    def close() -> None:
        worker.close()
        store.close()

    return config, close


def vllms_own(workload: str) -> tuple[Config, Callable[[], None]]:
    def new_store() -> BlockObjectStore:
        return BlockObjectStore(max_bytes=256 << 20, object_nbytes=LAYOUT.block_nbytes)

    prefix_rows = np.random.default_rng(1).integers(
        0, 256, (SHARED_BLOCKS, 16 * 58 * 8), dtype=np.uint8
    )
    prefix = [
        BlockObject(key=key, payload=row.tobytes())
        for key, row in zip(routed_experts_keys(PREFIX_HASHES, "0"), prefix_rows, strict=True)
    ]
    store = BackgroundBlockObjectStore(new_store(), max_pending_batches=2 * CONCURRENCY)
    store.put(prefix)
    Put = tuple[list[BlockObject], tuple[str, ...], tuple[str, ...]]

    def copy_put(write: Put, log: WriteLog) -> Put:
        objects, retains, releases = write
        # The store copies a payload with a slice assignment: a memoryview serves as bytes.
        kept = [
            BlockObject(key=o.key, payload=log.keep(o.payload).data)  # type: ignore[arg-type]
            for o in objects
        ]
        return kept, retains, releases

    log = WriteLog(copy_put)
    put = store.put

    def recording_put(
        objects: list[BlockObject], *, retain_keys: Any = (), release_keys: Any = ()
    ) -> None:
        retains, releases = tuple(retain_keys), tuple(release_keys)
        log.add((objects, retains, releases))
        put(objects, retain_keys=retains, release_keys=releases)

    store.put = recording_put  # type: ignore[method-assign]

    def replay_writes() -> float:
        """The writer thread's work of the run, on a fresh store holding the prefix."""
        fresh = new_store()
        fresh.put(prefix)
        started = time.thread_time()
        for objects, retains, releases in log.writes:
            fresh.put(objects, retain_keys=retains, release_keys=releases)
        seconds = time.thread_time() - started
        fresh.close()
        return seconds

    capturer = StandInCapturer()
    # What AuxOutputWorkerConnector.__init__ sets up on the output rank, without a model.
    worker = object.__new__(AuxOutputWorkerConnector)
    worker._capturer = capturer  # type: ignore[assignment]
    worker._store = store
    worker._buffer = RoutedExpertsBuffer(
        np.dtype(np.uint8), LAYOUT.row_shape, LAYOUT.block_size, CONCURRENCY * 2, 8192, 1
    )
    worker._requests = {}
    worker._generation = 0
    worker._step_metadata = None
    worker._pending_outputs = []
    worker._lock = threading.Lock()
    worker._max_concurrent_batches = 1
    scheduler = AuxOutputSchedulerConnector()
    config = Config("vLLM's own", scheduler, worker, capturer, log, replay_writes, workload)
    return config, worker.close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120, help="steps per round and config")
    parser.add_argument(
        "--workload",
        choices=("decode", *PREFILL_SHAPES),
        default="decode",
        help="decode: the issue's 256 decoding requests (the targets); prefill: chunked "
        f"prefill of 1025-token prompts, {PREFILL_TOKEN_BUDGET} tokens per step (no target); "
        "prefill-hits: the H200 harness's prefill (2049-token prompts, a 1536-token hit); "
        "decode-batch: the harness's decode (256 requests of 257 + 256 tokens at once)",
    )
    parser.add_argument(
        "--tracker",
        choices=("engine", "process"),
        default="engine",
        help="ours with --artifact-tracker process: its step thread's CPU is then the "
        "engine's share, the tracker's work runs in the tracker process",
    )
    parser.add_argument(
        "--keys",
        action="store_true",
        help=f"also run {KEYS!r}: ours with every request asking for the keys-only handoff "
        "(no rows go out; the handle's digest is made on the scheduler's thread)",
    )
    parser.add_argument(
        "--background-publisher",
        action="store_true",
        help="ours publishes every batch on its background thread (as for a network store), "
        "its large ones too, which the engine writes inline with its /dev/shm store",
    )
    parser.add_argument(
        "--gpu-step-ms",
        type=float,
        default=0.0,
        help="sleep this long after each step, outside the timed parts, as a GPU step would "
        "leave the store writer and the tracker process time to catch up",
    )
    args = parser.parse_args()
    global TRACKER_PROCESS, STEP_GAP_S
    TRACKER_PROCESS = args.tracker == "process"
    STEP_GAP_S = args.gpu_step_ms / 1e3
    root = f"/dev/shm/vllm-artifact-bench-{os.getpid()}"
    os.mkdir(root, 0o700)
    closers: list[Callable[[], None]] = []
    try:
        configs = []
        for make in (
            lambda: (
                ours_in_a_tracker_process(root, args.workload)
                if TRACKER_PROCESS
                else ours(root, args.workload, background=args.background_publisher)
            ),
            lambda: vllms_own(args.workload),
            lambda: ours(root, args.workload, PER_STEP, background=args.background_publisher),
            *(
                [lambda: ours(root, args.workload, KEYS, background=args.background_publisher)]
                if args.keys
                else []
            ),
        ):
            config, close = make()
            configs.append(config)
            closers.append(close)
        # As vLLM's engine core after its start-up: the set-up's objects leave the collector's
        # view, so a full collection (hundreds of ms over the bench's own heap, on whichever
        # step allocates) does not land in one configuration's step.
        gc.freeze()
        for _ in range(args.rounds):
            for config in configs:
                config.run(args.steps)
        publisher = configs[0].worker._publisher
        if publisher is not None:
            publisher.flush()
            assert not publisher.failures, "every block was published (see the log)"
        else:
            configs[0].worker.flush_publications()
        report(configs)
    finally:
        gc.unfreeze()  # (frozen objects outlive the interpreter: native bindings call it a leak)
        for close in closers:
            close()
        shutil.rmtree(root, ignore_errors=True)


def report(configs: list[Config]) -> None:
    def stats(values: list[float]) -> tuple[float, float]:
        ordered = sorted(values)
        return statistics.median(ordered), ordered[int(0.9 * len(ordered))]

    decode = configs[0].workload == "decode"
    prefill = PREFILL_SHAPES.get(configs[0].workload, PREFILL_SHAPES["prefill"])
    bs = LAYOUT.block_size
    shape = f"R3 {LAYOUT.num_layers}x{LAYOUT.top_k} uint8, block {bs}"
    if decode:
        what = (
            f"{CONCURRENCY} decoding requests, {shape}, a new request with a "
            f"{PREFIX_BLOCKS * bs}-token prefix hit every {NEW_REQUEST_EVERY} steps"
        )
    else:
        what = (
            f"chunked prefill, {PREFILL_TOKEN_BUDGET} tokens per step, up to "
            f"{prefill.max_running} requests of {prefill.prompt_blocks * bs + 1}-token prompts (a "
            f"{prefill.shared_blocks * bs}-token prefix hit from the store) and "
            f"{prefill.output_tokens} output tokens, {shape}; no target (the issue's are for "
            "decode)"
        )
    print(
        f"{what}; {len(configs[0].worker_ms)} timed steps per config; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "  per step, the step thread's CPU time (the targets' measure) and its wall time (which "
        "also counts waiting for the GIL while the store writer thread holds it)"
    )
    medians: dict[tuple[str, str], float] = {}
    for side, target in (("scheduler", TARGET_SCHEDULER_MS), ("worker", TARGET_WORKER_MS)):
        for config in configs:
            median, p90 = stats(getattr(config, f"{side}_ms"))
            wall, wall_p90 = stats(getattr(config, f"{side}_wall_ms"))
            medians[side, config.name] = median
            verdict = ""
            if config.name == "ours" and decode:
                verdict = f"  target <= {target} ms: {'PASS' if median <= target else 'MISS'}"
            mean = statistics.fmean(getattr(config, f"{side}_ms"))  # what throughput pays
            wall_mean = statistics.fmean(getattr(config, f"{side}_wall_ms"))
            print(
                f"  {side:<9} {config.name:<14} CPU median {median:6.3f} ms (p90 {p90:6.3f}, "
                f"mean {mean:6.3f}), wall median {wall:6.3f} ms (p90 {wall_p90:6.3f}, "
                f"mean {wall_mean:6.3f}){verdict}"
            )
        ratio = medians[side, "ours"] / medians[side, "vLLM's own"]
        print(f"  {side:<9} ours / vLLM's own (CPU medians): {ratio:.2f}x")
        held = medians[side, "ours"] - medians[side, PER_STEP]
        print(f"  {side:<9} ours - {PER_STEP} (CPU medians): {held:+.3f} ms")
        if (side, KEYS) in medians:
            keys = medians[side, KEYS] / medians[side, "ours"]
            print(f"  {side:<9} {KEYS} / ours (CPU medians): {keys:.2f}x")
    # The p90 steps are those where a request arrives: the worker reads its prefix hit's R3
    # from the store (ours) and the step thread may wait for the GIL there.
    for config in configs if decode else ():  # in prefill every step has a prefix hit
        for kind, wanted in (("prefix-hit steps", True), ("other steps", False)):
            picked = [
                (c, w)
                for c, w, h in zip(
                    config.worker_ms, config.worker_wall_ms, config.hit_steps, strict=True
                )
                if h == wanted
            ]
            cpu_ms, wall_ms = [c for c, _ in picked], [w for _, w in picked]
            waited = statistics.fmean(w - c for c, w in picked)
            print(
                f"  worker    {config.name:<14} {kind:<16} ({len(picked)}): CPU median "
                f"{statistics.median(cpu_ms):6.3f} ms, wall median "
                f"{statistics.median(wall_ms):6.3f} ms, wall - CPU mean {waited:6.3f} ms"
            )
    for config in configs:
        publisher = getattr(config.worker, "_publisher", None)
        if publisher is not None:
            print(
                f"  store batches of {config.name}: {publisher.inline_batches} written inline "
                f"(in the step thread's figures), {publisher.thread_batches} handed to the "
                f"publishing thread ({publisher.thread_batches / config.writer_steps:.2f} "
                "per step)"
            )
        print(
            f"  store writer thread ({config.writer_thread}) of {config.name}: "
            f"{config.writer_cpu_ms / config.writer_steps:.3f} ms CPU per step (mean)"
        )
    # The writer's CPU above includes what contention for the GIL costs it; redone alone, on
    # one thread, its work is what it would cost on a core of its own.
    replayed = {config.name: config.replay_writes() * 1e3 / config.steps for config in configs}
    for name, ms in replayed.items():
        print(f"  store writes of {name}, replayed alone on one thread: {ms:.3f} ms CPU per step")
    ratio = replayed["ours"] / replayed["vLLM's own"]
    print(f"  store writes replayed, ours / vLLM's own: {ratio:.2f}x")
    floor_shape = (32768, LAYOUT.num_layers, LAYOUT.top_k)  # a 32K-token request's R3
    print(
        f"  floor: numpy copy of {np.prod(floor_shape) / 2**20:.1f} MiB (a 32K-token request's R3) "
        f"median {copy_floor_seconds(floor_shape) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
