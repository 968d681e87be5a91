"""The digest a keys handle carries of its objects: what the frontend checks without payloads.

A keys-only request's handle names store objects; before the frontend answers it, it must know
those objects hold exactly the request's rows (another request may have published the same
token blocks first with other routing, and the store keeps the first). Reading the objects back
and hashing the rows does that at the cost of copying every payload. But every object's
envelope already carries an xxh3-64 checksum of its payload seeded with its key, token range
and layout (:mod:`vllm_artifact.core.envelope`), which the store checks on every read. So the
engine computes those checksums from the request's own rows, as the store will when it
publishes them, and the handle carries the xxh3-128 of that list (``R3Keys.objects_xxh3``):
the envelopes alone (64 bytes an object) then tell whether the objects are the request's.
A damaged payload under a right envelope is caught where the payload is read (the trainer's
read checks every checksum on the bytes it copies), so no request ever gets other rows.

Pure (no vLLM import): the scheduler feeds :class:`ObjectsDigest` step by step; a reader
digests the checksums its read verified (``ObjectStore.read_into`` returns them), or the
envelopes' alone (``ShmStore.envelope_checksums``); :func:`objects_digest` makes a handle's
digest from rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import xxhash

from vllm_artifact.core.envelope import HeaderWords, checksum
from vllm_artifact.core.handoff import KeysContext, RowsDigest
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import InternalError

__all__ = [
    "ObjectsDigest",
    "digest_of_checksums",
    "handle_digest",
    "objects_checksums",
    "objects_digest",
]


@lru_cache(maxsize=16)
def _header_words(layout: R3Layout) -> HeaderWords:
    return HeaderWords(layout)


def objects_checksums(
    layout: R3Layout, keys: Sequence[ObjectKey], token_start: int, payload: np.ndarray
) -> list[int]:
    """The envelope checksums the store gives objects ``keys`` holding ``payload`` (the
    objects' rows back to back, as flat bytes, from block-aligned ``token_start``): every
    object a full block but the last, which holds the rest."""
    if not keys:
        return []
    bs, row_nbytes = layout.block_size, layout.row_nbytes
    block_nbytes = bs * row_nbytes
    n = len(keys)
    last_nbytes = len(payload) - (n - 1) * block_nbytes
    if last_nbytes <= 0 or last_nbytes > block_nbytes or last_nbytes % row_nbytes:
        raise InternalError(
            f"{len(payload)} bytes of rows do not fill {n} objects of {bs} rows "
            f"({row_nbytes} bytes a row), the last partly"
        )
    counts = np.full(n, bs, dtype=np.int64)
    counts[-1] = last_nbytes // row_nbytes
    starts = token_start + np.arange(n, dtype=np.int64) * bs
    seeds = _header_words(layout).seeds_for(keys_to_words(keys), starts, counts)
    data = payload.data
    views = [data[at : at + block_nbytes] for at in range(0, len(payload), block_nbytes)]
    return list(map(checksum, views, seeds))


def digest_of_checksums(checksums: Sequence[int] | np.ndarray) -> str:
    """xxh3-128 (hex) of the objects' checksums in token order, as little-endian uint64."""
    return xxhash.xxh3_128_hexdigest(np.array(checksums, dtype="<u8").tobytes())


def objects_digest(
    layout: R3Layout, keys: Sequence[ObjectKey], token_start: int, rows: np.ndarray
) -> str:
    """The digest of objects ``keys`` holding ``rows`` (tokens from ``token_start``)."""
    payload = np.ascontiguousarray(rows, dtype=layout.dtype).reshape(-1).view(np.uint8)
    return digest_of_checksums(objects_checksums(layout, keys, token_start, payload))


class ObjectsDigest:
    """:func:`objects_digest` of a request's objects, fed its rows step by step.

    ``keys`` is the request's list of full-block keys from block 0, which the caller extends
    as the KV cache hashes new blocks (a block's rows are complete only once its tokens all
    are, so its key exists by then; a block whose key comes later waits here). Rows start at
    the block-aligned ``token_start``; each full block is checksummed once, so the rows are
    not kept: the block in progress fills a buffer of its own. A decode step's row is one
    slice assignment, and one checksum a block (this runs per request per step on the
    scheduler's thread).
    """

    def __init__(self, layout: R3Layout, token_start: int, keys: list[ObjectKey]) -> None:
        if token_start % layout.block_size:
            raise InternalError(f"objects start at a block boundary, not token {token_start}")
        self.layout = layout
        self.token_start = token_start
        self.rows = 0
        self._keys = keys
        self._bs = layout.block_size
        self._next_block = token_start // layout.block_size  # the first not checksummed
        self._block = layout.empty(layout.block_size)  # the block in progress ...
        self._filled = 0  # ... and its rows so far
        self._waiting: list[np.ndarray] = []  # full blocks whose keys are not made yet
        self._sums: list[int] = []

    def add(self, rows: np.ndarray) -> None:
        """The request's next rows, in token order."""
        n, bs = len(rows), self._bs
        self.rows += n
        if self._waiting:
            self._drain()
        if self._filled:
            take = min(bs - self._filled, n)
            self._block[self._filled : self._filled + take] = rows[:take]
            self._filled += take
            if self._filled < bs:
                return  # a decode step, but one in a block's worth
            self._filled = 0
            self._complete(self._block)
            rows = rows[take:]
        full = len(rows) // bs * bs
        if full:
            self._complete(rows[:full])
        if full < len(rows):
            self._filled = len(rows) - full
            self._block[: self._filled] = rows[full:]

    def _complete(self, blocks: np.ndarray) -> None:
        """Checksum full ``blocks`` (rows) now, or keep a copy until their keys exist."""
        if self._waiting or len(self._keys) - self._next_block < len(blocks) // self._bs:
            self._waiting.append(blocks.copy())
            self._drain()
            return
        self._checksum(blocks)

    def _checksum(self, blocks: np.ndarray) -> None:
        first, n = self._next_block, len(blocks) // self._bs
        if n == 1:
            seed = _header_words(self.layout).seed_of(self._keys[first], first * self._bs, self._bs)
            self._sums.append(checksum(np.ascontiguousarray(blocks).data, seed))
        else:
            payload = np.ascontiguousarray(blocks).reshape(-1).view(np.uint8)
            keys = self._keys[first : first + n]
            self._sums += objects_checksums(self.layout, keys, first * self._bs, payload)
        self._next_block += n

    def _drain(self) -> None:
        """Checksum the waiting blocks whose keys exist now, in order."""
        while self._waiting:
            blocks = self._waiting[0]
            ready = min(len(self._keys) - self._next_block, len(blocks) // self._bs)
            if ready <= 0:
                return
            self._checksum(blocks[: ready * self._bs])
            if ready * self._bs < len(blocks):
                self._waiting[0] = blocks[ready * self._bs :]
            else:
                self._waiting.pop(0)

    def finish(self, tail_key: ObjectKey | None) -> str:
        """The digest, once every row is in: the full blocks' checksums, then the terminal
        partial block's (``tail_key``, None if the rows end on a block boundary)."""
        self._drain()
        if self._waiting or (tail_key is None) != (self._filled == 0):
            raise InternalError(
                f"{self._filled} rows after block {self._next_block}, "
                f"{sum(map(len, self._waiting))} rows without keys ({len(self._keys)} block "
                f"keys), {'a' if tail_key else 'no'} tail key"
            )
        sums = self._sums
        if tail_key is not None:
            seed = _header_words(self.layout).seed_of(
                tail_key, self._next_block * self._bs, self._filled
            )
            sums = [*sums, checksum(self._block[: self._filled].data, seed)]
        return digest_of_checksums(sums)


def handle_digest(
    context: KeysContext | None, block_size: int | None, token_start: int, keys: list[ObjectKey]
) -> RowsDigest | ObjectsDigest:
    """The digest a keys handle will carry of a request's rows from ``token_start``: of its
    objects' envelope checksums where they start at a block boundary (the frontend then
    checks the handle without reading payloads), else of the rows themselves."""
    if context is None or block_size is None or token_start % block_size:
        return RowsDigest()
    return ObjectsDigest(context.layout, token_start, keys)
