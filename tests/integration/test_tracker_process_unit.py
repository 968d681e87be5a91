"""The engine's end of the tracker process against a real one on a private /dev/shm root: a
request's rows come back whether its answer fits the step's ring slot or travels in the
pickle, and a killed process fails only what it owed, then a new one serves."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm_artifact.contract import EmittedRows
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION
from vllm_artifact.core.local_decode import LocalDecode
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_facts import StepFacts
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.output_side import OutputSetup
from vllm_artifact.integration.tracker_process import LEASED_SLOTS, TrackerProcess

LAYOUT = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=4)
MAX_ROWS = 4  # rows a step: a ring slot holds 8 x 4 rows of answers


@dataclass
class Step:
    """A finished step, its rows already in host memory: each request's equal share of
    ``rows``, from ``token_start`` on."""

    seq: int
    request_ids: list[str]
    rows: np.ndarray | None
    token_start: int
    sampled: bool = True
    error: Exception | None = None

    def copied(self, wait: bool = False) -> bool:
        return True

    def columns(self, rows: np.ndarray) -> dict[str, Any]:
        n = len(self.request_ids)
        each = len(rows) // n
        starts = np.arange(n) * each
        return dict(
            request_ids=self.request_ids,
            token_starts=np.full(n, self.token_start),
            num_scheduled=np.full(n, each),
            row_starts=starts,
            row_ends=starts + each,
            sampled=np.full(n, self.sampled),
        )


@pytest.fixture
def process() -> Iterator[TrackerProcess]:
    root = Path(f"/dev/shm/vllm-artifact-test-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o700)
    setup = OutputSetup(
        config=ArtifactConfig(enabled=True, root=root, capacity=1 << 20, tracker="process"),
        family="r3-test-dp",
        dp_rank=0,
        layout=LAYOUT,
        model_id="m",
        capacity=1 << 20,
        kv_hash_blocks=8,
        buffer_max_bytes=1 << 20,
    )
    tracker = TrackerProcess(setup, max_rows=MAX_ROWS)
    yield tracker
    tracker.close()
    shutil.rmtree(root, ignore_errors=True)


def serve(process: TrackerProcess, request_id: str, rows: np.ndarray, seq: int) -> Any:
    """Admit the request and run its prompt in chunks of ``MAX_ROWS`` tokens, one step each
    (steps ``seq``, ``seq + 1``, ...); the last step's answer."""
    hashes = [hashlib.sha256(f"{request_id}{i}".encode()).digest() for i in range(2)]
    process.begin(
        StepFacts(
            weight_version=DEFAULT_WEIGHT_VERSION,
            generation=0,
            admitted={request_id: 0},
            block_hashes={request_id: hashes},
        )
    )
    for start in range(0, len(rows), MAX_ROWS):
        process.step_started([request_id])
        last = start + MAX_ROWS >= len(rows)
        step = Step(seq, [request_id], rows[start : start + MAX_ROWS], start, sampled=last)
        seq += 1
        process.queue_step(step)
        answer = process.step_result(step)
    return answer


def rows_of(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 8, (n, *LAYOUT.row_shape)).astype(LAYOUT.dtype)


@pytest.mark.parametrize("tokens", [30, 40], ids=["in the slot", "in the pickle"])
def test_a_steps_rows_come_back(process: TrackerProcess, tokens: int) -> None:
    rows = rows_of(tokens, 0)
    answer = serve(process, "a", rows, seq=0)
    entry = answer.entries["a"]
    assert isinstance(entry, EmittedRows) and entry.token_start == 0
    np.testing.assert_array_equal(entry.rows, rows)
    process.flush(10.0)


def in_the_ring(process: TrackerProcess, rows: np.ndarray) -> bool:
    """Whether ``rows`` are read in place from a ring slot (numpy collapses a view's base onto
    the slot's anchor), not a copy."""
    return any(rows.base is anchor for anchor in process._ring._anchors if anchor is not None)


