"""Which requests' rows the scheduler connector holds until their end, and what vLLM's
scheduler gets back (``take_output``) on each step: the engine's side of sending a request's
R3 in one array instead of one per step (the frontend side: ``tests/e2e/test_offline.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.v1.request import RequestStatus

from vllm_artifact.contract import EmittedRows, StepResult
from vllm_artifact.core import R3Layout, full_block_keys
from vllm_artifact.core.handoff import KeysContext, R3Keys, StoreAddress
from vllm_artifact.core.held_rows import PAGE_ROWS
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION
from vllm_artifact.core.objects_digest import objects_digest
from vllm_artifact.core.row_file import is_file_transport, read_file_transport, rows_with_room
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
        max_tokens=extra.pop("max_tokens", 16),
        block_hashes=[],
        status=RequestStatus.RUNNING,
        sampling_params=params,
        resumable=extra.pop("resumable", False),
    )


def schedule(connector: ArtifactSchedulerConnector, requests: dict[str, Any]) -> None:
    output = SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(requests, 1), total_num_scheduled_tokens=len(requests)
    )
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


def test_a_request_the_engine_ends_gets_its_prompt_rows_at_once_and_the_rest_at_its_end() -> None:
    connector = ArtifactSchedulerConnector()
    requests = {"plain": fake_request("plain"), "other": fake_request("other")}
    schedule(connector, requests)
    given = run_steps(connector, requests, steps=5)
    for index, rid in enumerate(requests):
        first, *running, last = given[rid]
        assert first is not None and first[:, 0, 0].tolist() == [index] * 4  # the prompt's
        assert running == [None] * 3
        assert last is not None and last[:, 0, 0].tolist() == [10 * s + index for s in (1, 2, 3, 4)]
    assert connector.take_late_failures() == {}
    assert len(connector._held) == 0 and not connector._hold_pending


def decode_step(requests: dict[str, Any], step: int) -> StepResult:
    """One decode step of every request, column-wise as the worker sends steady decode: one
    row each, at the request's last token (which vLLM then advances by one)."""
    ids = list(requests)
    starts = [requests[rid].num_tokens - 1 for rid in ids]
    rows = np.stack([np.full((2, 2), (10 * step + i) % 251, np.uint8) for i in range(len(ids))])
    for request in requests.values():
        request.num_tokens += 1
    return StepResult(decode_ids=ids, decode_token_starts=starts, decode_rows=rows)


def test_decode_steps_of_held_and_per_step_requests_in_one_batch() -> None:
    """A decode batch mixes held requests (their rows written for all of them at once) and
    requests with a stop string (their row each step); each gets exactly its own rows."""
    connector = ArtifactSchedulerConnector()
    requests = {
        "held": fake_request("held"),
        "stop": fake_request("stop", stop=["\n\n"]),
        "late": fake_request("late"),
    }
    schedule(connector, requests)
    prompt = StepResult(
        entries={
            rid: EmittedRows(0, np.full((4, 2, 2), 200 + i, np.uint8))
            for i, rid in enumerate(requests)
        }
    )
    for request in requests.values():
        assert connector.take_output(request, prompt) is not None  # the prompt's, at once
    steps = 3 * PAGE_ROWS + 5
    for step in range(1, steps + 1):
        result = decode_step(requests, step)
        if step == steps:
            requests["held"].status = RequestStatus.FINISHED_LENGTH_CAPPED
        given = {rid: connector.take_output(request, result) for rid, request in requests.items()}
        stop_rows = given["stop"]
        assert stop_rows is not None and stop_rows[:, 0, 0].tolist() == [(10 * step + 1) % 251]
        assert given["late"] is None
        if step < steps:
            assert given["held"] is None
    rows = given["held"]
    assert rows is not None
    assert rows[:, 0, 0].tolist() == [(10 * step) % 251 for step in range(1, steps + 1)]
    assert "held" not in connector._held and "late" in connector._held
    late = requests["late"]
    late.status = RequestStatus.FINISHED_STOPPED  # its last step brings several rows
    two_rows = EmittedRows(late.num_tokens - 1, np.zeros((2, 2, 2), np.uint8))
    last = StepResult(entries={"late": two_rows})
    late.num_tokens += 2
    rows = connector.take_output(late, last)
    assert rows is not None and len(rows) == steps + 2
    assert rows[:, 0, 0].tolist() == [(10 * s + 2) % 251 for s in range(1, steps + 1)] + [0, 0]
    assert connector.take_late_failures() == {}


