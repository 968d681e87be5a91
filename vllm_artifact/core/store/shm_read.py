"""Reads of a /dev/shm store: locate keys, copy payloads, verify what was copied.

Lock-free in every process, the writer's included: a read looks each key up in the index,
reads the slot's ``seq``, copies envelope and payload, verifies key, envelope and the xxh3
checksum *on the bytes it copied*, then re-reads ``seq``; a changed ``seq`` means the slot
was reused during the read, and the read starts over (and reports the object missing if it
is gone). A checksum mismatch with an unchanged ``seq`` is retried once after 1 ms (a weakly
ordered CPU may show a new header before its payload), then raised as corrupt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_artifact.core.buffer import GIL_KEEPING_ITEMS
from vllm_artifact.core.envelope import HeaderWords, checksum
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.shm_arena import Arena
from vllm_artifact.core.store.shm_index import BUCKET_WAYS, HashIndex
from vllm_artifact.core.store.shm_metrics import StoreMetrics
from vllm_artifact.core.store.shm_slots import SlotTable
from vllm_artifact.errors import (
    InternalError,
    ObjectCorruptError,
    ObjectMissingError,
    SchemaError,
    StoreClosedError,
)

__all__ = ["Located", "ScrubReport", "StoreReads", "check_read_target", "verify_copies"]

_READ_ATTEMPTS = 4


@dataclass(frozen=True)
class ScrubReport:
    """Objects that read back intact, and keys of those that failed their checks."""

    checked: int
    corrupt: tuple[ObjectKey, ...]


@dataclass
class Located:
    """Result of locating keys: slot per key plus its envelope snapshot."""

    slots: np.ndarray  # int64, -1 where not found
    seq: np.ndarray  # seq read before the envelope copy
    words: np.ndarray  # envelope copies as [n, 8] uint64 words (HeaderWords)
    present: np.ndarray  # key found, published, envelope valid
    corrupt: np.ndarray  # key found and published, envelope fields invalid
    unstable: np.ndarray  # key found but the slot is being rewritten

    @property
    def headers(self) -> np.ndarray:
        """The envelope copies as a ``HEADER_DTYPE`` array (a view)."""
        return HeaderWords.as_headers(self.words)


class StoreReads:
    """The mapped arena of one store handle and every read of it.

    Owns the mapping: :meth:`close` drops it, after which every read raises
    :class:`StoreClosedError`. ``slots`` and ``metrics`` are the writer's (reads then mark
    the slots referenced for eviction and count into the exported metrics).
    """

    def __init__(
        self,
        arena: Arena,
        where: str,
        *,
        slots: SlotTable | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self._arena: Arena | None = arena
        self.layout = arena.geometry.layout
        self.index = HashIndex(arena.index_table)
        self.header_words = HeaderWords(self.layout)
        self.where = where
        self._slots = slots
        self._metrics = metrics

    def live(self) -> Arena:
        """The mapped arena; :class:`StoreClosedError` once the handle is closed."""
        arena = self._arena
        if arena is None:
            raise StoreClosedError(f"R3 store {self.where} handle is closed")
        return arena

    @property
    def closed(self) -> bool:
        return self._arena is None

    def close(self) -> None:
        """Unmap the arena (idempotent)."""
        arena, self._arena = self._arena, None
        if arena is None:
            return
        # The index views the mapping too: drop it, or the unmap waits for the collector
        # (and the old arena's pages stay allocated after a replace in this process).
        self.index = HashIndex(np.zeros((1, BUCKET_WAYS), dtype="<u8"))
        arena.close()

    # ----------------------------------------------------------------- locating

    def locate(self, words: np.ndarray) -> Located:
        """Slots and envelope snapshots of keys, vectorized over the batch (for up to 248 keys
        without releasing the GIL, like :meth:`HashIndex.probe`)."""
        arena = self.live()
        n_keys = len(words)
        owners, candidates = self.index.probe(words)
        slots = np.full(n_keys, -1, dtype=np.int64)
        if not len(owners):  # the usual put: every key is new (no entry carries its tag)
            none = np.zeros(n_keys, dtype=bool)
            return Located(
                slots=slots,
                seq=np.zeros(n_keys, dtype=np.uint64),
                words=np.zeros((n_keys, 8), dtype=np.uint64),
                present=none,
                corrupt=none,
                unstable=none,
            )
        first = np.ones(len(owners), dtype=bool)  # each key's first candidate
        np.not_equal(owners[1:], owners[:-1], out=first[1:])
        slots[owners[first]] = candidates[first]
        n_slots = len(arena.seq)
        found = (slots >= 0) & (slots < n_slots)  # damaged entry: missing
        slots[~found] = -1
        safe = np.where(found, slots, 0)
        seq = arena.seq[safe]  # seqlock: read seq, then copy the envelope
        envelopes = arena.header_items[safe].view("<u8").reshape(n_keys, 8)
        key_matches = found & (envelopes[:, 1] == words[:, 0]) & (envelopes[:, 2] == words[:, 1])
        if len(owners) > np.count_nonzero(first) and not key_matches.all():
            # Rare: a key with several candidates, and the first is another key's (same tag)
            # or a damaged entry.
            all_words = arena.words
            several = np.flatnonzero(np.bincount(owners, minlength=n_keys) > 1)
            for key_at in several[~key_matches[several]].tolist():
                for slot in candidates[owners == key_at].tolist():
                    if (
                        0 <= slot < n_slots
                        and int(all_words[slot, 1]) == int(words[key_at, 0])
                        and int(all_words[slot, 2]) == int(words[key_at, 1])
                    ):
                        slots[key_at], seq[key_at] = slot, all_words[slot, 0]
                        envelopes[key_at] = all_words[slot]
                        key_matches[key_at] = True
                        break
        slots[~key_matches] = -1
        stable = key_matches & ((seq & np.uint64(1)) == 0) & (seq > 0) & (envelopes[:, 0] == seq)
        problems = self.header_words.problems(envelopes)
        return Located(
            slots=slots,
            seq=seq,
            words=envelopes,
            present=stable & ~problems,
            corrupt=stable & problems,
            unstable=key_matches & ~stable,
        )

    # ------------------------------------------------------------------ reading

    def read_into(self, keys: Sequence[ObjectKey], out: np.ndarray, token_start: int) -> np.ndarray:
        """Objects ``keys`` back to back into ``out`` (see ``ObjectStore.read_into``)."""
        if not check_read_target(self.layout, keys, out):
            return np.zeros(0, dtype=np.uint64)
        return self._read(keys, _IntoArray(self, keys, out, token_start))

    def get(self, keys: Sequence[ObjectKey]) -> list[np.ndarray]:
        """A new array per object."""
        if not keys:
            return []
        target = _NewArrays(self.layout)
        self._read(keys, target)
        return target.arrays()

    def scrub(self) -> ScrubReport:
        """Read back every published object with the full read checks; objects replaced
        while it runs are skipped."""
        words = self.live().words
        seq = words[:, HeaderWords.SEQ]
        published = np.flatnonzero(
            (seq & np.uint64(1) == 0) & (seq > 0) & (words[:, 1:3] != 0).any(axis=1)
        )
        keys = [ObjectKey(bytes(key)) for key in words[published, 1:3].astype("<u8")]
        checked, corrupt = 0, []
        for key in keys:
            try:
                self.get([key])
                checked += 1
            except ObjectCorruptError:
                corrupt.append(key)
            except ObjectMissingError:
                pass  # evicted or replaced since the scan
        return ScrubReport(checked=checked, corrupt=tuple(corrupt))

    def missing(self, keys: Sequence[ObjectKey], mask: np.ndarray, why: str) -> ObjectMissingError:
        """The error for objects ``keys[mask]`` that are not in the store."""
        idx = np.flatnonzero(mask)
        geometry = self.live().geometry
        evicted = f", {self._slots.evictions} evicted so far" if self._slots is not None else ""
        return ObjectMissingError(
            f"{len(idx)} of {len(keys)} R3 objects are not in store {self.where} "
            f"(first: key {keys[int(idx[0])].hex()}, {why}). The store holds at most "
            f"{geometry.slot_count} blocks ({geometry.file_nbytes / 2**20:.0f} MiB{evicted}); "
            "objects the KV cache can still hit must fit. Increase --artifact-capacity."
        )

    def corrupt(self, keys: Sequence[ObjectKey], mask: np.ndarray, why: str) -> ObjectCorruptError:
        """The error for objects ``keys[mask]`` that failed validation."""
        idx = np.flatnonzero(mask)
        return ObjectCorruptError(
            f"{len(idx)} of {len(keys)} R3 objects in store {self.where} failed "
            f"validation (first: key {keys[int(idx[0])].hex()}: {why}); the request fails "
            "closed. Republishing the block replaces a corrupt object; if this repeats, "
            "check the host's memory and that nothing else writes under the store root."
        )

    def _read(self, keys: Sequence[ObjectKey], target: _ReadTarget) -> np.ndarray:
        """Locate, copy and verify ``keys`` into ``target`` (seqlock-retrying); returns
        their verified envelope checksums."""
        started = time.perf_counter()
        words = keys_to_words(keys)
        suspicious = False
        row_nbytes = self.layout.row_nbytes
        for _ in range(_READ_ATTEMPTS):
            located = self.locate(words)
            if not located.present.all():
                absent = ~located.present & ~located.corrupt & ~located.unstable
                if absent.any():
                    raise self.missing(keys, absent, "evicted or never published")
                if located.unstable.any():
                    time.sleep(0.0005)
                    continue
                raise self.corrupt(keys, located.corrupt, "envelope does not match the layout")
            n_tokens = HeaderWords.n_tokens(located.words)
            out, offsets = target.prepare(n_tokens, located.words[:, HeaderWords.START])
            nbytes = n_tokens * row_nbytes
            self._copy(located.slots, nbytes, out, offsets)
            bad = verify_copies(out, offsets, nbytes, located.words, self.header_words)
            changed = self.live().seq[located.slots] != located.seq
            if changed.any():
                continue  # slot reused while we read: look the keys up again
            if bad is not None:
                if suspicious:
                    raise self.corrupt(keys, bad, "checksum mismatch")
                suspicious = True  # a write may not be visible yet on weakly ordered CPUs
                time.sleep(0.001)
                continue
            if self._slots is not None:
                self._slots.touch(located.slots)
            if self._metrics is not None:
                self._metrics.observe_read(time.perf_counter() - started, len(keys))
            checksums: np.ndarray = located.words[:, HeaderWords.CSUM]
            return checksums
        raise self.missing(keys, np.ones(len(keys), dtype=bool), "replaced while being read")

    def _copy(
        self, slots: np.ndarray, nbytes: np.ndarray, out: memoryview, offsets: np.ndarray
    ) -> None:
        """Copy payloads into ``out`` (destinations are back to back): the leading whole
        blocks with one gather, the rest (a tail object) range by range."""
        arena = self.live()
        slot_nbytes = arena.geometry.slot_nbytes
        is_whole = nbytes == slot_nbytes
        whole = len(slots) if is_whole.all() else int(np.argmin(is_whole))
        if whole > 1 and int(offsets[whole - 1]) == int(offsets[0]) + (whole - 1) * slot_nbytes:
            blocks = np.frombuffer(
                out, dtype=np.uint8, count=whole * slot_nbytes, offset=int(offsets[0])
            ).reshape(whole, slot_nbytes)
            if whole <= GIL_KEEPING_ITEMS:
                # A prefix hit on the engine's step thread: a copy that keeps the GIL, so the
                # thread does not wait for the publisher to hand it back (up to the switch
                # interval, 5 ms). One temporary, of a few MiB at most.
                blocks.view(arena.payload_items.dtype)[:, 0] = arena.payload_items[slots[:whole]]
            else:
                # mode="clip": no bounds-check buffering (``locate`` returns slots in range)
                np.take(arena.payload_blocks, slots[:whole], axis=0, out=blocks, mode="clip")
        else:
            whole = 0
        payload = arena.payload
        for slot, size, at in zip(
            slots[whole:].tolist(), nbytes[whole:].tolist(), offsets[whole:].tolist(), strict=True
        ):
            start = slot * slot_nbytes
            out[at : at + size] = payload[start : start + size]


def check_read_target(layout: R3Layout, keys: Sequence[ObjectKey], out: object) -> bool:
    """``read_into``'s arguments, checked for every backend: ``out`` a writable C-contiguous
    array of the layout's rows; False when there is nothing to read (no keys, no rows)."""
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != layout.dtype
        or out.ndim != 3
        or out.shape[1:] != layout.row_shape
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise SchemaError(
            f"read_into needs a writable C-contiguous {layout.dtype} array [tokens, "
            f"{layout.num_layers}, {layout.top_k}]"
        )
    if not keys:
        if len(out):
            raise SchemaError(f"no keys given for {len(out)} rows")
        return False
    return True


