"""The engine's record of the tracker process's steady-decode requests: a step is answered by
the engine only when every request of it is a steady-decode step at the token the process
expects, with the rows the process would return (dense layers marked)."""

from __future__ import annotations

import numpy as np

from vllm_artifact.contract import EmittedRows, R3Failure, StepResult
from vllm_artifact.core.local_decode import LocalDecode
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch

LAYOUT = R3Layout(num_layers=3, top_k=2, num_experts=8, block_size=4, dense_layers=(0,))


def step(ids: list[str], tokens: list[int], rows_each: int = 1, sampled: bool = True) -> StepBatch:
    n = len(ids)
    starts = np.arange(n) * rows_each
    rows = np.arange(n * rows_each * 6, dtype=np.uint8).reshape(n * rows_each, 3, 2) % 8
    return StepBatch(
        request_ids=ids,
        token_starts=np.array(tokens, np.int32),
        num_scheduled=np.full(n, rows_each),
        row_starts=starts,
        row_ends=starts + rows_each,
        sampled=np.full(n, sampled),
        rows=rows,
    )


def steady_answer(ids: list[str], tokens: list[int]) -> StepResult:
    return StepResult(
        decode_ids=ids,
        decode_token_starts=tokens,
        decode_rows=np.zeros((len(ids), 3, 2), np.uint8),
    )


def test_a_step_of_steady_requests_at_the_expected_tokens_is_answered_and_advances() -> None:
    local = LocalDecode(LAYOUT)
    assert local.answer(step(["a"], [5])) is None  # nothing learnt yet
    local.learn(steady_answer(["a", "b"], [4, 9]))
    batch = step(["b", "a"], [10, 5])
    answer = local.answer(batch)
    assert answer is not None
    assert answer.decode_ids == ["b", "a"] and answer.decode_token_starts == [10, 5]
    want = batch.rows.copy()
    want[:, 0] = LAYOUT.dense_mark
    np.testing.assert_array_equal(answer.decode_rows, want)
    assert answer.decode_rows is not None and not np.shares_memory(answer.decode_rows, batch.rows)
    assert local.answer(step(["a"], [6])) is not None  # advanced by the engine's own answer
    assert local.answer(step(["a"], [6])) is None  # a token behind: not what the process has


def test_any_request_not_a_steady_decode_step_leaves_the_step_to_the_process() -> None:
    local = LocalDecode(LAYOUT)
    local.learn(steady_answer(["a", "b"], [4, 9]))
    assert local.answer(step(["a", "c"], [5, 0])) is None  # c unknown
    assert local.answer(step(["a", "b"], [5, 11])) is None  # b at another token
    assert local.answer(step(["a"], [5], rows_each=2)) is None  # two rows (drafts)
    assert local.answer(step(["a"], [5], sampled=False)) is None
    local.forget(["b"])
    assert local.answer(step(["b"], [10])) is None
    local.learn(StepResult(entries={"a": EmittedRows(5, np.zeros((1, 3, 2), np.uint8))}))
    assert local.answer(step(["a"], [5])) is None and len(local) == 0


def test_disagreements_name_every_request_answered_otherwise() -> None:
    mine = steady_answer(["a", "b", "c"], [4, 9, 2])
    assert LocalDecode.disagreements(mine, steady_answer(["a", "b", "c"], [4, 9, 2])) == []
    theirs = steady_answer(["a", "c"], [4, 3])
    theirs.entries["b"] = R3Failure("internal", "x")
    assert sorted(LocalDecode.disagreements(mine, theirs)) == ["b", "c"]
    other_rows = steady_answer(["a", "b", "c"], [4, 9, 2])
    assert other_rows.decode_rows is not None
    other_rows.decode_rows[1] += 1
    assert LocalDecode.disagreements(mine, other_rows) == ["b"]
