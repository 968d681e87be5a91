"""What the GPU harness does in a configuration's frontend (the worker's own process): the
``+nojoin`` variant and the count of R3 arrays by how the frontend assembled them."""

from __future__ import annotations

from typing import Any

import numpy as np


def no_frontend_join() -> str:
    """``+nojoin``: R3's chunks are only listed, never copied, and a request's first chunk (a
    view of the frame it arrived in) is its answer (R3 wrong by design)."""
    from vllm_artifact.core.row_assembly import ArrivingRows

    def first_chunk(rows: Any) -> Any:
        return rows[0] if len(rows) and isinstance(rows[0], np.ndarray) else None

    ArrivingRows._copy = lambda rows, chunk: None  # type: ignore[method-assign]
    ArrivingRows.joined = first_chunk  # type: ignore[method-assign]
    return "frontend: no join, first chunk only"


def frontend_files() -> dict[str, int]:
    """This process's R3 arrays so far, by how it assembled them
    (``vllm_artifact_frontend_files_total``: adopted as sent, copied, concatenated)."""
    from prometheus_client import REGISTRY

    name = "vllm_artifact_frontend_files_total"
    return {
        f"files_{how}": int(REGISTRY.get_sample_value(name, {"how": how}) or 0)
        for how in ("adopted", "copied", "concatenated")
    }