def verify_copies(
    out: memoryview,
    offsets: np.ndarray,
    nbytes: np.ndarray,
    envelopes: np.ndarray,
    header_words: HeaderWords,
) -> np.ndarray | None:
    """Checksum every object on the bytes actually copied.

    Returns None if all match, else a mask of the failures. One xxh3 call per
    object, driven by ``map`` so no Python bytecode runs per object.
    """
    views = map(out.__getitem__, map(slice, offsets.tolist(), (offsets + nbytes).tolist()))
    got = list(map(checksum, views, header_words.seeds(envelopes)))
    if got == envelopes[:, HeaderWords.CSUM].tolist():
        return None
    return np.array(got, dtype=np.uint64) != envelopes[:, HeaderWords.CSUM]


# ---------------------------------------------------------------- read targets


class _ReadTarget:
    """Where a read lands: decides destination offsets once envelopes are known."""

    def prepare(
        self, n_tokens: np.ndarray, token_starts: np.ndarray
    ) -> tuple[memoryview, np.ndarray]:
        """Destination buffer and byte offset of each object (``n_tokens``
        int64 and ``token_starts`` uint64, from validated envelopes)."""
        raise NotImplementedError


class _IntoArray(_ReadTarget):
    """``read_into``: objects must tile ``out`` from ``token_start`` without gaps."""

    def __init__(
        self, reads: StoreReads, keys: Sequence[ObjectKey], out: np.ndarray, token_start: int
    ) -> None:
        self._reads, self._keys = reads, keys
        self._out = out.data.cast("B") if out.size else memoryview(b"")
        self._rows = len(out)
        self._start = token_start
        self._row_nbytes = reads.layout.row_nbytes

    def prepare(
        self, n_tokens: np.ndarray, token_starts: np.ndarray
    ) -> tuple[memoryview, np.ndarray]:
        # Not np.zeros: numpy zero-fills 1 KiB and more with calloc, releasing the GIL.
        offsets = np.empty(len(n_tokens), dtype=np.int64)
        offsets[:1] = 0
        np.cumsum(n_tokens[:-1], out=offsets[1:])
        wrong = token_starts.astype(np.int64) != self._start + offsets
        if wrong.any():
            raise self._reads.corrupt(
                self._keys,
                wrong,
                "token range does not continue the previous object (wrong key order, or a "
                "key of another request position)",
            )
        if int(n_tokens.sum()) != self._rows:
            raise ObjectCorruptError(
                f"R3 objects hold {int(n_tokens.sum())} tokens but {self._rows} rows were "
                f"requested from store {self._reads.where}; a tail object with the wrong "
                "token count was given"
            )
        return self._out, offsets * self._row_nbytes


class _NewArrays(_ReadTarget):
    """``get``: one new buffer, split into one array per object afterwards."""

    def __init__(self, layout: R3Layout) -> None:
        self._layout = layout
        self._buf: np.ndarray | None = None
        self._counts: list[int] = []

    def prepare(
        self, n_tokens: np.ndarray, token_starts: np.ndarray
    ) -> tuple[memoryview, np.ndarray]:
        self._counts = n_tokens.tolist()
        self._buf = self._layout.empty(int(n_tokens.sum()))
        offsets = np.concatenate(([0], np.cumsum(n_tokens)[:-1]))
        return self._buf.data.cast("B"), offsets * self._layout.row_nbytes

    def arrays(self) -> list[np.ndarray]:
        if self._buf is None:
            raise InternalError("a read's arrays were asked for before its buffer was made")
        bounds = np.cumsum(self._counts)[:-1]
        return list(np.split(self._buf, bounds))
