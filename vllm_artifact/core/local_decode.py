"""Steady-decode steps answered by the engine while the tracker process catches up.

With ``--artifact-tracker process`` a CUDA-graph decode step's rows land only when the engine
asks for the step's answer, which then waited for the process to take the step in and answer
(about a millisecond a step). But a step whose every request is in steady decode
(:mod:`~vllm_artifact.core.steady_decode`) has a foregone answer: each request's one new row,
column-wise. The tracker never fails such a request, and it takes a request out of steady
decode only at a step of another shape, at its end (finished, aborted, preempted), at a
prefix-cache reset or when a new process takes over. So the engine keeps its own record of
which requests the process has in steady decode and at which token (:class:`LocalDecode`),
learnt from the answers it waited for and advanced by the steps it answered itself, and forgets
a request on any of those events. A step of only such requests is answered at once from its own
rows; the process still gets the step (it buffers and publishes its rows) and its answer,
taken later, is checked against the engine's: a request where they disagree fails at its next
step, never silently.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from vllm_artifact.contract import StepResult
from vllm_artifact.core.buffer import gather_rows
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch

__all__ = ["LocalDecode"]


class LocalDecode:
    """Request id -> the token its next steady-decode step starts at, as the tracker process
    has it (not thread-safe: the tracker process's engine end serializes calls)."""

    def __init__(self, layout: R3Layout) -> None:
        self._layout = layout
        self._next: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._next)

    def learn(self, answer: StepResult) -> None:
        """An answer the engine waited for: its decode columns are in steady decode, every
        other request it names is not."""
        self.forget(answer.entries)
        for request_id, token in zip(answer.decode_ids, answer.decode_token_starts, strict=True):
            self._next[request_id] = token + 1

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests admitted again (a resumed preemption) or ended."""
        for request_id in request_ids:
            self._next.pop(request_id, None)

    def clear(self) -> None:
        """Every request (a prefix-cache reset, a new tracker process)."""
        self._next.clear()

    def answer(self, step: StepBatch) -> StepResult | None:
        """The answer to ``step`` if every request of it is a steady-decode step (its rows
        copied and dense-marked, as the process would), else None."""
        ids, following = step.request_ids, self._next
        if not ids or len(ids) > len(following):
            return None
        try:
            expected = np.fromiter((following[i] for i in ids), np.int64, len(ids))
        except KeyError:  # a request the process does not have in steady decode
            return None
        steady = (
            (expected == step.token_starts)
            & (step.row_ends - step.row_starts == 1)
            & (step.num_scheduled == 1)
            & step.sampled
        )
        if not steady.all():
            return None
        rows = gather_rows(step.rows, step.row_starts)  # a copy: does not pin the step
        self._layout.mark_dense(rows)
        tokens = expected.tolist()
        following.update(zip(ids, (token + 1 for token in tokens), strict=True))
        return StepResult(decode_ids=list(ids), decode_token_starts=tokens, decode_rows=rows)

    @staticmethod
    def disagreements(mine: StepResult, theirs: StepResult) -> list[str]:
        """The requests of a step answered by the engine (``mine``) whose answer from the
        process (``theirs``) differs: not the same row at the same token."""
        if (
            not theirs.entries
            and theirs.decode_ids == mine.decode_ids
            and theirs.decode_token_starts == mine.decode_token_starts
            and theirs.decode_rows is not None
            and mine.decode_rows is not None
            and np.array_equal(theirs.decode_rows, mine.decode_rows)
        ):
            return []  # a few C-level comparisons: every decode step of the engine's takes them
        rows = theirs.rows_by_id()
        mine_rows = mine.decode_rows if mine.decode_rows is not None else ()
        differ = [
            request_id
            for request_id, token, row in zip(
                mine.decode_ids, mine.decode_token_starts, mine_rows, strict=True
            )
            if (found := rows.get(request_id)) is None
            or found[0] != token
            or not np.array_equal(found[1], row[None])
        ]
        return differ + [i for i in theirs.entries if i not in rows and i not in differ]
