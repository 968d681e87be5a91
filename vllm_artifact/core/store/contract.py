"""Backend-neutral object-store contract.

An object is the R3 rows of one KV block (``[n_tokens, layers, top_k]``,
``1 <= n_tokens <= block_size``) published under an :class:`ObjectKey` with a
token start (a block boundary). Objects are immutable: publishing a key again
is accepted only with identical content. Nothing here knows about requests or
the scheduler: which keys a request's tokens have, and when their blocks are
published or read, is decided by the callers (the per-request tracker and its
background publisher in :mod:`vllm_artifact.core`, the keys-handle reader in
:mod:`vllm_artifact.client`).

Who may call what
-----------------
* **Writer handle** (exactly one per store; vLLM's global rank zero): every
  method. Calls are serialized internally, so one background publisher thread
  plus other threads of the same process are fine.
* **Reader handles** (any number, any process of the same user on the node):
  ``exists``, ``get``, ``read_into``, ``stats``, ``close``. Mutating calls
  (``put``, ``pin``, ``unpin``) raise :class:`StoreReadOnlyError`.
* After ``close`` every call raises :class:`StoreClosedError`.

Failure semantics: reads fail closed with typed errors
(:class:`ObjectMissingError`, :class:`ObjectCorruptError`); they never return
partial or zero-filled data. ``put`` is atomic per object (a reader sees an
object entirely or not at all), not per batch: on an error, earlier objects of
the batch may be published, later ones are not.

Capacity and pins: unpinned objects may be evicted (least recently used first)
when space is needed. Pinned objects (refcounted; the integration pins what
the KV cache can still hit) are never evicted; :class:`CapacityError` is raised
only when pinned objects alone leave no room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar, NamedTuple

import numpy as np

from vllm_artifact.core.keys import ObjectKey
from vllm_artifact.core.schema import R3Layout

__all__ = ["ObjectStore", "PutItem", "StoreStats"]


class PutItem(NamedTuple):
    """One object to publish: rows ``[n_tokens, layers, top_k]`` at ``token_start``."""

    key: ObjectKey
    rows: np.ndarray
    token_start: int


@dataclass(frozen=True)
class StoreStats:
    """Counters of one store handle (object counts are store-wide)."""

    objects: int
    bytes_used: int
    capacity_bytes: int
    capacity_objects: int
    pinned_objects: int
    evictions: int
    writable: bool


class ObjectStore(ABC):
    """Contract every R3 object-store backend follows (see module docstring)."""

    #: Writes are copies into this host's memory that never wait on a network or another
    #: process, so the engine writes large batches inline, on its step thread
    #: (``core/publisher.py``).
    writes_local_memory: ClassVar[bool] = False
    #: :meth:`envelope_checksums` reads objects' envelopes without their payloads.
    reads_envelopes: ClassVar[bool] = False

    @property
    @abstractmethod
    def layout(self) -> R3Layout:
        """The R3 layout every object of this store follows."""

    @abstractmethod
    def put(
        self, items: Sequence[PutItem | tuple[ObjectKey, np.ndarray, int]], *, pin: bool = True
    ) -> None:
        """Publish objects. Existing keys must carry identical content
        (:class:`KeyCollisionError` otherwise). With ``pin`` every item, new
        or existing, gains one pin reference."""

    def put_blocks(
        self, keys: Sequence[ObjectKey], rows: np.ndarray, token_start: int, *, pin: bool = True
    ) -> None:
        """Publish consecutive blocks of one rows array: ``rows[i*bs:(i+1)*bs]``
        under ``keys[i]`` starting at ``token_start`` (the last may be shorter).

        Same semantics as :meth:`put`; backends override it with a faster path.
        """
        self.put_runs([(keys, rows, token_start)], pin=pin)

    def put_runs(
        self,
        runs: Sequence[tuple[Sequence[ObjectKey], np.ndarray, int]],
        *,
        pin: bool = True,
    ) -> None:
        """Publish several :meth:`put_blocks` runs ``(keys, rows, token_start)`` as one batch
        (the usual step of the publisher: one run per request).

        Same semantics as :meth:`put` of all their blocks; backends override it with a
        faster path.
        """
        block_size = self.layout.block_size
        self.put(
            [
                PutItem(
                    key,
                    rows[i * block_size : (i + 1) * block_size],
                    token_start + i * block_size,
                )
                for keys, rows, token_start in runs
                for i, key in enumerate(keys)
            ],
            pin=pin,
        )

    @abstractmethod
    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is published (envelope checked, payload not hashed)."""

    def envelope_checksums(self, keys: Sequence[ObjectKey]) -> list[int] | None:
        """Each object's envelope checksum, read without its payload (the frontend's check
        of a keys handle, ``core/objects_digest.py``), or None if any is not published.
        Only backends with :attr:`reads_envelopes`."""
        raise NotImplementedError(f"{type(self).__name__} does not read envelopes alone")

    @abstractmethod
    def get(self, keys: Sequence[ObjectKey]) -> list[np.ndarray]:
        """Validated copies of the objects' rows, in order; raises if any fails."""

    @abstractmethod
    def read_into(
        self, keys: Sequence[ObjectKey], out: np.ndarray, *, token_start: int = 0
    ) -> np.ndarray:
        """Gather objects that tile ``out`` back to back; returns their envelope checksums
        (uint64, in key order), each verified on the bytes written to ``out``.

        Object ``i`` must start at ``token_start`` plus the tokens of objects
        ``0..i-1`` and all objects together must fill ``out`` exactly; every
        envelope and checksum is verified on the bytes written to ``out``.
        """

    @abstractmethod
    def pin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Add one pin reference per key; returns which keys were present."""

    @abstractmethod
    def unpin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Drop one pin reference per key; returns which keys were pinned."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """Usage counters."""

    @abstractmethod
    def close(self) -> None:
        """Release the handle (idempotent). Published objects stay for readers."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
