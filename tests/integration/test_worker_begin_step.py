"""A step's start on rank zero: the scheduler's updates reach the publisher as one
submission, so its thread wakes once per step start, not once per kind of update."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_artifact.contract import TailBlock
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION, full_block_keys, tail_block_key
from vllm_artifact.core.publisher import Publisher
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.integration.kv_events import eviction_id
from vllm_artifact.integration.vllm_contract import ArtifactStepMetadata
from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector

LAYOUT = R3Layout(num_layers=3, top_k=2, num_experts=8, block_size=4)
BS = LAYOUT.block_size


class StepStarts:
    """Stands in for the capturer: the connector tells it that a step starts and takes an
    (empty) snapshot of a step without tokens."""

    def step_started(self) -> None:
        pass

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        return torch.zeros((num_tokens, *LAYOUT.row_shape), dtype=torch.uint8)


def batch_of(*request_ids: str) -> SimpleNamespace:
    """MRV2's input batch of a step, as ``prepare_output`` reads it (one token each)."""
    n = len(request_ids)
    return SimpleNamespace(
        req_ids=list(request_ids),
        query_start_loc_np=np.arange(n + 1),
        num_computed_tokens_np=np.zeros(n, dtype=np.int64),
    )


@pytest.fixture
def worker() -> Iterator[tuple[ArtifactWorkerConnector, RequestTracker, Publisher, ShmStore]]:
    """Rank zero's worker connector without a model: a real tracker, publisher (every batch
    on its thread) and /dev/shm store."""
    root = f"/dev/shm/vat-begin-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(root, 0o700)
    store = ShmStore.create_or_open_writer(root, "s", layout=LAYOUT, capacity_bytes=1 << 20)
    publisher = Publisher(store)
    tracker = RequestTracker(
        LAYOUT, "model", store, publisher, buffer_max_bytes=1 << 20, block_id=eviction_id
    )
    connector = object.__new__(ArtifactWorkerConnector)
    connector._process, connector._steps_started = None, 0
    connector._facts_due = []
    connector._capturer = StepStarts()  # type: ignore[assignment]
    connector._lock = threading.Lock()
    connector._generation = 0
    connector._store, connector._tracker = store, tracker
    try:
        yield connector, tracker, publisher, store
    finally:
        publisher.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def block_hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def one_request_step(tracker: RequestTracker, request_id: str, rows: np.ndarray) -> None:
    """The request's rows, computed in one step from its first token."""
    tracker.step_started([request_id])
    n = len(rows)
    tracker.step_finished(
        StepBatch(
            [request_id],
            np.array([0]),
            np.array([n]),
            np.array([0]),
            np.array([n]),
            np.array([True]),
            rows,
        )
    )


def test_a_step_start_hands_its_blocks_unpins_and_tails_to_the_publisher_at_once(
    worker: tuple[ArtifactWorkerConnector, RequestTracker, Publisher, ShmStore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connector, tracker, publisher, store = worker
    rng = np.random.default_rng(0)
    a_rows = rng.integers(0, 8, (2 * BS + 3, *LAYOUT.row_shape)).astype(LAYOUT.dtype)
    b_rows = rng.integers(0, 8, (2 * BS, *LAYOUT.row_shape)).astype(LAYOUT.dtype)
    a_hashes, b_hashes = block_hashes("a", 2), block_hashes("b", 2)
    connector.begin_step(
        ArtifactStepMetadata(
            0, {"a": 0, "b": 0}, {"a": a_hashes}, (), weight_version=DEFAULT_WEIGHT_VERSION
        )
    )
    connector.prepare_output(batch_of())  # the step's forward is queued: its facts apply
    one_request_step(tracker, "a", a_rows)
    one_request_step(tracker, "b", b_rows)  # b's blocks wait for their hashes
    publisher.flush()
    assert store.stats().pinned_objects == 2
    to_thread = publisher.thread_batches
    submitted: list[list[Any]] = []
    submit = publisher.submit
    monkeypatch.setattr(publisher, "submit", lambda runs: submitted.append(runs) or submit(runs))
    tail_hash = hashlib.sha256(b"a-tail").digest()
    connector.begin_step(
        ArtifactStepMetadata(
            0,
            {},
            {"b": b_hashes},
            ("a",),
            weight_version=DEFAULT_WEIGHT_VERSION,
            tails={"a": TailBlock(tail_hash, 2 * BS, 3)},
            kv_evicted=[eviction_id(a_hashes[0])],
        )
    )
    assert not submitted  # not before the step's forward is queued
    connector.prepare_output(batch_of())
    assert len(submitted) == 1 and publisher.thread_batches == to_thread + 1
    publisher.flush()
    namespace = tracker.namespace
    assert store.stats().pinned_objects == 3  # a's second block and b's two
    assert store.exists(full_block_keys(namespace, b_hashes)) == [True, True]
    (tail,) = store.get([tail_block_key(namespace, tail_hash, 3)])
    np.testing.assert_array_equal(tail, a_rows[2 * BS :])


def test_a_steps_facts_wait_for_its_forward_and_a_step_without_one_applies_them_in_order(
    worker: tuple[ArtifactWorkerConnector, RequestTracker, Publisher, ShmStore],
) -> None:
    """begin_step runs before the step's forward is queued: the engine's tracker gets the
    facts in prepare_output, after it. A step without a forward (no tokens scheduled) never
    prepares an output, so it applies them at once, the earlier steps' first."""
    connector, tracker, _, _ = worker
    requests = tracker._requests

    def step(admitted: dict[str, int], finished: tuple[str, ...], forward: bool) -> None:
        connector.begin_step(
            ArtifactStepMetadata(
                0,
                admitted,
                {},
                finished,
                weight_version=DEFAULT_WEIGHT_VERSION,
                runs_forward=forward,
            )
        )

    step({"b": 0}, (), forward=True)
    assert "b" not in requests  # not yet: the forward is queued first
    connector.prepare_output(batch_of("b"))
    assert "b" in requests and tracker._in_flight("b")  # admitted before its step started
    step({"a": 0}, (), forward=True)
    assert "a" not in requests
    step({}, ("a",), forward=False)  # finished in a step without a forward: applied now
    assert "a" not in requests  # admitted, then finished: in that order
    step({"c": 0}, (), forward=False)
    assert "c" in requests