def test_answers_read_in_place_stay_intact_while_held_and_free_their_slot_when_dropped(
    process: TrackerProcess,
) -> None:
    """An answer's arrays are read from its ring slot, which no later step may use while they
    are held; beyond ``LEASED_SLOTS`` held answers the arrays are copies, so the ring never
    runs out of slots."""
    want = [rows_of(30, 10 + i) for i in range(6)]
    held = [serve(process, f"r{i}", rows, seq=8 * i).entries[f"r{i}"].rows for i, rows in
            enumerate(want)]  # fmt: skip
    in_place = [in_the_ring(process, rows) for rows in held]
    assert in_place == [True] * LEASED_SLOTS + [False] * (6 - LEASED_SLOTS)
    for got, rows in zip(held, want, strict=True):  # none overwritten by a later step
        np.testing.assert_array_equal(got, rows)
    leased = list(process._leased)
    assert len(leased) == LEASED_SLOTS and all(process._ring.leased(s) for s in leased)
    del held, got
    assert not any(process._ring.leased(s) for s in leased)
    answer = serve(process, "after", want[0], seq=100)  # a freed slot is used again
    assert in_the_ring(process, answer.entries["after"].rows)
    np.testing.assert_array_equal(answer.entries["after"].rows, want[0])


def test_a_killed_process_fails_what_it_owed_and_a_new_one_serves(
    process: TrackerProcess,
) -> None:
    first = process.pid
    assert first is not None
    np.testing.assert_array_equal(
        serve(process, "a", rows_of(3, 1), 0).entries["a"].rows, rows_of(3, 1)
    )
    # Started, its rows sent, then the process is killed before it answers.
    process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0, admitted={"b": 0}))
    process.step_started(["b"])
    os.kill(first, signal.SIGSTOP)  # it cannot answer before it dies
    step = Step(1, ["b"], rows_of(3, 2), 0)
    process.queue_step(step)
    process.send_copied()
    os.kill(first, signal.SIGKILL)
    failure = process.step_result(step).entries["b"]
    assert getattr(failure, "reason", None) == "tracker_process"
    # The next request is served by a new process.
    answer = serve(process, "c", rows_of(3, 3), seq=2)
    assert process.pid not in (None, first)
    np.testing.assert_array_equal(answer.entries["c"].rows, rows_of(3, 3))


@dataclass
class Landing:
    """A started step whose GPU copy lands when the test says (or when waited for)."""

    seq: int
    landed: bool = False
    waited: bool = False
    request_ids: tuple[str, ...] = ()

    def copied(self, wait: bool = False) -> bool:
        if wait:
            self.waited = self.landed = True
        return self.landed


def test_steps_go_once_their_copy_landed_in_order_and_an_answer_waits_for_its_own() -> None:
    """At a step's start only the steps whose rows have landed go, oldest first; asking for
    a step's answer waits for its copy and every older one's, never sending one twice."""
    tracker = object.__new__(TrackerProcess)
    tracker._unsent = deque()
    tracker._local_answers, tracker._late = {}, {}
    sent: list[int] = []
    tracker._send_one = lambda step: sent.append(step.seq)  # type: ignore[method-assign]
    tracker.result = lambda seq, ids: seq  # type: ignore[method-assign,assignment,return-value]
    a, b, c = Landing(0, landed=True), Landing(1), Landing(2, landed=True)
    for step in (a, b, c):
        tracker.queue_step(step)  # type: ignore[arg-type]
    tracker.send_copied()
    assert sent == [0]  # b still being copied: c waits behind it
    tracker.send_copied()
    assert sent == [0]
    b.landed = True
    tracker.send_copied()
    assert sent == [0, 1, 2]
    d = Landing(3)
    tracker.queue_step(d)  # type: ignore[arg-type]
    assert tracker.step_result(d) == 3  # type: ignore[arg-type,comparison-overlap]
    assert d.waited and sent == [0, 1, 2, 3]
    assert tracker.step_result(a) == 0  # type: ignore[arg-type,comparison-overlap]
    assert sent == [0, 1, 2, 3]


def test_ctrl_c_leaves_the_process_to_the_engines_shutdown(process: TrackerProcess) -> None:
    """SIGINT reaches a terminal's whole process group; the engine closes the socket as it
    shuts down, and the tracker process goes then, not before."""
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    answer = serve(process, "a", rows_of(6, 4), seq=0)
    assert process.pid == pid
    np.testing.assert_array_equal(answer.entries["a"].rows, rows_of(6, 4))