def test_a_held_request_missing_a_row_fails_instead_of_answering_short() -> None:
    connector = ArtifactSchedulerConnector()
    requests = {"a": fake_request("a")}
    schedule(connector, requests)
    prompt = StepResult(entries={"a": EmittedRows(0, np.zeros((4, 2, 2), np.uint8))})
    assert connector.take_output(requests["a"], prompt) is not None
    connector.take_output(requests["a"], decode_step(requests, 1))
    requests["a"].num_tokens += 1  # a step whose row never came
    requests["a"].status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert connector.take_output(requests["a"], decode_step(requests, 3)) is None
    failures = connector.take_late_failures()
    assert list(failures) == ["a"] and "cover 2 of its tokens 4..6" in failures["a"].message


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
    assert connector.take_output(requests["gone"], step) is not None  # the prompt's rows
    step = StepResult(entries={"gone": EmittedRows(4, np.zeros((1, 2, 2), np.uint8))})
    requests["gone"].num_tokens = 6
    assert connector.take_output(requests["gone"], step) is None
    assert connector._held.pages.in_use == 1
    requests["gone"].status = RequestStatus.FINISHED_ABORTED
    connector.request_finished(requests["gone"])
    assert len(connector._held) == 0 and connector._held.pages.in_use == 0


def test_a_preempted_request_keeps_its_rows_and_resumes_where_it_stopped() -> None:
    """vLLM calls ``request_finished`` on preemption with the request still running, then
    schedules it again as a new request (emit start: its last token). The rows from before
    preemption are part of its answer; only its true end lets them go."""
    connector = ArtifactSchedulerConnector()
    request = fake_request("long")
    schedule(connector, {"long": request})
    prompt = StepResult(entries={"long": EmittedRows(0, np.full((4, 2, 2), 1, np.uint8))})
    assert connector.take_output(request, prompt) is not None  # the prompt's rows, at once
    before = StepResult(entries={"long": EmittedRows(4, np.full((1, 2, 2), 2, np.uint8))})
    request.num_tokens = 6
    assert connector.take_output(request, before) is None
    connector.request_finished(request)  # preempted: still RUNNING when vLLM calls this
    request.status = RequestStatus.PREEMPTED
    request.num_output_tokens = 2
    request.status = RequestStatus.RUNNING
    schedule(connector, {"long": request})  # rescheduled: new to vLLM's hash bookkeeping
    request.num_tokens = 9
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    after = StepResult(entries={"long": EmittedRows(5, np.full((3, 2, 2), 3, np.uint8))})
    rows = connector.take_output(request, after)
    assert rows is not None and rows[:, 0, 0].tolist() == [2] + [3] * 3
    connector.request_finished(request)
    assert len(connector._held) == 0 and not connector._hold_pending


def test_a_step_whose_rows_cannot_be_held_fails_each_of_its_requests() -> None:
    """A broken step output (decode rows of another shape than the rows held so far) fails
    every request of that step, held or not, instead of serving any of them stale rows."""
    connector = ArtifactSchedulerConnector()
    requests = {"held": fake_request("held"), "stop": fake_request("stop", stop=["."])}
    schedule(connector, requests)
    prompt = StepResult(
        entries={rid: EmittedRows(0, np.zeros((4, 2, 2), np.uint8)) for rid in requests}
    )
    for request in requests.values():
        assert connector.take_output(request, prompt) is not None
    connector.take_output(requests["held"], decode_step(requests, 1))
    connector.take_output(requests["stop"], connector._step_output)
    assert connector.take_late_failures() == {}
    broken = decode_step(requests, 2)
    broken.decode_rows = np.zeros((2, 3, 2), np.uint8)  # rows of another shape
    assert [connector.take_output(r, broken) for r in requests.values()] == [None, None]
    failures = connector.take_late_failures()
    assert sorted(failures) == ["held", "stop"]
    reason = "rows could not be sorted: held rows changed shape"
    assert all(reason in failure.message for failure in failures.values())
    assert connector.take_output(requests["stop"], decode_step(requests, 3)) is not None


