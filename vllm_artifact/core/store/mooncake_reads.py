"""Reads of a Mooncake store: one ``batch_get_into`` into a registered staging buffer, then
the shm backend's checks (key, envelope against the layout, token continuity) and its xxh3
verification on the bytes copied out.

Mooncake may evict or remove an object while a read streams it (an in-flight transfer is
invisible to eviction once the object's lease has passed), so a read whose bytes fail a
check is retried once; what still fails is missing if the key is gone, else corrupt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from vllm_artifact.core.envelope import HEADER_NBYTES, HeaderWords, checksum
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.store.mooncake_codes import OBJECT_NOT_FOUND, StagingBuffer, code_error
from vllm_artifact.core.store.shm_read import check_read_target, verify_copies
from vllm_artifact.core.store.shm_write import PutBatch
from vllm_artifact.errors import (
    KeyCollisionError,
    ObjectCorruptError,
    ObjectMissingError,
)

if TYPE_CHECKING:
    from vllm_artifact.core.store.mooncake import MooncakeStore

__all__ = ["StagedReads"]

#: ``(n_tokens, token_starts) -> (destination, byte offset of each object)``
_Prepare = Callable[[np.ndarray, np.ndarray], tuple[memoryview, np.ndarray]]
_ATTEMPTS = 2


class StagedReads:
    """Fetch, verify and copy out objects of one :class:`MooncakeStore` (its lock held)."""

    def __init__(self, store: MooncakeStore, staging: StagingBuffer) -> None:
        self._store = store
        self.staging = staging
        self._words = HeaderWords(store.layout)

    # ----------------------------------------------------------------- targets

    def read_into(self, keys: Sequence[ObjectKey], out: np.ndarray, token_start: int) -> np.ndarray:
        """Objects ``keys`` back to back into ``out``; their verified envelope checksums."""
        layout = self._store.layout
        if not check_read_target(layout, keys, out):
            return np.zeros(0, dtype=np.uint64)
        dest = out.data.cast("B") if out.size else memoryview(bytearray())

        def prepare(n_tokens: np.ndarray, starts: np.ndarray) -> tuple[memoryview, np.ndarray]:
            offsets = np.zeros(len(n_tokens), dtype=np.int64)
            np.cumsum(n_tokens[:-1], out=offsets[1:])
            wrong = starts.astype(np.int64) != token_start + offsets
            if wrong.any():
                raise self._corrupt(
                    keys,
                    wrong,
                    "token range does not continue the previous object (wrong "
                    "key order, or a key of another request position)",
                )
            if int(n_tokens.sum()) != len(out):
                raise ObjectCorruptError(
                    f"R3 objects hold {int(n_tokens.sum())} tokens but {len(out)} rows were "
                    f"requested from store {self._store.where}; a tail object with the wrong "
                    "token count was given"
                )
            return dest, offsets * layout.row_nbytes

        return self._read(keys, prepare)

    def get(self, keys: Sequence[ObjectKey]) -> list[np.ndarray]:
        return self.get_with_starts(keys)[0]

    def get_with_starts(self, keys: Sequence[ObjectKey]) -> tuple[list[np.ndarray], list[int]]:
        """Validated copies of the objects' rows, and each object's first token."""
        if not keys:
            return [], []
        layout = self._store.layout
        buffers: list[np.ndarray] = []
        seen: list[np.ndarray] = []

        def prepare(n_tokens: np.ndarray, starts: np.ndarray) -> tuple[memoryview, np.ndarray]:
            buffers[:] = [layout.empty(int(n_tokens.sum()))]
            seen[:] = [n_tokens, starts]
            offsets = np.zeros(len(n_tokens), dtype=np.int64)
            np.cumsum(n_tokens[:-1], out=offsets[1:])
            return buffers[0].data.cast("B"), offsets * layout.row_nbytes

        self._read(keys, prepare)
        n_tokens, starts = seen
        arrays = list(np.split(buffers[0], np.cumsum(n_tokens)[:-1]))
        return arrays, [int(start) for start in starts.tolist()]

    # ----------------------------------------------------------- write support

    def compare_stored(self, batch: PutBatch, found: np.ndarray) -> np.ndarray:
        """For batch objects ``found`` (stored keys): False where the stored object is
        identical, True where it must be replaced (corrupt, or gone since the existence
        check); :class:`KeyCollisionError` where it differs."""
        keys = [batch.keys[i] for i in found.tolist()]
        staged, codes = self._transfer(keys)
        words, valid = self._envelopes(keys, staged, codes)
        replace = ~valid
        stored_tokens = HeaderWords.n_tokens(words)
        nbytes = (stored_tokens * self._store.layout.row_nbytes).tolist()
        seeds = self._words.seeds(words)
        sums = words[:, HeaderWords.CSUM].tolist()
        stored_starts = words[:, HeaderWords.START].tolist()
        for at, item in enumerate(found.tolist()):
            if replace[at]:
                continue
            stored = staged[at, HEADER_NBYTES : HEADER_NBYTES + nbytes[at]].data
            if checksum(stored, seeds[at]) != sums[at]:
                replace[at] = True
                continue
            was = (stored_starts[at], int(stored_tokens[at]))
            now = (int(batch.starts[item]), int(batch.n_tokens[item]))
            if was == now and bytes(stored) == bytes(batch.src(item)):
                continue
            raise KeyCollisionError(
                f"R3 key {batch.keys[item].hex()} is already published in store "
                f"{self._store.where} with different content (tokens {was[0]}+{was[1]}, now "
                f"{now[0]}+{now[1]}). Keys must include everything that changes routing: check "
                "the weight version and the model namespace; the block hash must be the KV "
                "cache's."
            )
        return replace

    # ----------------------------------------------------------------- internals

    def _transfer(self, keys: Sequence[ObjectKey]) -> tuple[np.ndarray, np.ndarray]:
        """Fetch values into staging: ``[n, stride]`` bytes and each key's code (bytes
        read, or a negative code); failures other than a missing key raise."""
        store = self._store
        client = store.live()
        stride = store.value_stride
        count = len(keys)
        staged = self.staging.get(count * stride)[: count * stride].reshape(count, stride)
        base = staged.ctypes.data
        codes = np.array(
            client.batch_get_into(
                store.names(keys), [base + i * stride for i in range(count)], [stride] * count
            ),
            dtype=np.int64,
        )
        failed = (codes < 0) & (codes != OBJECT_NOT_FOUND)
        if failed.any():
            raise code_error(
                int(codes[failed][0]),
                f"R3 store {store.where}: read of {count} objects",
                reconnecting=store.reconnecting(),
            )
        return staged, codes

    def _envelopes(
        self, keys: Sequence[ObjectKey], staged: np.ndarray, codes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Envelope words of staged values and which are valid: present, of this key and
        layout, and exactly as long as envelope plus payload."""
        words = np.ascontiguousarray(staged[:, :HEADER_NBYTES]).view("<u8")
        key_words = keys_to_words(keys)
        payload = HeaderWords.n_tokens(words) * self._store.layout.row_nbytes
        valid = (
            (codes == HEADER_NBYTES + payload)
            & (words[:, HeaderWords.KEY0] == key_words[:, 0])
            & (words[:, HeaderWords.KEY1] == key_words[:, 1])
            & ~self._words.problems(words)
        )
        return words, valid

    def _read(self, keys: Sequence[ObjectKey], prepare: _Prepare) -> np.ndarray:
        """Transfer, copy and verify ``keys``; returns their verified envelope checksums."""
        bad: np.ndarray | None = None
        for attempt in range(_ATTEMPTS):
            staged, codes = self._transfer(keys)
            missing = codes == OBJECT_NOT_FOUND
            if missing.any():
                raise self._missing(keys, missing)
            words, valid = self._envelopes(keys, staged, codes)
            if not valid.all():
                if attempt + 1 < _ATTEMPTS:
                    continue
                self._raise_bad(keys, ~valid, "envelope does not match key and layout")
            n_tokens = HeaderWords.n_tokens(words)
            dest, offsets = prepare(n_tokens, words[:, HeaderWords.START])
            nbytes = n_tokens * self._store.layout.row_nbytes
            self._copy_out(staged, nbytes, dest, offsets)
            bad = verify_copies(dest, offsets, nbytes, words, self._words)
            if bad is None:  # (a copy: the staging buffer is the next read's)
                checksums: np.ndarray = words[:, HeaderWords.CSUM].copy()
                return checksums
        # every attempt failed; the last one reached its copy (an envelope that stays
        # invalid raised above)
        self._raise_bad(
            keys, np.ones(len(keys), dtype=bool) if bad is None else bad, "checksum mismatch"
        )

    def _copy_out(
        self, staged: np.ndarray, nbytes: np.ndarray, dest: memoryview, offsets: np.ndarray
    ) -> None:
        """Payloads to their offsets (back to back): the leading full blocks in one copy."""
        block = self._store.layout.block_nbytes
        full = nbytes == block
        lead = len(full) if full.all() else int(np.argmin(full))
        target = np.frombuffer(dest, dtype=np.uint8)
        if lead:
            start = int(offsets[0])
            target[start : start + lead * block].reshape(lead, block)[:] = staged[
                :lead, HEADER_NBYTES : HEADER_NBYTES + block
            ]
        for at, size, row in zip(
            offsets[lead:].tolist(), nbytes[lead:].tolist(), staged[lead:], strict=True
        ):
            target[at : at + size] = row[HEADER_NBYTES : HEADER_NBYTES + size]

    def _raise_bad(self, keys: Sequence[ObjectKey], bad: np.ndarray, why: str) -> NoReturn:
        """Objects that failed twice: missing if gone by now, else corrupt."""
        idx = np.flatnonzero(bad)
        present = self._store.exists([keys[i] for i in idx.tolist()])
        gone = np.zeros(len(keys), dtype=bool)
        gone[idx[~np.array(present, dtype=bool)]] = True
        if gone.any():
            raise self._missing(keys, gone, "removed or evicted while being read")
        raise self._corrupt(keys, bad, why)

    def _missing(
        self, keys: Sequence[ObjectKey], mask: np.ndarray, why: str = "evicted or never published"
    ) -> ObjectMissingError:
        idx = np.flatnonzero(mask)
        return ObjectMissingError(
            f"{len(idx)} of {len(keys)} R3 objects are not in store {self._store.where} "
            f"(first: key {keys[int(idx[0])].hex()}, {why}). Mooncake evicts unpinned objects "
            "when its segments fill, drops the objects of a client that left, and loses all "
            "of them when its master restarts."
        )

    def _corrupt(self, keys: Sequence[ObjectKey], mask: np.ndarray, why: str) -> ObjectCorruptError:
        idx = np.flatnonzero(mask)
        return ObjectCorruptError(
            f"{len(idx)} of {len(keys)} R3 objects in store {self._store.where} failed "
            f"validation (first: key {keys[int(idx[0])].hex()}: {why}); the request fails "
            "closed. Republishing the block replaces a corrupt object; if this repeats, check "
            "that nothing else writes under this key prefix."
        )
