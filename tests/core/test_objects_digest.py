"""The objects digest of a keys handle (``objects_xxh3``): made by the engine from a request's
rows as the store checksums them, checked by the frontend from the objects' envelopes alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vllm_artifact_testing.store_faults import flip_in_every_slot

from vllm_artifact.client import R3Keys, R3Reader
from vllm_artifact.core import Namespace, R3Layout, full_block_keys, tail_block_key
from vllm_artifact.core.envelope import HeaderWords
from vllm_artifact.core.handoff import StoreAddress
from vllm_artifact.core.keys import keys_to_words
from vllm_artifact.core.objects_digest import ObjectsDigest, digest_of_checksums, objects_digest
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import (
    InternalError,
    KeyCollisionError,
    ObjectCorruptError,
    ObjectMissingError,
)

from .conftest import SMALL, rows_for

NS = Namespace("test-model", SMALL, "v1")
BS = SMALL.block_size


def _request(n_full: int, tail: int, first_block: int = 0) -> tuple[list, list, np.ndarray]:
    """A request's full-block keys from block 0, its objects' keys from ``first_block`` (the
    tail last) and its rows from that block on."""
    block_keys = full_block_keys(NS, [i.to_bytes(32, "little") for i in range(n_full)])
    objects = block_keys[first_block:]
    if tail:
        objects = [*objects, tail_block_key(NS, b"tail-hash", tail)]
    return block_keys, objects, rows_for(SMALL, 3, (n_full - first_block) * BS + tail)


def _handle(store: ShmStore, objects: list, rows: np.ndarray, first_block: int = 0) -> R3Keys:
    start = first_block * BS
    return R3Keys.of(
        store=StoreAddress(root=store.root, name=store.name),
        layout=SMALL.canonical(),
        block_size=BS,
        token_start=start,
        first_row=start,
        num_rows=len(rows),
        keys=objects,
        last_block_tokens=len(rows) - (len(objects) - 1) * BS,
        objects_xxh3=objects_digest(SMALL, objects, start, rows),
    )


def test_a_digest_fed_step_by_step_equals_the_one_of_the_stores_envelopes(
    store: ShmStore,
) -> None:
    """Rows arrive in steps of any size, block keys sometimes a step after their rows (they
    wait), the tail's key at the end; the digest is that of the checksums the store wrote."""
    block_keys, objects, rows = _request(n_full=5, tail=7, first_block=1)
    store.put_blocks(objects, rows, BS)
    known = block_keys[:1]  # the list the scheduler extends as the KV cache hashes blocks
    digest = ObjectsDigest(SMALL, BS, known)
    digest.add(rows[: 2 * BS + 3])  # the prompt's rows: blocks 1 and 2 wait for their keys
    known += block_keys[1:2]  # block 1's comes, block 2's not yet
    digest.add(rows[2 * BS + 3 : 2 * BS + 5])
    known += block_keys[2:4]
    for at in range(2 * BS + 5, len(rows)):  # then one row a step
        digest.add(rows[at : at + 1])
        if at == 3 * BS:
            known += block_keys[4:]
    assert digest.rows == len(rows)
    stored = store.envelope_checksums(objects)
    assert stored is not None
    assert digest.finish(objects[-1]) == digest_of_checksums(stored)
    assert objects_digest(SMALL, objects, BS, rows) == digest_of_checksums(stored)
    out = SMALL.empty(len(rows))  # a read returns the checksums it verified: the same
    assert store.read_into(objects, out, token_start=BS).tolist() == stored


def test_one_objects_seed_in_python_integers_equals_the_vectorized_seeds() -> None:
    words = HeaderWords(SMALL)
    keys = full_block_keys(NS, [b"x", b"y", b"z"])
    starts, counts = np.array([0, 16, 2**40]), np.array([16, 16, 5])
    want = words.seeds_for(keys_to_words(keys), starts, counts)
    got = [words.seed_of(k, int(s), int(c)) for k, s, c in zip(keys, starts, counts, strict=True)]
    assert got == want


