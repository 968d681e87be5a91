"""Runtime guards on the engine and frontend paths are typed errors that fail one request,
never an ``assert`` (gone under ``python -O``) or an exception that kills a vLLM process."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from vllm_artifact.contract import EmittedRows, StepResult
from vllm_artifact.core.failure import r3_failure
from vllm_artifact.core.handoff import KeysContext, StoreAddress
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION, full_block_keys
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import VllmIncompatibleError
from vllm_artifact.integration.hooks import (
    apply_all,
    request_errors,
    require_attributes,
    terminal_output,
)
from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector

apply_all()
PACKAGE = Path(__file__).resolve().parents[2] / "vllm_artifact"


@pytest.mark.parametrize("folder", ["integration", "core", "client"])
def test_no_assert_statements_in_the_product(folder: str) -> None:
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    # The store's own module-level layout checks are constants checked once at import.
    allowed = {"core/store/shm_arena.py"}
    assert [f for f in found if f.split(":")[0] not in allowed] == []


def request(request_id: str, num_tokens: int, status: RequestStatus) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        num_tokens=num_tokens,
        status=status,
        is_finished=lambda: RequestStatus.is_finished(status),
    )


def test_rows_short_of_the_scheduler_fail_that_request_only() -> None:
    """The worker sent fewer rows than the scheduler's token count (an invariant of ours
    broken): vLLM's update_from_output must go on, the request fails closed after it."""
    connector = ArtifactSchedulerConnector()
    rows = np.zeros((3, 4, 2), np.uint8)
    step = StepResult(entries={"short": EmittedRows(10, rows), "fine": EmittedRows(10, rows)})
    short = request("short", num_tokens=20, status=RequestStatus.RUNNING)
    fine = request("fine", num_tokens=14, status=RequestStatus.RUNNING)
    assert connector.take_output(short, step) is None
    got = connector.take_output(fine, step)
    assert got is not None and len(got) == 3
    failures = connector.take_late_failures()
    assert list(failures) == ["short"]
    assert failures["short"].reason == "internal"
    assert "rows up to token 13, the scheduler expects 19" in failures["short"].message
    assert connector.take_late_failures() == {}


