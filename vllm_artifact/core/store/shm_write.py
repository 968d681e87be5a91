"""Writes of a /dev/shm store: put batches and the seqlock publication (writer only).

Publish protocol (per slot; crash-safe and lock-free for readers):

1. if the slot held an evicted object, remove its index entry;
2. ``seq |= 1`` (odd: "being written"); readers skip the slot;
3. write payload, then envelope fields and checksum;
4. ``seq += 1`` (even: published);
5. insert the key -> slot index entry.

A writer killed at any point leaves slots with an odd ``seq`` (invisible to readers, dropped
by the next writer) or complete objects (kept); never a visible half-written object. A
publication that raises (any exception, KeyboardInterrupt too) is undone before the
exception propagates: its slots are unindexed, retired and freed, so a put that raised
stored nothing new.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from vllm_artifact.core.envelope import HeaderWords, checksum
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.shm_read import Located, StoreReads
from vllm_artifact.core.store.shm_recovery import heal_index, retire_slots
from vllm_artifact.core.store.shm_slots import SlotTable
from vllm_artifact.errors import CapacityError, InternalError, KeyCollisionError, SchemaError

__all__ = ["BatchBuilder", "PutBatch", "StoreWrites"]


class PutBatch:
    """A validated put batch: keys, payload bytes, token starts and counts.

    Either ``srcs`` lists one buffer per object, or ``whole`` holds all payloads back to
    back, ``step`` bytes each but the last (one run of blocks): then no per-object view
    exists until one is needed.
    """

    def __init__(
        self,
        keys: list[ObjectKey],
        starts: np.ndarray,
        n_tokens: np.ndarray,
        *,
        srcs: list[memoryview] | None = None,
        whole: memoryview | None = None,
        step: int = 0,
    ) -> None:
        self.keys = keys
        self.starts = starts  # uint64
        self.n_tokens = n_tokens  # int64
        self.srcs = srcs
        self.whole = whole
        self.step = step

    def src(self, i: int) -> memoryview:
        if self.srcs is not None:
            return self.srcs[i]
        whole = self._whole()
        start = i * self.step
        return whole[start : min(start + self.step, len(whole))]

    def src_views(self, idx: np.ndarray) -> Iterator[memoryview]:
        """Payload views of objects ``idx`` (made at C speed for a whole run)."""
        if self.srcs is not None:
            return map(self.srcs.__getitem__, idx.tolist())
        whole = self._whole()
        starts = idx.astype(np.int64) * self.step
        ends = np.minimum(starts + self.step, len(whole))
        return map(whole.__getitem__, map(slice, starts.tolist(), ends.tolist()))

    def _whole(self) -> memoryview:
        if self.whole is None:
            raise InternalError("a put batch has neither per-object payloads nor a whole run")
        return self.whole

    def deduplicated(self) -> PutBatch:
        """Drop repeated keys; a repeat with other content is a collision."""
        first_of: dict[bytes, int] = {}
        keep: list[int] = []
        for at, key in enumerate(self.keys):
            first = first_of.setdefault(key, at)
            if first == at:
                keep.append(at)
                continue
            same_content = bytes(self.src(at)) == bytes(self.src(first))
            if self.starts[at] != self.starts[first] or not same_content:
                raise KeyCollisionError(
                    f"R3 key {bytes(key).hex()} appears twice in one batch with different "
                    "content; keys must identify content"
                )
        return PutBatch(
            [self.keys[i] for i in keep],
            self.starts[keep],
            self.n_tokens[keep],
            srcs=[self.src(i) for i in keep],
        )


class BatchBuilder:
    """Builds the one :class:`PutBatch` of a put from objects and runs of blocks, validated
    cheaply (no pass over the data). A batch of exactly one run keeps its rows as one byte
    range (copied in consecutive ranges, no per-object views)."""

    def __init__(self, layout: R3Layout) -> None:
        self._layout = layout
        # (keys, payload bytes, first token, rows) of each object or run, in order
        self._parts: list[tuple[Sequence[ObjectKey], memoryview, int, int]] = []

    def add_object(self, key: ObjectKey, rows: np.ndarray, token_start: int) -> None:
        """One object: 1..block_size rows from a block boundary."""
        layout = self._layout
        block_size = layout.block_size
        if (
            type(rows) is not np.ndarray
            or (rows.dtype is not layout.dtype and rows.dtype != layout.dtype)
            or (rows.shape[1:] != layout.row_shape)
        ):
            rows = layout.check_rows(rows, what=f"rows of key {bytes(key).hex()}")
        n_rows = rows.shape[0]
        if (
            not 1 <= n_rows <= block_size
            or type(token_start) is not int
            or token_start < 0
            or token_start % block_size
        ):
            raise SchemaError(
                f"object {bytes(key).hex()}: {n_rows} rows at token {token_start!r}; an object "
                f"holds 1..{block_size} rows of one KV block and starts at a multiple of "
                f"{block_size}"
            )
        try:
            src = rows.data.cast("B")
        except TypeError:  # not C-contiguous
            src = np.ascontiguousarray(rows).data.cast("B")
        self._parts.append(((key,), src, token_start, n_rows))

    def add_run(self, keys: Sequence[ObjectKey], rows: np.ndarray, token_start: int) -> None:
        """Consecutive blocks of one rows array from ``token_start``: ``rows[i*bs:(i+1)*bs]``
        is the object of ``keys[i]``, the last may be shorter."""
        if not keys:
            return
        block_size = self._layout.block_size
        rows = self._layout.check_rows(rows)  # C-contiguous: its bytes slice per block
        n_blocks = len(keys)
        if not (n_blocks - 1) * block_size < len(rows) <= n_blocks * block_size:
            raise SchemaError(
                f"{len(rows)} rows do not fill {n_blocks} blocks of {block_size} tokens"
            )
        if type(token_start) is not int or token_start < 0 or token_start % block_size:
            raise SchemaError(f"token_start={token_start!r} is not a block boundary ({block_size})")
        self._parts.append((keys, rows.data.cast("B"), token_start, len(rows)))

    def build(self) -> PutBatch | None:
        """The batch, repeated keys dropped (None if it has no object)."""
        if not self._parts:
            return None
        block_size = self._layout.block_size
        step = block_size * self._layout.row_nbytes
        if len(self._parts) == 1:
            keys, whole, token_start, n_rows = self._parts[0]
            n_blocks = len(keys)
            n_tokens = np.full(n_blocks, block_size, dtype=np.int64)
            n_tokens[-1] = n_rows - (n_blocks - 1) * block_size
            batch = PutBatch(
                list(keys),
                np.arange(
                    token_start, token_start + n_blocks * block_size, block_size, dtype=np.uint64
                ),
                n_tokens,
                whole=whole,
                step=step,
            )
        else:
            all_keys: list[ObjectKey] = []
            srcs: list[memoryview] = []
            starts: list[int] = []
            counts: list[int] = []
            for keys, whole, token_start, n_rows in self._parts:
                n_blocks = len(keys)
                if n_blocks == 1:  # one object (put): its bytes as they are
                    all_keys.append(keys[0])
                    srcs.append(whole)
                    starts.append(token_start)
                    counts.append(n_rows)
                    continue
                all_keys.extend(keys)
                srcs.extend(whole[at : at + step] for at in range(0, n_blocks * step, step))
                starts.extend(range(token_start, token_start + n_blocks * block_size, block_size))
                counts.extend([block_size] * (n_blocks - 1))
                counts.append(n_rows - (n_blocks - 1) * block_size)
            batch = PutBatch(
                all_keys,
                np.array(starts, dtype=np.uint64),
                np.array(counts, dtype=np.int64),
                srcs=srcs,
            )
        if len(set(batch.keys)) != len(batch.keys):
            batch = batch.deduplicated()
        return batch


class StoreWrites:
    """Publication of put batches into the arena (writer only; the caller serializes)."""

    def __init__(self, reads: StoreReads, table: SlotTable) -> None:
        self._reads = reads
        self.table = table
        self._where = reads.where

    def put(self, batch: PutBatch, pin: bool) -> None:
        """Publish ``batch``: identical republications are kept, corrupt or half-written
        leftovers of its keys replaced, new objects written (pinned with ``pin``)."""
        reads, table = self._reads, self.table
        words = keys_to_words(batch.keys)
        located = reads.locate(words)
        found = located.present | located.corrupt | located.unstable
        drop: list[int] = []
        if found.any():
            self._check_republished(batch, located, np.flatnonzero(found), drop)
        if drop:
            dropped = np.array(drop, dtype=np.int64)
            reads.index.remove(words[dropped], located.slots[dropped])
            retire_slots(reads.live(), located.slots[dropped], table)
            found[dropped] = False
        kept = located.slots[found]
        published = self._publish(words, batch, np.flatnonzero(~found), kept)
        try:
            if pin:  # one slot per distinct key of the (deduplicated) batch
                table.pin(np.concatenate((kept, published)), distinct=True)
        except BaseException:
            self._abandon(published)  # a put that raises stores nothing new
            raise
        table.touch(kept)

    def _check_republished(
        self, batch: PutBatch, located: Located, found_idx: np.ndarray, drop: list[int]
    ) -> None:
        """Keys already stored: accept identical content, collect corrupt or
        half-written leftovers in ``drop`` (replaced), raise on a collision."""
        arena = self._reads.live()
        payload, stride = arena.payload, arena.geometry.slot_nbytes
        envelopes = located.words[found_idx]
        present = located.present[found_idx].tolist()
        same_range = (
            (envelopes[:, HeaderWords.START] == batch.starts[found_idx])
            & (HeaderWords.n_tokens(envelopes) == batch.n_tokens[found_idx])
        ).tolist()
        seeds = self._reads.header_words.seeds(envelopes)  # meaningful where present
        sums = envelopes[:, HeaderWords.CSUM].tolist()
        nbytes = (HeaderWords.n_tokens(envelopes) * self._reads.layout.row_nbytes).tolist()
        for position, item in enumerate(found_idx.tolist()):
            offset = int(located.slots[item]) * stride
            stored = payload[offset : offset + nbytes[position]]
            if not (present[position] and checksum(stored, seeds[position]) == sums[position]):
                drop.append(item)  # a corrupt or half-written leftover: replace it
                continue
            # bytes() copies 2 x 7 KiB but compares at memcmp speed (memoryview == is slow)
            if same_range[position] and bytes(stored) == bytes(batch.src(item)):
                continue  # identical republish
            header = HeaderWords.as_headers(envelopes)[position]
            raise KeyCollisionError(
                f"R3 key {batch.keys[item].hex()} is already published with different "
                f"content (tokens {int(header['token_start'])}+{int(header['n_tokens'])}, now "
                f"{int(batch.starts[item])}+{int(batch.n_tokens[item])}). Keys must include "
                "everything that changes routing: check the weight version and the model "
                "namespace; the block hash must be the KV cache's."
            )

    def _abandon(self, slots: np.ndarray) -> None:
        """Undo a publication into ``slots`` that failed part-way, wherever it stopped: drop
        every index entry that points into them (the batch's own, and the victims' if the
        failure came before they were unindexed), retire them, and free them in the slot
        table. Victims already evicted stay evicted."""
        if not len(slots):
            return
        self._reads.index.remove_slots(slots)
        retire_slots(self._reads.live(), slots, self.table)

    def _publish(
        self, words: np.ndarray, batch: PutBatch, new: np.ndarray, kept: np.ndarray
    ) -> np.ndarray:
        """Write batch objects ``new`` by the seqlock protocol; returns their slots."""
        reads, table = self._reads, self.table
        arena = reads.live()
        n_new = len(new)
        if n_new == 0:
            return np.empty(0, dtype=np.int64)
        got = table.allocate(n_new, kept)
        if got is None:
            raise CapacityError(
                f"R3 store {self._where} cannot take {n_new} new blocks: its "
                f"{arena.geometry.slot_count} slots hold {table.pinned} pinned blocks (the "
                "KV cache can still hit them) and nothing else can be evicted. Increase "
                "--artifact-capacity to at least the KV cache size in blocks."
            )
        slots, evicted = got
        # From here on any exception (KeyboardInterrupt too) undoes the publication: an odd
        # slot left behind would make the next publication into it even while being written.
        try:
            if evicted.any():
                victims = slots[evicted]
                old = arena.headers[victims]
                reads.index.remove(np.stack((old["key0"], old["key1"]), axis=1), victims)
            seq = arena.seq
            odd = seq[slots] | np.uint64(1)  # odd even if a failed publication left it odd
            seq[slots] = odd  # 1. odd: being written
            new_words = words[new]
            starts, n_tokens = batch.starts[new], batch.n_tokens[new]
            envelopes = reads.header_words.build(new_words, starts, n_tokens)
            envelopes[:, HeaderWords.SEQ] = odd
            seeds = reads.header_words.seeds_for(new_words, starts, n_tokens)
            sums = list(map(checksum, batch.src_views(new), seeds))
            write_payloads(arena.payload, arena.geometry.slot_nbytes, batch, new, slots)  # 2.
            envelopes[:, HeaderWords.CSUM] = sums
            arena.words[slots] = envelopes  # 3. envelope (seq still odd)
            seq[slots] = odd + np.uint64(1)  # 4. even: published
            failed = reads.index.insert(new_words, slots)  # 5. visible by key
            if len(failed):
                failed = heal_index(arena, reads.index, table, slots, self._where)
            if len(failed):
                raise CapacityError(
                    f"R3 store {self._where}: the hash index has no room for "
                    f"{len(failed)} keys (both buckets full). Increase --artifact-capacity."
                )
            table.fill(slots)
        except BaseException:
            self._abandon(slots)
            raise
        return slots


def write_payloads(
    payload: memoryview, stride: int, batch: PutBatch, new: np.ndarray, slots: np.ndarray
) -> None:
    """Copy payloads of batch objects ``new`` into ``slots`` (``stride`` bytes apart in
    ``payload``); runs that are consecutive on both sides (one run of blocks into freshly
    swept slots) move as one range."""
    if batch.whole is None or len(new) < 2:
        for view, slot in zip(batch.src_views(new), slots.tolist(), strict=True):
            offset = slot * stride
            payload[offset : offset + len(view)] = view
        return
    # In a whole run every object but the last is one full stride long.
    src = new.astype(np.int64) * stride
    dst = slots.astype(np.int64) * stride
    consecutive = (src[1:] == src[:-1] + stride) & (dst[1:] == dst[:-1] + stride)
    breaks = (np.flatnonzero(~consecutive) + 1).tolist()
    src_offsets, dst_offsets = src.tolist(), dst.tolist()
    whole = batch.whole
    for lo, hi in zip([0, *breaks], [*breaks, len(new)], strict=True):
        start = src_offsets[lo]
        end = min(src_offsets[hi - 1] + stride, len(whole))
        at = dst_offsets[lo]
        payload[at : at + (end - start)] = whole[start:end]
