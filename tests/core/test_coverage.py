"""Request coverage planning and materialization through a real store."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_artifact.core import (
    Namespace,
    R3Layout,
    RequestCoverage,
    RequestRowBuffer,
    full_block_items,
    full_block_keys,
    materialize,
    tail_block_key,
)
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import CoverageError, ObjectCorruptError, ObjectMissingError

from .conftest import rows_for


def test_plan_full_blocks_and_tail(namespace: Namespace) -> None:
    keys = full_block_keys(namespace, [bytes([i]) for i in range(4)])
    tail = tail_block_key(namespace, b"tail", 5)
    cov = RequestCoverage.plan(num_rows=37, block_size=16, full_block_keys=keys, tail_key=tail)
    assert cov.keys == (*keys[:2], tail)
    assert cov.spans() == [(keys[0], 0, 16), (keys[1], 16, 16), (tail, 32, 5)]
    aligned = RequestCoverage.plan(num_rows=32, block_size=16, full_block_keys=keys, tail_key=None)
    assert aligned.keys == tuple(keys[:2]) and aligned.tail_rows == 0
    empty = RequestCoverage.plan(num_rows=0, block_size=16, full_block_keys=[], tail_key=None)
    assert empty.keys == ()


def test_plan_rejects_inconsistent_input(namespace: Namespace) -> None:
    keys = full_block_keys(namespace, [b"a", b"b"])
    tail = tail_block_key(namespace, b"t", 3)
    with pytest.raises(CoverageError, match="full-block keys"):
        RequestCoverage.plan(num_rows=48, block_size=16, full_block_keys=keys, tail_key=None)
    with pytest.raises(CoverageError, match="no tail key"):
        RequestCoverage.plan(num_rows=20, block_size=16, full_block_keys=keys, tail_key=None)
    with pytest.raises(CoverageError, match="no tail key expected"):
        RequestCoverage.plan(num_rows=16, block_size=16, full_block_keys=keys, tail_key=tail)


def test_buffer_to_store_to_materialize(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    """The whole data flow: capture rows -> buffer -> publish -> keys -> materialize."""
    total = 16 * 5 + 7
    want = np.concatenate([rows_for(layout, i, 1) for i in range(total)])
    hashes = [i.to_bytes(8, "little") for i in range(total // 16)]
    keys = full_block_keys(namespace, hashes)
    buf = RequestRowBuffer(layout, max_bytes=1 << 20)
    with ShmStore.create_or_open_writer(
        shm_root, "s", layout=layout, capacity_bytes=1 << 20
    ) as store:
        for lo in range(0, total, 10):  # steps of 10 tokens
            full = buf.append("req", lo, want[lo : lo + 10])
            if full.num_blocks:
                blk = keys[full.first_block : full.first_block + full.num_blocks]
                store.put(full_block_items(blk, full.first_block, full.rows, 16))
        tail = buf.take_tail("req")
        tail_key = tail_block_key(namespace, b"tail-hash", len(tail.rows))
        store.put([(tail_key, tail.rows, tail.token_start)])
        cov = RequestCoverage.plan(
            num_rows=total, block_size=16, full_block_keys=keys, tail_key=tail_key
        )
        np.testing.assert_array_equal(materialize(store, cov), want)

        # Fail closed: wrong tail length, wrong order, unknown key.
        short = RequestCoverage(num_rows=total - 1, block_size=16, keys=cov.keys, tail_rows=6)
        with pytest.raises(ObjectCorruptError, match="tokens"):
            materialize(store, short)
        swapped = RequestCoverage(
            num_rows=total, block_size=16, keys=(keys[1], keys[0], *cov.keys[2:]), tail_rows=7
        )
        with pytest.raises(ObjectCorruptError, match="token range"):
            materialize(store, swapped)
        other = full_block_keys(namespace, [b"never published"])
        missing = RequestCoverage.plan(
            num_rows=16, block_size=16, full_block_keys=other, tail_key=None
        )
        with pytest.raises(ObjectMissingError, match="--artifact-capacity"):
            materialize(store, missing)
        wrong_bs = RequestCoverage.plan(
            num_rows=32, block_size=32, full_block_keys=keys, tail_key=None
        )
        with pytest.raises(CoverageError, match="block size"):
            materialize(store, wrong_bs)


def test_full_block_items_checks_length(namespace: Namespace, layout: R3Layout) -> None:
    keys = full_block_keys(namespace, [b"a", b"b"])
    with pytest.raises(CoverageError):
        full_block_items(keys, 0, layout.empty(31), 16)
    items = full_block_items(keys, 3, layout.empty(32), 16)
    assert [i.token_start for i in items] == [48, 64]
