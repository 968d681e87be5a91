"""Shared, lock-free-readable hash index: object key -> slot.

Layout: ``num_buckets`` (a power of two) buckets of 8 little-endian uint64
entries (one 64-byte cache line each). An entry is ``tag << 32 | (slot + 1)``
(0 = empty), where ``tag`` is 32 bits of the key. A key may live in exactly
two buckets (bits 0-31 and 32-63 of its first key word pick them); inserts go
to the emptier one ("two-choice" hashing keeps the fullest bucket near the
average even at 1M+ keys). Because a key can only be in those two buckets,
lookups never follow probe chains and deletes just clear the entry: no
tombstones, no rehashing, and a get or put costs the same with 10 or 10^6
objects stored.

Readers in other processes probe the table without locks. Entries are single
aligned 8-byte words, and the index is only a hint: readers always re-check
the slot's envelope (key, seqlock, checksum), so a stale or torn entry can
only produce a clean "missing", never wrong data. The table is sized at four
entries per slot (load <= 25%), where both candidate buckets being full has
negligible probability: an insert that finds them full means a damaged table, which the
writer then rebuilds from the objects (:meth:`HashIndex.heal`) before it retries; only when
that fails too does the insert report failure.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BUCKET_WAYS", "HashIndex", "index_buckets_for"]

BUCKET_WAYS = 8
_LOW32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_CHUNK = 4096
#: numpy (2.3, measured) keeps the GIL in array operations over at most this many items
#: (docs/design.md, "The step path keeps the GIL").
_KEEPS_GIL = 496  # the entries of 31 keys' two buckets
#: Probes of up to this many keys keep the GIL: the gather of their 2 buckets each is the
#: largest single operation then.
_GIL_KEEPING_KEYS = _KEEPS_GIL // 2


def index_buckets_for(slot_count: int) -> int:
    """Power-of-two bucket count giving >= 4 entries per slot."""
    want = max(1, -(-4 * slot_count // BUCKET_WAYS))
    return 1 << (want - 1).bit_length()


def _same_tag(entries: np.ndarray, tags: np.ndarray) -> np.ndarray:
    """Entries whose upper 32 bits equal the tag's (``tags`` as long as ``entries`` or
    longer)."""
    return (entries ^ tags[: len(entries)]) <= _LOW32


class HashIndex:
    """View of the index region (``[num_buckets, 8]`` uint64)."""

    def __init__(self, table: np.ndarray) -> None:
        if table.ndim != 2 or table.shape[1] != BUCKET_WAYS or table.dtype != np.dtype("<u8"):
            raise ValueError("index table must be [buckets, 8] uint64")
        n_buckets = table.shape[0]
        if n_buckets & (n_buckets - 1):
            raise ValueError("index bucket count must be a power of two")
        self.table = table
        self._mask = np.uint64(n_buckets - 1)
        # One opaque item per bucket: fancy indexing copies a bucket per index (see probe).
        self._buckets = table.view(np.dtype((np.void, 8 * BUCKET_WAYS)))[:, 0]

    def _route(
        self, words: np.ndarray, slots: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key0 = words[:, 0]
        first = (key0 & self._mask).astype(np.intp)
        second = ((key0 >> _S32) & self._mask).astype(np.intp)
        tag = (words[:, 1] >> _S32) << _S32
        if slots is None:
            return first, second, tag
        return first, second, tag | (slots.astype(np.uint64) + np.uint64(1))

    def probe(self, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every entry of the keys' candidate buckets that carries the key's tag, as
        ``(owners, slots)``: key ``owners[j]`` (ascending; a key can have several when
        another key shares its tag) may live in slot ``slots[j]`` (int64).

        Buckets move as opaque 64-byte items and the tag test runs on flat arrays, in slices
        of 496 entries: for up to 248 keys no step of it releases the GIL, which the engine's
        step thread needs for its prefix-hit reads (docs/design.md, "The step path keeps the
        GIL").
        """
        first, second, tag = self._route(words)
        entries = self._buckets[np.stack((first, second), axis=1).reshape(-1)].view(
            "<u8"
        )  # [keys * 16]
        tags = np.repeat(tag, 2 * BUCKET_WAYS)
        if _KEEPS_GIL < len(entries) <= _GIL_KEEPING_KEYS * 2 * BUCKET_WAYS:
            # A prefix hit of up to 248 blocks: the tag test in slices of array operations
            # small enough to keep the GIL (larger reads release it in their copy anyway).
            at = np.concatenate(
                [
                    lo + np.flatnonzero(_same_tag(entries[lo : lo + _KEEPS_GIL], tags[lo:]))
                    for lo in range(0, len(entries), _KEEPS_GIL)
                ]
            )
        else:
            at = np.flatnonzero(_same_tag(entries, tags))
        slots = (entries[at] & _LOW32).astype(np.int64)
        slots -= 1
        owners = at // (2 * BUCKET_WAYS)
        empty = slots < 0  # an empty entry (0) matches a key whose tag is 0
        if empty.any():
            owners, slots = owners[~empty], slots[~empty]
        return owners, slots

    def remove(self, words: np.ndarray, slots: np.ndarray) -> None:
        """Clear the entries mapping each key to exactly its slot (writer only)."""
        if not len(words):
            return
        first, second, entry = self._route(words, slots)
        for buckets in (first, second):
            match = self.table[buckets] == entry[:, None]
            keys, ways = np.nonzero(match)
            self.table[buckets[keys], ways] = 0

    def remove_slots(self, slots: np.ndarray) -> None:
        """Clear every entry that points into ``slots``, whatever its key (writer only; a
        publication that failed part-way). A pass over the whole table: not for hot paths."""
        pointed = self.table & _LOW32  # slot + 1; 0 for an empty entry
        hit = np.isin(pointed, slots.astype(np.uint64) + np.uint64(1))
        self.table[hit] = 0

    def insert(self, words: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Insert key -> slot entries (writer only); returns indices that failed.

        Vectorized two-choice placement: each round, every pending key picks
        its emptier bucket; keys that picked the same bucket take successive
        free ways; keys that found no room retry in the next round. Large
        batches (an index rebuild) go in chunks so that bucket loads stay
        close to those of one-at-a-time two-choice insertion.
        """
        failed = [
            lo + self._insert_chunk(words[lo : lo + _CHUNK], slots[lo : lo + _CHUNK])
            for lo in range(0, len(words), _CHUNK)
        ]
        return np.concatenate(failed) if failed else np.empty(0, dtype=np.int64)

    def _insert_chunk(self, words: np.ndarray, slots: np.ndarray) -> np.ndarray:
        first, second, entry = self._route(words, slots)
        pending = np.arange(len(words))
        while len(pending):
            pending_first, pending_second = first[pending], second[pending]
            first_load = np.count_nonzero(self.table[pending_first], axis=1)
            second_load = np.count_nonzero(self.table[pending_second], axis=1)
            target = np.where(first_load <= second_load, pending_first, pending_second)
            order = np.argsort(target, kind="stable")
            sorted_target = target[order]
            same_target_start = np.searchsorted(sorted_target, sorted_target, side="left")
            rank = np.empty(len(pending), dtype=np.int64)
            rank[order] = np.arange(len(pending)) - same_target_start
            free = np.cumsum(self.table[target] == 0, axis=1)
            ok = free[:, -1] > rank
            if not ok.any():
                break
            way = np.argmax(free > rank[:, None], axis=1)
            self.table[target[ok], way[ok]] = entry[pending[ok]]
            pending = pending[~ok]
        return pending

    def heal(self, keys: np.ndarray, live: np.ndarray) -> np.ndarray:
        """Make the table agree with the objects (writer only; after an insert found both
        buckets full, which at <= 25% load means the table was damaged).

        ``keys`` holds the key words of every slot (``[slots, 2]``) and ``live`` marks the
        slots that hold an object. Entries that do not point to a live slot of a key with
        their tag in one of that key's buckets are cleared, as are second entries for one
        slot; then every live slot without an entry is inserted. Entries that were right are
        never touched, so lock-free readers never miss an object that was indexed. A pass
        over the whole table: not for hot paths. Returns the slots that found no room.
        """
        flat = self.table.reshape(-1)
        at = np.flatnonzero(flat)
        entry = flat[at]
        slot = (entry & _LOW32).astype(np.int64) - 1
        ok = slot < len(live)
        slot = np.where(ok, slot, 0)
        ok &= live[slot]
        key0, key1 = keys[slot, 0], keys[slot, 1]
        bucket = (at // BUCKET_WAYS).astype(np.uint64)
        ok &= (entry >> _S32) == (key1 >> _S32)
        ok &= (bucket == (key0 & self._mask)) | (bucket == ((key0 >> _S32) & self._mask))
        good = np.flatnonzero(ok)
        _, first = np.unique(slot[good], return_index=True)
        keep = np.zeros(len(at), dtype=bool)
        keep[good[first]] = True  # one entry per slot
        flat[at[~keep]] = 0
        indexed = np.zeros(len(live), dtype=bool)
        indexed[slot[keep]] = True
        missing = np.flatnonzero(live & ~indexed)
        return missing[self.insert(keys[missing], missing)]

    def clear(self) -> None:
        self.table[...] = 0