def test_a_keys_requests_decode_rows_are_held_with_the_others_and_digested_at_its_end() -> None:
    """A keys-only request returns no rows, only its handle at its end. Its prompt's rows go
    into the handle's digest at once; its decode steps' rows are held column-wise with the
    array path's (no per-request work a step) and go into the digest at its end, which then
    is exactly the digest of its rows."""
    layout = R3Layout(num_layers=2, top_k=2, num_experts=8, block_size=4, dense_layers=())
    context = KeysContext(StoreAddress(root="/dev/shm/x", name="s"), "m", layout)
    connector = ArtifactSchedulerConnector(hash_fn=None, hash_block_size=4)
    connector._keys_context = context
    requests = {
        "keys": fake_request("keys", extra_args={"routed_experts_format": "keys"}),
        "plain": fake_request("plain"),
    }
    schedule(connector, requests)
    prompt = {rid: np.full((4, 2, 2), 100 + i, np.uint8) for i, rid in enumerate(requests)}
    step = StepResult(entries={rid: EmittedRows(0, rows) for rid, rows in prompt.items()})
    for request in requests.values():
        request.block_hashes = [b"block 0".ljust(32)]
    assert connector.take_output(requests["keys"], step) is None
    assert connector.take_output(requests["plain"], step) is not None  # its prompt's rows
    own = [prompt["keys"]]
    for number in range(1, 9):  # 8 decode steps: 12 rows, three full blocks
        result = decode_step(requests, number)
        own.append(result.decode_rows[:1])
        for request in requests.values():
            blocks = request.num_tokens // 4
            request.block_hashes = [f"block {b}".encode().ljust(32) for b in range(blocks)]
            if number == 8:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        if number < 8:
            assert "keys" in connector._held.slots
            assert connector.take_output(requests["keys"], result) is None
            assert connector.take_output(requests["plain"], result) is None
    handle = R3Keys.from_transport(connector.take_output(requests["keys"], result))
    assert connector.take_output(requests["plain"], result) is not None
    assert connector.take_late_failures() == {}
    keys = full_block_keys(context.namespace(DEFAULT_WEIGHT_VERSION), requests["keys"].block_hashes)
    assert handle.num_rows == 12 and handle.keys == [key.hex() for key in keys]
    assert handle.objects_xxh3 == objects_digest(layout, keys, 0, np.concatenate(own))
    assert len(connector._held) == 0


def test_a_held_requests_first_rows_made_a_file_go_out_as_that_file() -> None:
    """The worker made its first rows the data part of a file with room for its generated
    tokens' rows (asked for in the step's metadata): vLLM gets the file, header written for
    the rows the scheduler takes (fewer where a step ran past its last token). A request the
    frontend can end is never asked, and its rows go out as rows."""
    connector = ArtifactSchedulerConnector()
    requests = {
        "held": fake_request("held", max_tokens=3),
        "short": fake_request("short", max_tokens=3),
        "stop": fake_request("stop", stop=["\n\n"]),
    }
    output = SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(requests, 4), total_num_scheduled_tokens=12
    )
    metadata = connector.build_connector_meta(output, requests)  # type: ignore[arg-type]
    assert metadata.first_rows_room == {"held": 2, "short": 2}
    layout = R3Layout(num_layers=2, top_k=2, num_experts=8, block_size=4)
    result = StepResult()
    for index, rid in enumerate(requests):
        file, rows = rows_with_room(4, 1, layout)
        assert file is not None
        rows[...] = index
        result.entries[rid] = EmittedRows(0, rows)
        result.files[rid] = file
    requests["short"].num_tokens = 4  # its step ran one token past its last
    given = {rid: connector.take_output(request, result) for rid, request in requests.items()}
    for rid, count in (("held", 4), ("short", 3)):
        sent = given[rid]
        assert sent is not None and is_file_transport(sent) and sent is result.files[rid]
        rows_sent = read_file_transport(sent)[1]
        np.testing.assert_array_equal(rows_sent, result.entries[rid].rows[:count])  # type: ignore[union-attr]
    stop_rows = given["stop"]
    assert (
        stop_rows is not None and stop_rows.shape == (4, 2, 2) and not is_file_transport(stop_rows)
    )
