"""Rows held in the engine until a request's end come back whole, in token order and as copies,
whichever way they were written; a token without a row is an error; the pool gives memory back."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_artifact.core.held_rows import PAGE_ROWS, HeldRows
from vllm_artifact.core.row_pages import MIN_PAGES
from vllm_artifact.errors import InternalError

ROW_SHAPE = (3, 2)


def row_of(request: int, token: int) -> np.ndarray:
    """A distinct row per request and token."""
    return np.full((1, *ROW_SHAPE), (7 * request + token) % 65521, np.uint16)


def rows_of(request: int, first: int, end: int) -> np.ndarray:
    return np.concatenate([row_of(request, t) for t in range(first, end)])


def test_a_request_whose_first_rows_covered_everything_gets_none() -> None:
    held = HeldRows()
    held.hold("a", 5)
    assert held.take("a", 5) is None
    assert "a" not in held and len(held) == 0


def test_decode_steps_and_multi_row_steps_come_back_in_token_order() -> None:
    """Eight requests, three of them held from different tokens; decode steps (one row each,
    written together) mixed with steps of several rows (speculative decoding) over many
    pages, with requests not held in the same steps."""
    held = HeldRows()
    firsts = {1: 10, 4: 3, 6: 40}
    for request, first in firsts.items():
        held.hold(f"r{request}", first)
    next_token = dict.fromkeys(range(8), 0) | firsts
    for step in range(5 * PAGE_ROWS + 3):
        if step % 9 == 4:  # request 4 accepts drafts: three rows of its own
            token = next_token[4]
            held.add("r4", token, rows_of(4, token, token + 3))
            next_token[4] += 3
        ids = [f"r{r}" for r in range(8) if not (step % 9 == 4 and r == 4)]
        requests = [int(rid[1:]) for rid in ids]
        tokens = [next_token[r] for r in requests]
        step_rows = np.concatenate([row_of(r, t) for r, t in zip(requests, tokens, strict=True)])
        mask = held.record_step(ids, tokens, step_rows)
        assert mask is not None
        assert [rid for rid, was in zip(ids, mask, strict=True) if was] == [
            rid for rid in ids if int(rid[1:]) in firsts
        ]
        for r in requests:
            next_token[r] += 1
    for request, first in firsts.items():
        got = held.take(f"r{request}", next_token[request])
        assert got is not None
        np.testing.assert_array_equal(got, rows_of(request, first, next_token[request]))
    assert len(held) == 0 and held.pages.in_use == 0


def test_a_step_without_held_requests_is_left_alone() -> None:
    held = HeldRows()
    assert held.record_step(["a"], [0], row_of(0, 0)) is None  # nothing held at all
    held.hold("b", 0)
    assert held.record_step(["a", "c"], [0, 0], rows_of(0, 0, 2)) is None
    assert held.pages.in_use == 0


def test_held_rows_are_copies_of_the_step_arrays() -> None:
    held = HeldRows()
    held.hold("a", 0)
    steps = [np.concatenate([row_of(9, t), row_of(0, t)]) for t in range(PAGE_ROWS + 2)]
    for token, step_rows in enumerate(steps):
        held.record_step(["other", "a"], [token, token], step_rows)
        step_rows[:] = 0  # the engine reuses its buffers: what was held must not change
    got = held.take("a", len(steps))
    assert got is not None
    np.testing.assert_array_equal(got, rows_of(0, 0, len(steps)))
    assert not any(np.shares_memory(got, step_rows) for step_rows in steps)


def test_a_later_row_of_a_token_replaces_the_earlier_and_rows_past_the_end_are_dropped() -> None:
    """Rows are written when a step arrives, before vLLM has looked at the request: a step
    that ran ahead (a token the request never kept) and a token recomputed after preemption."""
    held = HeldRows()
    held.hold("a", 0)
    for token in range(4):
        held.record_step(["a"], [token], row_of(0, token))
    held.record_step(["a"], [4], np.full((1, *ROW_SHAPE), 999, np.uint16))  # ran ahead
    held.add("a", 3, rows_of(0, 3, 6))  # recomputed from token 3 after preemption
    held.record_step(["a"], [6], row_of(0, 6))  # past the end vLLM reports
    got = held.take("a", 6)
    assert got is not None
    np.testing.assert_array_equal(got, rows_of(0, 0, 6))


def test_a_token_without_a_row_is_an_error_not_a_shorter_answer() -> None:
    held = HeldRows()
    held.hold("a", 0)
    held.hold("b", 0)
    for token in (0, 1, 3):  # token 2's row never came
        held.record_step(["a", "b"], [token, token], rows_of(0, 0, 2))
    with pytest.raises(InternalError, match=r"cover 3 of its tokens 0\.\.3"):
        held.take("a", 4)
    with pytest.raises(InternalError, match=r"cover 0 of its tokens 5\.\.5"):
        held.hold("c", 5)
        held.take("c", 6)
    assert "a" not in held and "c" not in held  # forgotten either way
    got = held.take("b", 2)  # the other requests are unaffected
    assert got is not None and len(got) == 2


def test_rows_of_another_shape_are_refused() -> None:
    held = HeldRows()
    held.hold("a", 0)
    held.add("a", 0, rows_of(0, 0, 2))
    with pytest.raises(InternalError, match="changed shape"):
        held.add("a", 2, np.zeros((1, 4, 2), np.uint16))
    with pytest.raises(InternalError, match="changed shape"):
        held.record_step(["a"], [2], np.zeros((1, *ROW_SHAPE), np.uint8))


def test_the_pool_grows_keeping_rows_and_is_compacted_when_few_are_held() -> None:
    """256 requests of two pages each make the pool grow several times; once few rows have
    been held for a while it is compacted, and the rows still held come back whole from their
    new pages."""
    held = HeldRows()
    requests = 256
    ids = [f"r{r}" for r in range(requests)]
    for rid in ids:
        held.hold(rid, 0)
    for token in range(2 * PAGE_ROWS):
        step_rows = np.concatenate([row_of(r, token) for r in range(requests)])
        held.record_step(ids, [token] * requests, step_rows)
    assert held.pages.in_use == 2 * requests and held.pages.capacity == 8 * MIN_PAGES
    got = held.take(ids[100], 2 * PAGE_ROWS)
    assert got is not None
    np.testing.assert_array_equal(got, rows_of(100, 0, 2 * PAGE_ROWS))
    held.add(ids[255], 2 * PAGE_ROWS, rows_of(255, 2 * PAGE_ROWS, 2 * PAGE_ROWS + 3))
    for rid in ids[1:255]:
        if rid != ids[100]:
            held.discard(rid)
    assert held.pages.in_use == 5 and held.pages.capacity == 8 * MIN_PAGES  # not yet
    turns = 0
    while held.pages.capacity > MIN_PAGES and turns < 4 * MIN_PAGES:
        turns += 1  # short requests come and go: the load stays low
        held.hold("short", 0)
        held.add("short", 0, rows_of(9, 0, 2))
        got = held.take("short", 2)
        assert got is not None
        np.testing.assert_array_equal(got, rows_of(9, 0, 2))
    assert 2 * MIN_PAGES <= turns < 4 * MIN_PAGES, turns  # half the pool's size released
    assert held.pages.in_use == 5 and held.pages.capacity == MIN_PAGES
    # Two more rows into the partly written page, which moved.
    held.record_step([ids[255]], [2 * PAGE_ROWS + 3], row_of(255, 2 * PAGE_ROWS + 3))
    held.add(ids[255], 2 * PAGE_ROWS + 4, row_of(255, 2 * PAGE_ROWS + 4))
    for request, end in ((0, 2 * PAGE_ROWS), (255, 2 * PAGE_ROWS + 5)):
        got = held.take(ids[request], end)
        assert got is not None
        np.testing.assert_array_equal(got, rows_of(request, 0, end))
    assert held.pages.in_use == 0


def test_a_batch_that_ends_and_the_next_of_its_size_keep_the_pool_as_it_is() -> None:
    """An RL rollout's batches: the pool grown for one is neither compacted when it ends nor
    grown again, by copies, for the next one of the same size."""
    held = HeldRows()
    requests = 256
    capacities = []
    for batch in range(3):
        ids = [f"b{batch}-{r}" for r in range(requests)]
        for rid in ids:
            held.hold(rid, 0)
        for token in range(2 * PAGE_ROWS):
            step_rows = np.concatenate([row_of(r + batch, token) for r in range(requests)])
            held.record_step(ids, [token] * requests, step_rows)
        capacities.append(held.pages.capacity)
        for r, rid in enumerate(ids):
            got = held.take(rid, 2 * PAGE_ROWS)
            assert got is not None
            np.testing.assert_array_equal(got, rows_of(r + batch, 0, 2 * PAGE_ROWS))
        capacities.append(held.pages.capacity)
    assert held.pages.in_use == 0
    assert capacities == [2 * requests] * 6


def test_holding_a_request_again_keeps_its_rows() -> None:
    """vLLM schedules a preempted request again as a new one; its rows so far stay."""
    held = HeldRows()
    held.hold("a", 2)
    held.add("a", 2, rows_of(0, 2, 4))
    held.hold("a", 4)
    got = held.take("a", 4)
    assert got is not None
    np.testing.assert_array_equal(got, rows_of(0, 2, 4))