def test_a_finished_request_without_its_last_row_fails_closed() -> None:
    connector = ArtifactSchedulerConnector()
    step = StepResult(entries={"done": EmittedRows(30, np.zeros((2, 4, 2), np.uint8))})
    done = request("done", num_tokens=25, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    assert connector.take_output(done, step) is None
    assert "has no R3 rows for its last token" in connector.take_late_failures()["done"].message


class _Output(SimpleNamespace):
    pass


def fake_original(self: Any, token_ids: Any, finish_reason: Any, stop_reason: Any) -> Any:
    """vLLM's _new_completion_output, reduced to what the hook relies on."""
    routed = np.concatenate(self.routed_experts_chunks) if self.routed_experts_chunks else None
    return _Output(
        finish_reason=None if finish_reason is None else str(finish_reason),
        stop_reason=stop_reason,
        routed_experts=routed,
    )


def test_r3_that_cannot_be_assembled_fails_the_request_not_the_output_handler() -> None:
    """Chunks that do not join (a broken invariant) used to raise in AsyncLLM's output
    handler, which serves every request: the API server went down with it."""
    wrapped = terminal_output._wrap_new_completion_output(fake_original)
    state = SimpleNamespace(
        external_req_id="cmpl-broken-0",
        routed_experts_chunks=[np.zeros((2, 4, 2), np.uint8), np.zeros((1, 5, 2), np.uint8)],
    )
    output = wrapped(state, [1, 2], 1, None)  # FinishReason.LENGTH
    assert output.finish_reason == "error" and output.routed_experts is None
    failure = r3_failure(output.stop_reason)
    assert failure is not None and failure.reason == "internal"
    assert "could not be assembled" in failure.message
    assert request_errors.FAILURES.take("cmpl-broken", request_errors._COMPLETIONS) == (
        failure.message
    )
    good = SimpleNamespace(
        external_req_id="x", routed_experts_chunks=[np.ones((2, 4, 2), np.uint8)]
    )
    output = wrapped(good, [1], 0, None)
    assert output.finish_reason == "0" and output.routed_experts.shape == (2, 4, 2)


def test_a_request_that_fails_after_some_rows_arrived_is_answered_without_them() -> None:
    """R3 lost mid-request (its prompt's rows already reached the frontend): the error
    completion carries no partial R3."""
    wrapped = terminal_output._wrap_new_completion_output(fake_original)
    state = SimpleNamespace(
        external_req_id="cmpl-lost-0", routed_experts_chunks=[np.ones((3, 4, 2), np.uint8)]
    )
    output = wrapped(state, [1], FinishReason.ERROR, "vllm-artifact[tracker_process] lost")
    assert output.finish_reason == str(FinishReason.ERROR) and output.routed_experts is None
    assert output.stop_reason == "vllm-artifact[tracker_process] lost"


def test_a_finished_keys_request_is_never_answered_without_its_handle() -> None:
    """Its last partial block's hash cannot be made (here: no hash function): the request
    fails closed instead of finishing with no R3 and no error."""
    connector = ArtifactSchedulerConnector(hash_fn=None, hash_block_size=16)
    layout = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=())
    connector._keys_context = KeysContext(StoreAddress(root="/dev/shm/x", name="s"), "m", layout)
    connector._keys_requests["k"] = []
    done = SimpleNamespace(
        request_id="k",
        num_tokens=21,  # 20 rows: one full block and a tail of 4
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        is_finished=lambda: True,
        block_hashes=[b"h" * 32],
        sampling_params=SimpleNamespace(routed_experts_prompt_start=0),
    )
    rows = np.zeros((20, 4, 2), np.uint8)
    assert connector.take_output(done, StepResult(entries={"k": EmittedRows(0, rows)})) is None
    failure = connector.take_late_failures()["k"]
    assert "last, partial block cannot be made" in failure.message


def test_a_keys_requests_blocks_are_keyed_under_the_weight_version_of_their_step() -> None:
    """The scheduler makes a running keys-only request's keys a step at a time; a weight
    version set between two steps keys the later blocks under the new version, as rank zero
    keys the objects it publishes."""
    connector = ArtifactSchedulerConnector(hash_fn=None, hash_block_size=16)
    layout = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=())
    context = KeysContext(StoreAddress(root="/dev/shm/x", name="s"), "m", layout)
    connector._keys_context = context
    keys: list[Any] = []
    connector._keys_requests["k"] = keys
    running = SimpleNamespace(
        request_id="k",
        num_tokens=17,
        status=RequestStatus.RUNNING,
        is_finished=lambda: False,
        block_hashes=[b"a" * 32],
        sampling_params=SimpleNamespace(routed_experts_prompt_start=0),
    )
    assert connector.take_output(running, StepResult(entries={})) is None
    connector.set_weight_version("step-2")
    running.block_hashes = [b"a" * 32, b"b" * 32]
    running.num_tokens = 33
    assert connector.take_output(running, StepResult(entries={})) is None
    before = context.namespace(DEFAULT_WEIGHT_VERSION)
    assert keys == [
        *full_block_keys(before, [b"a" * 32]),
        *full_block_keys(context.namespace("step-2"), [b"b" * 32]),
    ]


def test_a_vllm_without_a_hooked_name_fails_at_install_with_a_typed_error() -> None:
    """Under ``python -O`` an ``assert`` would vanish and the hook would fail later, or
    silently; the check is a typed error naming the hook and what to install."""
    with pytest.raises(VllmIncompatibleError, match=r"request_errors hook .* vLLM 0\.32\.0"):
        require_attributes("request_errors", (SimpleNamespace, "_raise_if_error"))