def test_other_rows_or_another_token_range_give_another_digest() -> None:
    _, objects, rows = _request(n_full=3, tail=2)
    other = rows.copy()
    other[2 * BS + 1, 1, 0] ^= 1  # one expert id in the tail
    want = objects_digest(SMALL, objects, 0, rows)
    assert objects_digest(SMALL, objects, 0, other) != want
    assert objects_digest(SMALL, objects, BS, rows) != want  # the seed binds the range
    assert objects_digest(SMALL, objects[::-1], 0, rows) != want  # ... and the keys


def test_rows_that_do_not_fill_the_objects_are_an_internal_error() -> None:
    block_keys, objects, rows = _request(n_full=2, tail=3)
    no_tail = ObjectsDigest(SMALL, 0, list(block_keys))
    no_tail.add(rows)
    with pytest.raises(InternalError, match="no tail key"):
        no_tail.finish(None)  # three rows left over, and no key for them
    short = ObjectsDigest(SMALL, 0, list(block_keys))
    short.add(rows[: 2 * BS])
    with pytest.raises(InternalError, match="a tail key"):
        short.finish(objects[-1])  # a tail key, and no rows for it
    with pytest.raises(InternalError, match="block boundary"):
        ObjectsDigest(SMALL, 3, [])


def test_a_handle_is_checked_from_its_objects_envelopes(store: ShmStore) -> None:
    """Published with the request's rows: resolved; not all published: not yet; another
    request's routing under its keys: refused (and a read says why); a payload damaged
    since publication passes the envelopes but no read hands it out."""
    _, objects, rows = _request(n_full=3, tail=5)
    own = _handle(store, objects, rows)
    with R3Reader(timeout=0.05) as reader:
        assert reader.envelopes_match(own) is None  # nothing published yet
        with pytest.raises(ObjectMissingError, match="read handles promptly"):
            reader.verify(own)
        store.put_blocks(objects[:-1], rows[: 3 * BS], 0)
        assert reader.envelopes_match(own) is None  # the tail comes a step later
        store.put_blocks(objects[-1:], rows[3 * BS :], 3 * BS)
        assert reader.envelopes_match(own) is True
        reader.verify(own)
        np.testing.assert_array_equal(reader.read(own).experts, rows)

        theirs = rows.copy()
        theirs[BS + 2, 0, 1] ^= 1  # this request's routing differs in block 1
        mine = _handle(store, objects, theirs)
        assert reader.envelopes_match(mine) is False
        with pytest.raises(KeyCollisionError, match="other routing"):
            reader.verify(mine)
        with pytest.raises(KeyCollisionError, match="other routing"):
            reader.read(mine)

        flip_in_every_slot(Path(store.root), where="payload")
        assert reader.envelopes_match(own) is True  # no payload was read
        with pytest.raises(ObjectCorruptError):
            reader.read(own)


def test_uint16_rows_one_a_step_give_the_digest_of_the_stores_envelopes(shm_root: str) -> None:
    """Models with more than 256 experts keep uint16 ids: a decode step's single row and its
    block's checksum are taken as bytes, as the store takes them."""
    wide = R3Layout(num_layers=3, top_k=2, num_experts=384, block_size=4)
    assert wide.dtype == np.uint16
    namespace = Namespace("wide", wide, "v1")
    keys = full_block_keys(namespace, [bytes([i]) * 32 for i in range(5)])
    keys.append(tail_block_key(namespace, b"tail-hash", 2))
    rows = np.random.default_rng(5).integers(0, 384, size=(22, 3, 2)).astype(wide.dtype)
    with ShmStore.create_or_open_writer(
        shm_root, "r3-w", layout=wide, capacity_bytes=1 << 20, collect_expired=False
    ) as store:
        store.put_blocks(keys, rows, 0)  # five full blocks and a tail of two rows
        digest = ObjectsDigest(wide, 0, keys[:5])
        for at in range(len(rows)):
            digest.add(rows[at : at + 1])
        stored = store.envelope_checksums(keys)
        assert stored is not None
        assert digest.finish(keys[5]) == digest_of_checksums(stored)
