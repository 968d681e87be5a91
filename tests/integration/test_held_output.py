"""Which requests' rows the scheduler connector holds until their end, and what vLLM's
scheduler gets back (``take_output``) on each step: the engine's side of sending a request's
R3 in one array instead of one per step (the frontend side: ``tests/e2e/test_offline.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.v1.request import RequestStatus

from vllm_artifact.contract import EmittedRows, StepResult
from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector


class FakeRequest(SimpleNamespace):
    def is_finished(self) -> bool:
        return bool(RequestStatus.is_finished(self.status))


def fake_request(request_id: str, *, stop: list[str] | None = None, **extra: Any) -> Any:
    params = SimpleNamespace(
        routed_experts_prompt_start=0, stop=stop or [], extra_args=extra.pop("extra_args", None)
    )
    return FakeRequest(
        request_id=request_id,
        num_tokens=5,
        num_prompt_tokens=5,
        num_output_tokens=0,
        block_hashes=[],
        status=RequestStatus.RUNNING,
        sampling_params=params,
        resumable=extra.pop("resumable", False),
    )


def schedule(connector: ArtifactSchedulerConnector, requests: dict[str, Any]) -> None:
    output = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(requests, 1))
    connector.build_connector_meta(output, requests)  # type: ignore[arg-type]


def run_steps(
    connector: ArtifactSchedulerConnector, requests: dict[str, Any], steps: int
) -> dict[str, list[np.ndarray | None]]:
    """A prefill step of 4 rows, then one row per step; every request finishes (length
    capped) on the last step. Returns what take_output gave vLLM per request and step."""
    given: dict[str, list[np.ndarray | None]] = {rid: [] for rid in requests}
    start = 0
    for step in range(steps):
        count = 4 if step == 0 else 1
        entries = {}
        for index, (rid, request) in enumerate(requests.items()):
            rows = np.full((count, 2, 2), 10 * step + index, np.uint8)
            entries[rid] = EmittedRows(start, rows)
            request.num_tokens = start + count + 1
            if step == steps - 1:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        result = StepResult(entries=entries)
        for rid, request in requests.items():
            given[rid].append(connector.take_output(request, result))
        start += count
    return given


def test_rows_of_a_request_the_engine_ends_leave_once_at_its_end() -> None:
    connector = ArtifactSchedulerConnector()
    requests = {"plain": fake_request("plain"), "other": fake_request("other")}
    schedule(connector, requests)
    given = run_steps(connector, requests, steps=5)
    for index, rid in enumerate(requests):
        *running, last = given[rid]
        assert running == [None] * 4
        assert last is not None and last.shape == (8, 2, 2)
        expected = [10 * step + index for step in range(5) for _ in range(4 if step == 0 else 1)]
        assert last[:, 0, 0].tolist() == expected
    assert connector.take_late_failures() == {}
    assert connector._held_rows == {}


def test_requests_the_frontend_can_end_get_their_rows_every_step() -> None:
    """A stop string is matched in the frontend, which then ends the request without a
    terminal output from the engine; a resumable (streaming-input) request finishes once per
    input. Both keep vLLM's per-step rows."""
    connector = ArtifactSchedulerConnector()
    requests = {
        "stop": fake_request("stop", stop=["\n\n"]),
        "streaming": fake_request("streaming", resumable=True),
    }
    schedule(connector, requests)
    given = run_steps(connector, requests, steps=3)
    for rid in requests:
        assert [None if rows is None else len(rows) for rows in given[rid]] == [4, 1, 1]


def test_an_aborted_held_request_is_forgotten() -> None:
    connector = ArtifactSchedulerConnector()
    requests = {"gone": fake_request("gone")}
    schedule(connector, requests)
    step = StepResult(entries={"gone": EmittedRows(0, np.zeros((4, 2, 2), np.uint8))})
    assert connector.take_output(requests["gone"], step) is None
    assert "gone" in connector._held_rows
    requests["gone"].status = RequestStatus.FINISHED_ABORTED
    connector.request_finished(requests["gone"])
    assert connector._held_rows == {}


def test_a_preempted_request_keeps_its_rows_and_resumes_where_it_stopped() -> None:
    """vLLM calls ``request_finished`` on preemption with the request still running, then
    schedules it again as a new request (emit start: its last token). The rows from before
    preemption are part of its answer; only its true end lets them go."""
    connector = ArtifactSchedulerConnector()
    request = fake_request("long")
    schedule(connector, {"long": request})
    before = StepResult(entries={"long": EmittedRows(0, np.full((4, 2, 2), 1, np.uint8))})
    assert connector.take_output(request, before) is None
    connector.request_finished(request)  # preempted: still RUNNING when vLLM calls this
    request.status = RequestStatus.PREEMPTED
    request.num_output_tokens = 1
    request.status = RequestStatus.RUNNING
    schedule(connector, {"long": request})  # rescheduled: new to vLLM's hash bookkeeping
    request.num_tokens = 8
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    after = StepResult(entries={"long": EmittedRows(4, np.full((3, 2, 2), 2, np.uint8))})
    rows = connector.take_output(request, after)
    assert rows is not None and rows[:, 0, 0].tolist() == [1] * 4 + [2] * 3
    connector.request_finished(request)
    assert connector._held_rows == {}
