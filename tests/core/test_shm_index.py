"""The store's hash index: what a probe returns, keys it cannot tell apart by their tag, and
reads that keep the GIL (docs/design.md, "The step path keeps the GIL")."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_artifact.core import Namespace, ObjectKey, R3Layout
from vllm_artifact.core.keys import full_block_keys, keys_to_words
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_index import BUCKET_WAYS, HashIndex, index_buckets_for
from vllm_artifact.errors import CapacityError, ObjectMissingError

from .conftest import assert_store_consistent, gil_releases, open_writer, rows_for

DEEPSEEK_V3 = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)


def crafted_key(word0: int, word1: int) -> ObjectKey:
    """A key with chosen words: ``word0`` picks its two buckets, the upper half of ``word1`` is
    its tag."""
    return ObjectKey(word0.to_bytes(8, "little") + word1.to_bytes(8, "little"))


def test_probe_lists_every_entry_with_the_keys_tag_in_key_order() -> None:
    index = HashIndex(np.zeros((64, BUCKET_WAYS), dtype="<u8"))
    keys = [
        crafted_key(3 | 5 << 32, 0xAAAA_0000_0001),  # buckets 3 and 5, tag 0xAAAA
        crafted_key(9 | 9 << 32, 0xBBBB_0000_0001),
        crafted_key(3 | 5 << 32, 0xAAAA_0000_0002),  # same buckets and tag as the first
        crafted_key(7 | 8 << 32, 0xCCCC_0000_0001),  # never inserted
    ]
    words = keys_to_words(keys)
    assert not len(index.insert(words[:3], np.array([10, 20, 30])))
    owners, slots = index.probe(words)
    assert owners.tolist() == sorted(owners.tolist())
    found = {(int(o), int(s)) for o, s in zip(owners, slots, strict=True)}
    # The index cannot tell keys 0 and 2 apart: both are candidates of both.
    assert found == {(0, 10), (0, 30), (1, 20), (2, 10), (2, 30)}


def test_a_key_whose_tag_is_zero_does_not_match_empty_entries() -> None:
    index = HashIndex(np.zeros((64, BUCKET_WAYS), dtype="<u8"))
    key = crafted_key(1 | 2 << 32, 0x1234)  # upper 32 bits of word 1: 0
    words = keys_to_words([key])
    owners, slots = index.probe(words)
    assert not len(owners)
    index.insert(words, np.array([0]))
    owners, slots = index.probe(words)
    assert owners.tolist() == [0] and slots.tolist() == [0]


def test_keys_sharing_buckets_and_tag_are_told_apart_by_their_envelopes(
    shm_root: str, layout: R3Layout
) -> None:
    with open_writer(shm_root, layout) as store:
        a, b, c = (crafted_key(11 | 12 << 32, 0x5151_0000_0000 | i) for i in (1, 2, 3))
        ra, rb = rows_for(layout, 1), rows_for(layout, 2)
        store.put([(a, ra, 0)])
        store.put([(b, rb, 16)])
        got_b, got_a = store.get([b, a])  # b's first candidate is a's entry
        assert np.array_equal(got_a, ra) and np.array_equal(got_b, rb)
        assert store.exists([a, b, c]) == [True, True, False]
        with pytest.raises(ObjectMissingError):
            store.get([c])


def test_a_damaged_index_entry_before_the_real_one_is_skipped(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    with open_writer(shm_root, layout) as store:
        key = full_block_keys(namespace, [b"damaged-entry"])[0]
        rows = rows_for(layout, 3)
        store.put([(key, rows, 0)])
        table = store._reads.index.table
        k0, k1 = (int(w) for w in keys_to_words([key])[0])
        first_bucket = k0 & (len(table) - 1)
        real = np.flatnonzero(table[first_bucket] >> np.uint64(32) == k1 >> 32)
        if len(real) and real[0] == 0:  # make way 0 free for the damaged entry
            table[first_bucket, BUCKET_WAYS - 1] = table[first_bucket, 0]
        table[first_bucket, 0] = np.uint64((k1 >> 32) << 32 | 0xFFFF_FFF0)  # slot out of range
        assert np.array_equal(store.get([key])[0], rows)


@pytest.mark.parametrize("num_blocks", [1, 31, 64, 248])
def test_reads_of_up_to_248_blocks_keep_the_gil(
    shm_root: str, namespace: Namespace, num_blocks: int
) -> None:
    """A prefix hit's store read runs on the engine's step thread; a GIL release there hands
    the GIL to the publisher thread for up to the switch interval (5 ms). The spinner sees a
    release only when it wins the race for the GIL (a few percent of releases), so the read
    is repeated until one release per read would be seen all but surely."""
    layout = DEEPSEEK_V3
    ns = Namespace(namespace.model_id, layout, namespace.weight_version)
    with open_writer(shm_root, layout, slots=256) as store:
        keys = full_block_keys(ns, [i.to_bytes(32, "little") for i in range(num_blocks)])
        rows = rows_for(layout, 4, num_blocks * layout.block_size)
        store.put_blocks(keys, rows, 0)
        out = layout.empty(len(rows))
        with gil_releases() as count:
            before = count[0]
            for _ in range(300):
                store.read_into(keys, out)
            releases = count[0] - before
        assert np.array_equal(out, rows)
        assert releases == 0


def test_a_damaged_index_is_healed_by_the_next_publish(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    """Garbage in every index entry (both buckets of every key full): the next publish
    rebuilds the index from the envelopes and retries. Before the fix every insert raised
    CapacityError ("hash index has no room") until the writer restarted."""
    with open_writer(shm_root, layout, slots=64) as store:
        old = full_block_keys(namespace, [b"old-%d" % i for i in range(40)])
        new = full_block_keys(namespace, [b"new-%d" % i for i in range(20)])
        want = {k: rows_for(layout, i) for i, k in enumerate([*old, *new])}
        store.put([(k, want[k], 0) for k in old[:20]], pin=True)
        store.put([(k, want[k], 0) for k in old[20:]], pin=False)
        assert store._reads.locate(keys_to_words(old[:1])).slots.tolist() == [0]
        table = store._reads.index.table
        rng = np.random.default_rng(5)
        table[...] = rng.integers(1, 2**64 - 1, size=table.shape, dtype=np.uint64, endpoint=True)
        # Some garbage looks right: an object's own entry in a bucket that is not its key's,
        # and entries pointing into the arena (slots 0-63) with wrong tags.
        k0, k1 = (int(w) for w in keys_to_words(old[:1])[0])
        home = {k0 & (len(table) - 1), (k0 >> 32) & (len(table) - 1)}
        stray = next(b for b in range(len(table)) if b not in home)
        own = np.uint64((k1 >> 32) << 32 | 1)  # old[0] is in slot 0
        table[stray, 0] = own
        # ... and that entry twice, in each of its own buckets: one is kept.
        table[sorted(home), 2] = own
        table[:, 1] = (table[:, 1] & np.uint64(0xFFFF_FFFF_0000_0000)) | np.uint64(7)
        assert store.exists(old) == [True] + [False] * (len(old) - 1)  # the hints are gone
        store.put([(k, want[k], 0) for k in new], pin=False)
        assert_store_consistent(store)
        with ShmStore.open_reader(shm_root, "s") as reader:
            for handle in (store, reader):
                for key, got in zip([*old, *new], handle.get([*old, *new]), strict=True):
                    np.testing.assert_array_equal(got, want[key])
        assert store.stats().pinned_objects == 20


def test_a_full_pair_of_buckets_still_raises_capacity_error(
    shm_root: str, layout: R3Layout
) -> None:
    """Real exhaustion: 17 keys that all live in buckets 3 and 5 (8 ways each). The index
    is healed and the insert retried, then the put fails as a whole (CapacityError), the store
    consistent. (A guard: this held before the fix too.)"""
    keys = [crafted_key(3 | 5 << 32, 0x7000_0000_0000 | i << 32 | i) for i in range(17)]
    with open_writer(shm_root, layout, slots=64) as store:
        store.put([(k, rows_for(layout, i), 0) for i, k in enumerate(keys[:16])])
        with pytest.raises(CapacityError, match="hash index has no room"):
            store.put([(keys[16], rows_for(layout, 16), 0)])
        assert store.exists(keys) == [True] * 16 + [False]
        assert_store_consistent(store)
        for i, got in enumerate(store.get(keys[:16])):
            np.testing.assert_array_equal(got, rows_for(layout, i))


@pytest.mark.parametrize(
    ("keys", "fullest"),
    [
        (1_160_000, 4),  # docs/store.md: "with 1.16 M keys the fullest bucket held 4 of 8"
        (1 << 20, 5),  # the highest load a store sizes its table for: 25% (4 entries per slot)
    ],
)
def test_two_choice_keeps_the_fullest_bucket_low(keys: int, fullest: int) -> None:
    """A table sized as the store sizes it (``index_buckets_for``) for ``keys`` objects, all
    inserted at once (the chunked, vectorized insert of a recovery): no insert fails and the
    fullest bucket holds at most ``fullest`` of 8 entries. Measured with seed 0: 4 at 1.16 M
    keys (13.8% load; 37 buckets hold 4), 5 at 2^20 keys (25% load; 28 buckets hold 5)."""
    index = HashIndex(np.zeros((index_buckets_for(keys), BUCKET_WAYS), dtype="<u8"))
    words = np.random.default_rng(0).integers(0, 2**64, size=(keys, 2), dtype=np.uint64)
    assert not len(index.insert(words, np.arange(keys)))
    assert np.count_nonzero(index.table, axis=1).max() <= fullest
    assert np.count_nonzero(index.table) == keys
