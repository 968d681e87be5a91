"""Which store an engine writes: one per model, R3 layout and DP rank, reused across restarts.

The store's name (``r3-<digest of model and layout>-dp<rank>``) is the same for every start of
the same engine, so a restarted engine takes its predecessor's store over and its objects stay
readable. A second live engine of the same model on the same root cannot share a store (one
writer each); it takes the first of ``<name>-2``, ``<name>-3``, ... whose writer is gone, so a
restarted second engine also takes its own predecessor's (or any dead sibling's) store over
instead of leaving a new full-capacity arena behind on every start.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import WriterConflictError

logger = logging.getLogger("vllm.artifact.worker")

#: Live engines of one model and DP rank that may share a root.
MAX_ENGINES_PER_ROOT = 16


def store_names(base: str) -> list[str]:
    """The names an engine tries, in order."""
    return [base, *(f"{base}-{i}" for i in range(2, MAX_ENGINES_PER_ROOT + 1))]


def open_engine_store(
    root: Path | str, base: str, *, layout: R3Layout, capacity_bytes: int, ttl_seconds: float
) -> ShmStore:
    """Open the first store of :func:`store_names` that has no live writer."""
    for name in store_names(base):
        try:
            return ShmStore.create_or_open_writer(
                root, name, layout=layout, capacity_bytes=capacity_bytes, ttl_seconds=ttl_seconds
            )
        except WriterConflictError:
            logger.info("vllm-artifact: store %s has a live writer; trying the next name", name)
    raise WriterConflictError(
        f"{MAX_ENGINES_PER_ROOT} live engines of this model already write stores named {base} "
        f"under {root}; give this engine its own --artifact-root"
    )
