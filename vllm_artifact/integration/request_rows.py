"""Which of a step's rows a request returns, by vLLM's rules (the scheduler connector's side).

Pure functions of vLLM's ``Request`` attributes, kept apart from the connector's state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_artifact.errors import InternalError

__all__ = ["emit_start", "executed_rows"]


def emit_start(request: Any) -> int:
    """First token whose row the request returns (vLLM's rule: the prompt start the sampling
    params ask for, or the last token of a request resumed after preemption)."""
    prompt_start = min(
        request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens
    )
    return max(prompt_start, 0 if request.num_output_tokens == 0 else request.num_tokens - 1)


def executed_rows(request: Any, token_start: int, rows: np.ndarray) -> np.ndarray | None:
    """``rows`` (from ``token_start``) up to the request's last executed token: usually all
    of them; fewer where drafts past it were rejected after the worker ran, or the step ran
    ahead of the scheduler's view; None if none is executed yet."""
    local_end = request.num_tokens - 1 - token_start
    if local_end == len(rows):
        return rows
    if local_end < 0:
        if request.is_finished():
            raise InternalError(
                f"finished request {request.request_id} has no R3 rows for its last token "
                f"(rows start at {token_start})"
            )
        return None
    if local_end > len(rows):
        raise InternalError(
            f"request {request.request_id}: the worker sent rows up to token "
            f"{token_start + len(rows)}, the scheduler expects {request.num_tokens - 1}"
        )
    return rows[:local_end]
