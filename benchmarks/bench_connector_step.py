"""Per-step CPU cost of the Artifact Connector, driven with synthetic engine steps (no model).

On a GPU a big-MoE decode step takes ~20-40 ms; what the connector adds per step is the figure
that matters, and on CPU the tiny model's step time hides it. This drives our scheduler-side
connector and rank zero's RequestTracker with the facts of a decode-heavy batch:

* 256 concurrent decoding requests, DeepSeek-V3-sized R3 (58 layers x top-8, uint8), 16-token
  blocks, a real /dev/shm store;
* every step each request decodes one token; a block's hash arrives the step after it fills;
* every few steps a request finishes and a new one arrives with a 1024-token prefix hit whose
  R3 is read from the store.

Prints the median and p90 added time per step for each side (targets from issue 6: scheduler
<= 0.3 ms, worker <= 0.5 ms). Run: ``.venv/bin/python benchmarks/bench_connector_step.py``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.v1.request import RequestStatus

from vllm_artifact.core.publisher import BackgroundPublisher
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.tracker import RequestTracker, StepRows

LAYOUT = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
CONCURRENCY = 256
PREFIX_BLOCKS = 64  # 1024-token prefix hit for new requests
STEPS = 400
NEW_REQUEST_EVERY = 4  # steps


def block_hash(tag: int, i: int) -> bytes:
    return tag.to_bytes(8, "little") + i.to_bytes(8, "little") + bytes(16)


class FakeRequest:
    """The attributes vLLM's scheduler connector reads from a ``Request``."""

    def __init__(self, request_id: str, prefix_tag: int, own_tag: int, prompt_blocks: int) -> None:
        self.request_id = request_id
        self.tag = own_tag  # blocks after the shared prefix are this request's own
        self.num_prompt_tokens = prompt_blocks * LAYOUT.block_size + 1
        self.num_tokens = self.num_prompt_tokens
        self.block_hashes = [block_hash(prefix_tag, i) for i in range(prompt_blocks)]
        self.sampling_params = SimpleNamespace(routed_experts_prompt_start=0)
        self.status = RequestStatus.RUNNING

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def is_finished(self) -> bool:
        return False

    @property
    def all_token_ids(self) -> list[int]:
        return [7] * self.num_tokens

    @property
    def lora_request(self) -> None:
        return None

    @property
    def mm_features(self) -> list[object]:
        return []

    @property
    def cache_salt(self) -> None:
        return None

    @property
    def prompt_embeds(self) -> None:
        return None

    def decode_one(self) -> None:
        self.num_tokens += 1
        full = self.num_tokens // LAYOUT.block_size
        while len(self.block_hashes) < full:
            self.block_hashes.append(block_hash(self.tag, len(self.block_hashes)))


def main() -> None:
    from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector

    root = f"/dev/shm/vllm-artifact-bench-{os.getpid()}"
    os.mkdir(root, 0o700)
    try:
        run(root, ArtifactSchedulerConnector)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: str, connector_cls: Any) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    rng = np.random.default_rng(0)
    store = ShmStore.create_or_open_writer(root, "bench", layout=LAYOUT, capacity_bytes=64 << 20)
    publisher = BackgroundPublisher(store)
    tracker = RequestTracker(LAYOUT, "bench", store, publisher, buffer_max_bytes=512 << 20)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    connector = connector_cls(hash_fn=hash_fn, hash_block_size=LAYOUT.block_size)
    # Publish the shared prefix once (as an earlier request would have).
    prefix_rows = rng.integers(0, 256, (PREFIX_BLOCKS * 16, 58, 8), dtype=np.uint8)
    from vllm_artifact.core.keys import full_block_keys

    store.put_blocks(
        full_block_keys(tracker.namespace, [block_hash(0, i) for i in range(PREFIX_BLOCKS)]),
        prefix_rows,
        0,
    )

    requests: dict[str, FakeRequest] = {}
    next_id = 0

    def new_request(hit: bool) -> FakeRequest:
        nonlocal next_id
        own = 1000 + next_id
        request = FakeRequest(f"r{next_id}", 0 if hit else own, own, PREFIX_BLOCKS)
        next_id += 1
        return request

    for _ in range(CONCURRENCY):
        r = new_request(hit=False)
        r.decode_one()  # already decoding: everything before its next token was emitted
        requests[r.request_id] = r

    sched_times: list[float] = []
    worker_times: list[float] = []
    for step_index in range(STEPS):
        finished: list[FakeRequest] = []
        if step_index and step_index % NEW_REQUEST_EVERY == 0:
            victim = next(iter(requests.values()))
            del requests[victim.request_id]
            victim.status = RequestStatus.FINISHED_LENGTH_CAPPED
            finished.append(victim)
            r = new_request(hit=True)
            requests[r.request_id] = r
        scheduler_output = SimpleNamespace(
            num_scheduled_tokens={rid: 1 for rid in requests},
        )
        # ---- scheduler side: finished events, metadata build
        t0 = time.perf_counter()
        for request in finished:
            connector.request_finished(request)  # type: ignore[arg-type]
        metadata = connector.build_connector_meta(scheduler_output, requests)  # type: ignore[arg-type]
        sched = time.perf_counter() - t0

        # ---- worker side: begin_step facts, step start, captured rows, step finish
        step_rows = []
        t1 = time.perf_counter()
        tracker.set_weight_version(metadata.weight_version)
        for rid, emit_start in metadata.step.requests.items():
            tracker.admit(rid, int(emit_start))
        for rid, packed in metadata.step.block_hashes.items():
            tracker.add_block_hashes(rid, packed)
        for rid in metadata.step.finished_requests:
            tracker.finish(rid)
        tracker.step_started(list(requests))
        worker_a = time.perf_counter() - t1
        captured = rng.integers(0, 256, (len(requests), 58, 8), dtype=np.uint8)
        for i, (rid, request) in enumerate(requests.items()):
            # A new request's first step computes only the token after its cached prefix.
            start = request.num_tokens - 1
            step_rows.append(StepRows(rid, start, 1, captured[i : i + 1], True))
        t2 = time.perf_counter()
        outputs = tracker.step_finished(step_rows)
        worker = worker_a + time.perf_counter() - t2

        # ---- scheduler side: take each request's rows, then the tokens are appended
        t3 = time.perf_counter()
        for request in requests.values():
            connector.take_output(request, outputs)  # type: ignore[arg-type]
        sched += time.perf_counter() - t3
        for request in requests.values():
            request.decode_one()
        if step_index >= 20:  # skip warm-up
            sched_times.append(sched)
            worker_times.append(worker)

    publisher.close()
    store.close()

    def report(name: str, values: list[float], target_ms: float) -> None:
        ms = sorted(v * 1e3 for v in values)
        median = statistics.median(ms)
        p90 = ms[int(0.9 * len(ms))]
        verdict = "PASS" if median <= target_ms else "MISS"
        print(
            f"  {name:<28} median {median:7.3f} ms  p90 {p90:7.3f} ms  "
            f"target <= {target_ms} ms: {verdict}"
        )

    print(
        f"{CONCURRENCY} decoding requests, R3 {LAYOUT.num_layers}x{LAYOUT.top_k} uint8, "
        f"block {LAYOUT.block_size}, a new request with a {PREFIX_BLOCKS * 16}-token prefix hit "
        f"every {NEW_REQUEST_EVERY} steps; {len(sched_times)} steps; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    report("scheduler thread per step", sched_times, 0.3)
    report("rank-zero worker per step", worker_times, 0.5)


if __name__ == "__main__":
    main()
