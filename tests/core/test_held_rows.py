"""Rows held in the engine until a request's end come back whole and in order, without
keeping more than a bounded number of step arrays alive."""

from __future__ import annotations

import numpy as np

from vllm_artifact.core.held_rows import JOIN_EVERY, HeldRows


def _step_array(step: int, requests: int = 4) -> np.ndarray:
    """One step's rows of every request (distinct values per step and request)."""
    values = np.arange(requests * 6, dtype=np.int32).reshape(requests, 3, 2) + 1000 * step
    return values.astype(np.uint16)


def test_nothing_held_is_none() -> None:
    assert HeldRows().take() is None


def test_rows_come_back_in_order_across_joins_and_chunk_sizes() -> None:
    held = HeldRows()
    prompt = np.arange(5 * 6, dtype=np.uint16).reshape(5, 3, 2)
    held.add(prompt)
    expected = [prompt.copy()]
    for step in range(1, 300):  # many joins and a remainder
        count = 3 if step % 10 == 0 else 1  # speculative steps with accepted drafts
        rows = _step_array(step, requests=8)[2 : 2 + count]  # a view of the step's array
        held.add(rows)
        expected.append(rows.copy())
    got = held.take()
    assert got is not None
    np.testing.assert_array_equal(got, np.concatenate(expected))
    assert held.take() is None


def test_a_single_chunk_comes_back_as_it_is() -> None:
    held = HeldRows()
    rows = np.ones((3, 3, 2), np.uint8)
    held.add(rows)
    assert held.take() is rows


def test_a_long_first_chunk_and_an_empty_step() -> None:
    held = HeldRows()
    prompt = np.ones((1000, 3, 2), np.uint8)
    held.add(prompt)
    held.add(prompt[:0])
    held.add(np.full((1, 3, 2), 7, np.uint8))
    got = held.take()
    assert got is not None and got.shape == (1001, 3, 2) and got[-1, 0, 0] == 7


def test_step_arrays_are_not_kept_past_a_join() -> None:
    """A long request among many short ones would otherwise keep every step's array."""
    held = HeldRows()
    steps = [_step_array(step) for step in range(3 * JOIN_EVERY + 2)]
    for array in steps:
        held.add(array[1:2])
    parts = held._joined + held._recent
    assert all(part.base is None for part in held._joined)  # the request's own rows
    assert len(held._joined) == 3 and len(held._recent) == 2  # three joins, two newest views
    for index, array in enumerate(steps[: 3 * JOIN_EVERY]):
        assert not any(np.shares_memory(part, array) for part in parts), index
    got = held.take()
    assert got is not None
    np.testing.assert_array_equal(got, np.concatenate([array[1:2] for array in steps]))
