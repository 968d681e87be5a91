"""Reads that follow the KV across the engines of one node, key by key.

A KV connector can hand an engine KV blocks another engine computed (a prefill/decode
producer's shared storage, an offload or cache tier shared by several engines). Their R3 is
in the store of the engine that computed them. Objects are content-addressed (a key binds
model, R3 layout, weight version and KV block hash), so an object under the same key in any
store under the same root is the R3 of exactly those tokens: :class:`NodeStores` reads this
engine's store first and, only for the keys it lacks, the other stores of the same *family*
(the stores of one model and layout share a name prefix, see
``integration/engine_store.py``), live or left behind by a stopped engine.

Other stores are opened read-only and read lock-free (seqlock and checksums,
:mod:`.shm_read`): reading never blocks or slows their writers. A handle whose store was
removed or replaced is dropped before the next search (it would keep the old arena's memory
allocated); a key found nowhere fails the read with :class:`NotOnNodeError`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np

from vllm_artifact.core.keys import Namespace, ObjectKey, full_block_key
from vllm_artifact.core.store.shm import ShmStore
from vllm_artifact.core.store.shm_root import check_store_name
from vllm_artifact.errors import (
    ArtifactError,
    NotOnNodeError,
    ObjectMissingError,
    StoreError,
    WeightVersionMismatchError,
)

__all__ = ["NEVER_MIXED", "NodeStores"]

logger = logging.getLogger("vllm.artifact.store")

#: What a weight-version mismatch between engines that share KV means, and what to do.
NEVER_MIXED = (
    "R3 of different weights is never mixed. Update the weights (and weight version) of every "
    "engine that shares KV, e.g. both engines of a prefill/decode pair, together."
)


class NodeStores:
    """One engine's store plus read-only handles on its family's other stores (one owner
    thread; not thread-safe)."""

    def __init__(self, own: ShmStore, family: str) -> None:
        self.own = own
        self.family = family
        self._others: dict[str, ShmStore] = {}

    def read_into(
        self, keys: Sequence[ObjectKey], out: np.ndarray, *, token_start: int, weight_version: str
    ) -> list[tuple[int, int]]:
        """``ObjectStore.read_into`` over the node: every key from this engine's store if it
        has it, else from another store of the family whose writer runs ``weight_version``
        (this engine's). Returns the ranges ``[a, b)`` of ``keys`` read from other stores (to
        adopt them). Keys tile ``out`` as full blocks (the last may be shorter).

        A key found only in a store whose writer now runs other weights raises
        :class:`WeightVersionMismatchError` naming both versions: that engine's KV (the KV
        this engine was handed) is of other weights than the R3 it still holds under ours."""
        try:
            self.own.read_into(keys, out, token_start=token_start)
            return []
        except ObjectMissingError:
            pass
        sources = self._locate(keys, token_start, weight_version)
        absent = [i for i, source in enumerate(sources) if source is None]
        if absent:
            raise self._not_on_node(keys, absent, token_start)
        block_size = self.own.layout.block_size
        adopted: list[tuple[int, int]] = []
        for start, end, store in _runs(sources):
            rows = out[start * block_size : min(end * block_size, len(out))]
            try:
                store.read_into(keys[start:end], rows, token_start=token_start + start * block_size)
            except ObjectMissingError as error:  # evicted or removed since it was located
                raise NotOnNodeError(
                    f"R3 objects left store {store.root}/{store.name} while being read: {error}",
                    absent=(start,),
                ) from None
            if store is not self.own:
                adopted.append((start, end))
        return adopted

    def version_holding(
        self, namespace: Namespace, block_hash: bytes
    ) -> tuple[ShmStore, str] | None:
        """Another store of the family holding the full block ``block_hash`` under another
        weight version than ``namespace``'s, and that version (None if none does). This
        engine's own store is not asked: its older versions are its own stale prefix cache."""
        for store in self._others.values():
            for version in reversed(store.weight_versions()):
                if version == namespace.weight_version:
                    continue
                try:
                    key = full_block_key(
                        Namespace(namespace.model_id, namespace.layout, version), block_hash
                    )
                    if store.exists([key])[0]:
                        return store, version
                except ArtifactError:
                    continue  # a version our keys cannot carry, a store closed meanwhile
        return None

    def close(self) -> None:
        """Drop the handles on other stores (this engine's own store is its writer's)."""
        for store in self._others.values():
            store.close()
        self._others.clear()

    @property
    def others(self) -> list[str]:
        """Names of the other stores currently open."""
        return sorted(self._others)

    # -------------------------------------------------------------- internals

    def _locate(
        self, keys: Sequence[ObjectKey], token_start: int, weight_version: str
    ) -> list[ShmStore | None]:
        """Which store holds each key (this engine's first), None where none does."""
        sources: list[ShmStore | None] = [
            self.own if present else None for present in self.own.exists(keys)
        ]
        self._refresh()
        for store in self._others.values():
            wanted = [i for i, source in enumerate(sources) if source is None]
            if not wanted:
                break
            try:
                found = store.exists([keys[i] for i in wanted])
            except StoreError:
                continue
            if not any(found):
                continue
            current = store.weight_versions()[-1:]
            if current and current[0] != weight_version:
                first = wanted[found.index(True)]
                raise WeightVersionMismatchError(
                    f"the R3 of tokens from {token_start + first * self.own.layout.block_size} "
                    f"is in store "
                    f"{store.root}/{store.name} under this engine's weight version "
                    f"{weight_version!r}, but that store's engine now runs weight version "
                    f"{current[0]!r}: the KV it hands over is of other weights. {NEVER_MIXED}"
                )
            for i, present in zip(wanted, found, strict=True):
                if present:
                    sources[i] = store
        return sources

    def _refresh(self) -> None:
        """Open the family's stores that appeared, drop those removed or replaced."""
        for name, store in list(self._others.items()):
            if not store.is_current():
                store.close()
                del self._others[name]
        try:
            names = [entry.name for entry in os.scandir(self.own.root)]
        except OSError:
            return
        for name in sorted(names):
            if name == self.own.name or name in self._others or not name.startswith(self.family):
                continue
            try:
                check_store_name(name)
                store = ShmStore.open_reader(self.own.root, name)
            except StoreError:
                continue  # starting, failed or not a store: it holds nothing to read yet
            if store.layout != self.own.layout:
                store.close()  # another layout under a colliding name: never ours to read
                continue
            self._others[name] = store
            logger.info("vllm-artifact: reading R3 also from store %s/%s", store.root, name)

    def _not_on_node(
        self, keys: Sequence[ObjectKey], absent: list[int], token_start: int
    ) -> NotOnNodeError:
        block_size = self.own.layout.block_size
        first = absent[0]
        searched = [self.own.name, *self._others]
        evictions = self.own.stats().evictions
        capacity = (
            f" This engine's store evicted {evictions} objects so far; if these were among "
            "them, increase --artifact-capacity."
            if evictions
            else ""
        )
        return NotOnNodeError(
            f"{len(absent)} of {len(keys)} R3 objects (first: key {keys[first].hex()}, tokens "
            f"from {token_start + first * block_size}) are in no R3 store of this model under "
            f"{self.own.root} on this node ({len(searched)} searched: {', '.join(searched)}): "
            "removed or evicted from this engine's store, or, if a KV connector brought their "
            "KV from another engine, that engine runs on another node (the /dev/shm store "
            "serves R3 only between engines of one node), uses another --artifact-root, model "
            f"path or layout, or its store lost them.{capacity}",
            absent=tuple(absent),
        )


def _runs(sources: list[ShmStore | None]) -> Iterator[tuple[int, int, ShmStore]]:
    """Maximal runs ``[start, end)`` of consecutive keys from one store."""
    start = 0
    for i in range(1, len(sources) + 1):
        if i == len(sources) or sources[i] is not sources[start]:
            store = sources[start]
            if store is not None:
                yield start, i, store
            start = i