def test_a_steps_block_hashes_reach_the_process_in_our_own_type() -> None:
    """vLLM's packed hashes would make the tracker process import vLLM to read them."""
    from vllm.distributed.aux_output_connector.connector import PackedBlockHashes

    tracker = object.__new__(TrackerProcess)
    tracker._generation, tracker._live, tracker._local = 0, set(), LocalDecode(LAYOUT)
    sent: list[Any] = []
    tracker._send = lambda message: sent.append(message) or True  # type: ignore[method-assign]
    hashes = [bytes([i]) * 32 for i in range(3)]
    packed = PackedBlockHashes(b"".join(hashes), 32)
    facts = StepFacts(
        weight_version=DEFAULT_WEIGHT_VERSION, generation=0, block_hashes={"a": packed}
    )
    tracker.begin(facts)
    ((kind, sent_facts),) = sent
    assert kind == "begin" and type(sent_facts.block_hashes["a"]).__module__.startswith(
        "vllm_artifact."
    )
    assert list(sent_facts.block_hashes["a"]) == hashes


def decode(process: TrackerProcess, request_id: str, token: int, seq: int, seed: int) -> Any:
    """One decode step of ``request_id`` (one new row at ``token``); its answer."""
    process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0))
    process.step_started([request_id])
    step = Step(seq, [request_id], rows_of(1, seed), token)
    process.queue_step(step)
    return process.step_result(step)


def test_steady_decode_steps_are_answered_by_the_engine_while_the_process_is_stopped(
    process: TrackerProcess,
) -> None:
    prompt = rows_of(6, 20)
    serve(process, "a", prompt, seq=0)  # two prompt steps; the second ends the prompt
    first = decode(process, "a", 6, seq=2, seed=30)  # waited for: the process says steady
    assert first.decode_ids == ["a"] and process.answered_here == 0
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it cannot answer: the engine's own answers come back
    try:
        for k in range(3):
            answer = decode(process, "a", 7 + k, seq=3 + k, seed=31 + k)
            assert answer.decode_ids == ["a"] and answer.decode_token_starts == [7 + k]
            np.testing.assert_array_equal(answer.decode_rows, rows_of(1, 31 + k))
            assert not answer.entries
    finally:
        os.kill(pid, signal.SIGCONT)
    assert process.answered_here == 3
    process.flush(10.0)  # the process's answers to those steps came and agreed
    later = decode(process, "a", 10, seq=6, seed=40)
    assert process.answered_here == 4 and not later.entries
    process.flush(10.0)
    # A step of another shape (two rows) is the process's to answer again.
    process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0))
    process.step_started(["a"])
    two = Step(7, ["a"], rows_of(2, 41), 11)
    process.queue_step(two)
    answer = process.step_result(two)
    assert process.answered_here == 4
    np.testing.assert_array_equal(answer.entries["a"].rows, rows_of(2, 41))
    decode(process, "a", 13, seq=8, seed=42)  # waited for: steady again
    assert process.answered_here == 4
    decode(process, "a", 14, seq=9, seed=43)
    assert process.answered_here == 5
    # Once the scheduler says it ended, a step that ran past its end is the process's again.
    process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0, finished=("a",)))
    process.step_started(["a"])
    past = Step(10, ["a"], rows_of(1, 44), 15)
    process.queue_step(past)
    process.step_result(past)
    assert process.answered_here == 5


def in_steady_decode(process: TrackerProcess, seed: int) -> None:
    """Request "a": a 6-token prompt (steps 0-1), then a decode step (2) the process answers,
    after which it has the request in steady decode."""
    serve(process, "a", rows_of(6, seed), seq=0)
    decode(process, "a", 6, seq=2, seed=seed + 1)


