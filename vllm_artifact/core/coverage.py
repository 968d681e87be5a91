"""Request coverage: which objects make up a request's R3, and materialization.

A request's R3 covers rows ``[0, num_rows)`` (every token that went through a
target-model forward pass). It is tiled by the full KV blocks' objects, in
block order, plus at most one terminal partial-block ("tail") object. The
plan is pure data (picklable, no store handle), so it can be built where the
block hashes are known and materialized where the store is.

Materialization returns the whole array or raises a typed error: there is no
partial, zero-filled or recomputed result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_artifact.core.keys import ObjectKey
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.contract import ObjectStore, PutItem
from vllm_artifact.errors import CoverageError

__all__ = ["RequestCoverage", "full_block_items", "materialize"]


@dataclass(frozen=True)
class RequestCoverage:
    """Ordered objects tiling rows ``[0, num_rows)`` of one request."""

    num_rows: int
    block_size: int
    keys: tuple[ObjectKey, ...]
    tail_rows: int

    @classmethod
    def plan(
        cls,
        *,
        num_rows: int,
        block_size: int,
        full_block_keys: Sequence[ObjectKey],
        tail_key: ObjectKey | None,
    ) -> RequestCoverage:
        """Plan coverage of ``num_rows`` rows.

        ``full_block_keys`` are the keys of the request's KV blocks in order
        (extra trailing keys are ignored: the block holding the last, never
        executed token can be full in the KV cache while its R3 is a tail).
        ``tail_key`` is required exactly when ``num_rows`` is not a multiple
        of ``block_size``.
        """
        if num_rows < 0 or block_size < 1:
            raise CoverageError(f"bad coverage request: rows={num_rows}, block={block_size}")
        n_full, tail = divmod(num_rows, block_size)
        if len(full_block_keys) < n_full:
            raise CoverageError(
                f"{num_rows} rows need {n_full} full-block keys, got {len(full_block_keys)}; "
                "the request's block hashes do not reach its last executed token"
            )
        keys = tuple(full_block_keys[:n_full])
        if tail:
            if tail_key is None:
                raise CoverageError(f"{num_rows} rows end in a {tail}-row tail but no tail key")
            keys += (tail_key,)
        elif tail_key is not None:
            raise CoverageError(f"{num_rows} rows end on a block boundary; no tail key expected")
        return cls(num_rows=num_rows, block_size=block_size, keys=keys, tail_rows=tail)

    def spans(self) -> list[tuple[ObjectKey, int, int]]:
        """``(key, token_start, n_tokens)`` of each object, in order."""
        bs = self.block_size
        out = []
        for i, key in enumerate(self.keys):
            last = i == len(self.keys) - 1 and self.tail_rows
            out.append((key, i * bs, self.tail_rows if last else bs))
        return out


def materialize(
    store: ObjectStore, coverage: RequestCoverage, *, out: np.ndarray | None = None
) -> np.ndarray:
    """Gather the request's rows ``[num_rows, layers, top_k]`` from ``store``.

    Every object's envelope (token range, counts, layout) and checksum is
    verified; any missing or corrupt object raises (fail closed).
    """
    layout: R3Layout = store.layout
    if layout.block_size != coverage.block_size:
        raise CoverageError(
            f"coverage uses block size {coverage.block_size}, store {layout.block_size}"
        )
    if out is None:
        out = layout.empty(coverage.num_rows)
    elif out.shape[0] != coverage.num_rows:
        raise CoverageError(f"out has {out.shape[0]} rows, coverage {coverage.num_rows}")
    store.read_into(coverage.keys, out, token_start=0)
    return out


def full_block_items(
    keys: Sequence[ObjectKey], first_block: int, rows: np.ndarray, block_size: int
) -> list[PutItem]:
    """Split rows of consecutive full blocks into put items (views, no copy).

    ``keys[i]`` is the key of block ``first_block + i``; ``rows`` holds
    ``len(keys) * block_size`` rows (as returned by
    :meth:`RequestRowBuffer.append`).
    """
    if len(rows) != len(keys) * block_size:
        raise CoverageError(f"{len(rows)} rows are not {len(keys)} blocks of {block_size}")
    return [
        PutItem(key, rows[i * block_size : (i + 1) * block_size], (first_block + i) * block_size)
        for i, key in enumerate(keys)
    ]
