"""The step's rows leave the worker connector in memory of their own: a GPU step's pinned host
buffer is released on the step's thread, not wherever the last view of it dies."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch

from vllm_artifact.contract import StepResult
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector, PendingArtifactStep

LAYOUT = R3Layout(num_layers=3, top_k=2, num_experts=8, block_size=4)


class RecordingTracker:
    def __init__(self) -> None:
        self.steps: list[Any] = []
        self.arrays = RecycledArrays(min_bytes=0)

    def step_finished(self, step: Any) -> StepResult:
        self.steps.append(step)
        return StepResult()


def connector_and_step(pinned: bool) -> tuple[RecordingTracker, PendingArtifactStep]:
    """A worker connector with only its step path (no model, no store) and a two-request
    step whose host copy is marked pinned as a GPU copy's is (this machine has no GPU)."""
    connector = object.__new__(ArtifactWorkerConnector)
    connector._process, connector._steps_started = None, 0
    connector._facts_due = []
    tracker = RecordingTracker()
    connector._lock = threading.Lock()
    connector._tracker = tracker  # type: ignore[assignment]
    connector._layout = LAYOUT
    connector._keys_context = None
    snapshot = torch.arange(5 * 3 * 2, dtype=torch.uint8).reshape(5, 3, 2)
    pending = PendingArtifactStep(
        connector=connector,
        request_ids=["a", "b"],
        token_starts=np.array([0, 0]),
        query_start_loc=np.array([0, 2, 5]),
        snapshot=snapshot,
    )
    pending.enqueue_cpu_copy(np.array([1, 1], np.int32), np.array([0, 0], np.int32))
    assert not pending.pinned  # a CPU tensor's copy is its own memory
    pending.pinned = pinned
    return tracker, pending


def test_a_pinned_host_copy_is_copied_out_and_released_in_process_output() -> None:
    tracker, pending = connector_and_step(pinned=True)
    host = pending.rows
    assert host is not None
    host_buffer = weakref.ref(host.base)  # the CPU tensor numpy views (the pinned buffer)
    del host
    pending.process_output()
    (step,) = tracker.steps
    assert pending.rows is None
    assert host_buffer() is None  # released here, not by whoever drops the step's views
    expected = np.arange(30, dtype=np.uint8).reshape(5, 3, 2)
    np.testing.assert_array_equal(step.rows, expected)
    # copied into the tracker's recycled memory (reused once the step's views are gone)
    assert step.rows.base is not None and tracker.arrays.nbytes == step.rows.base.nbytes


def test_a_cpu_copy_is_handed_on_without_a_second_copy() -> None:
    tracker, pending = connector_and_step(pinned=False)
    host = pending.rows
    pending.process_output()
    (step,) = tracker.steps
    assert np.shares_memory(step.rows, host)