def test_a_request_whose_engine_answer_the_process_contradicts_fails_at_its_next_step(
    process: TrackerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_steady_decode(process, seed=50)
    original = LocalDecode.answer

    def wrong_row(self: LocalDecode, step: Any) -> Any:
        answer = original(self, step)
        if answer is not None:
            answer.decode_rows = answer.decode_rows + 1  # not what the process will say
        return answer

    monkeypatch.setattr(LocalDecode, "answer", wrong_row)
    contradicted = decode(process, "a", 7, seq=3, seed=52)
    assert process.answered_here == 1
    process.flush(10.0)  # the process's answer is checked, if it was not at once
    monkeypatch.setattr(LocalDecode, "answer", original)
    after = decode(process, "a", 8, seq=4, seed=53)
    # The failure comes with the first step returned once the answer was checked: the same
    # step if it came at once, else the next, which then waits for the process's answer.
    reasons = [getattr(a.entries.get("a"), "reason", None) for a in (contradicted, after)]
    assert reasons.count("internal") == 1
    failed = (contradicted, after)[reasons.index("internal")]
    assert "a" not in failed.decode_ids
    assert process.answered_here == 1


def test_a_step_the_engine_cannot_answer_goes_to_the_process(
    process: TrackerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_steady_decode(process, seed=60)

    def broken(self: LocalDecode, step: Any) -> Any:
        raise ValueError("injected")

    monkeypatch.setattr(LocalDecode, "answer", broken)
    answer = decode(process, "a", 7, seq=3, seed=62)
    assert process.answered_here == 0
    assert answer.decode_ids == ["a"] and answer.decode_token_starts == [7]
    np.testing.assert_array_equal(answer.decode_rows, rows_of(1, 62))


def test_after_a_contradiction_the_next_step_waits_for_the_process_even_if_steady(
    process: TrackerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(process, "a", rows_of(6, 70), seq=0)
    serve(process, "b", rows_of(6, 71), seq=2)

    def joint(ids: list[str], token: int, seq: int, seed: int) -> Any:
        process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0))
        process.step_started(ids)
        step = Step(seq, ids, rows_of(len(ids), seed), token)
        process.queue_step(step)
        return process.step_result(step)

    joint(["a", "b"], 6, seq=4, seed=72)  # waited for: both in steady decode from then on
    original = LocalDecode.answer

    def wrong_first_row(self: LocalDecode, step: Any) -> Any:
        answer = original(self, step)
        if answer is not None:
            answer.decode_rows = answer.decode_rows.copy()
            answer.decode_rows[0] += 1  # a's row: not what the process will say
        return answer

    monkeypatch.setattr(LocalDecode, "answer", wrong_first_row)
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # its answer cannot be checked before the step returns
    try:
        joint(["a", "b"], 7, seq=5, seed=73)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert process.answered_here == 1
    process.flush(10.0)  # the answer is checked: a's row differs
    monkeypatch.setattr(LocalDecode, "answer", original)
    after = joint(["b"], 8, seq=6, seed=74)  # b is still steady, yet the process answers
    assert process.answered_here == 1
    assert getattr(after.entries.get("a"), "reason", None) == "internal"
    assert after.decode_ids == ["b"]
    np.testing.assert_array_equal(after.decode_rows, rows_of(1, 74))


def test_the_step_thread_is_not_held_up_while_an_answer_is_waited_for(
    process: TrackerProcess,
) -> None:
    """MRV2's output thread waits in ``process_output`` for the process's answer; meanwhile
    the step thread's ``begin_step`` (inside ``execute_model``, before the forward is queued)
    takes the connector's lock to send the next step's facts. The wait must not hold it."""
    import threading
    import time

    from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector

    worker = object.__new__(ArtifactWorkerConnector)
    worker._lock = threading.Lock()
    worker._process = process
    worker._tracker = None
    worker._keys_context = None
    process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0, admitted={"a": 0}))
    process.step_started(["a"])
    step = Step(0, ["a"], rows_of(MAX_ROWS, 50), 0)
    process.queue_step(step)
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # the answer is late
    answers: list[Any] = []
    waiting = threading.Thread(target=lambda: answers.append(worker.process_output(step)))
    try:
        waiting.start()
        time.sleep(0.3)  # the output thread is waiting for the answer by now
        assert waiting.is_alive() and not answers
        took = worker._lock.acquire(timeout=2.0)  # what begin_step does first
        assert took, "the wait for the answer held the connector's lock"
        try:
            process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0))
        finally:
            worker._lock.release()
    finally:
        os.kill(pid, signal.SIGCONT)
    waiting.join(30.0)
    assert not waiting.is_alive()
    (answer,) = answers
    entry = answer.entries["a"]
    assert isinstance(entry, EmittedRows) and entry.token_start == 0
    np.testing.assert_array_equal(entry.rows, rows_of(MAX_ROWS, 50))
    process.flush(10.0)
