"""Rows of KV-cache hits for rank zero's tracker: read from the store, verified, never partial.

A request whose prefix the KV cache served (a local prefix hit, KV offload, or KV another
engine computed and a KV connector delivered) gets the R3 of those tokens from the store its
blocks were published to. With the node's stores (:class:`~.store.node_stores.NodeStores`),
blocks this engine never computed are read from the engine that did and *adopted*: published
into this engine's store and pinned for the KV blocks that now hold them here, so a later hit
does not depend on the other engine keeping them. A block found nowhere fails the request
closed; found only under other weights, with both weight versions named.
"""

from __future__ import annotations

import numpy as np

from vllm_artifact.core.buffer import copy_blocks, copy_rows_into
from vllm_artifact.core.keys import Namespace, ObjectKey
from vllm_artifact.core.publisher import BlockRun, PinChange
from vllm_artifact.core.request_state import RequestState
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_publication import StepPublication
from vllm_artifact.core.store.contract import ObjectStore
from vllm_artifact.core.store.node_stores import NEVER_MIXED, NodeStores
from vllm_artifact.errors import ArtifactError, NotOnNodeError, WeightVersionMismatchError

__all__ = ["HitReads", "StepReads"]

#: A step's whole-block store reads: (first token, keys) -> the rows read (and verified).
StepReads = dict[tuple[int, tuple[ObjectKey, ...]], np.ndarray]


class HitReads:
    """The tracker's store reads (same owner thread as the tracker)."""

    def __init__(
        self,
        layout: R3Layout,
        store: ObjectStore,
        publication: StepPublication,
        node_stores: NodeStores | None = None,
    ) -> None:
        self._layout = layout
        self._store = store
        self._publication = publication
        self._node_stores = node_stores
        self.reads = 0  # objects read for KV-cache hits
        self.adopted = 0  # ... of them read from another engine's store and adopted

    def read_span(
        self,
        state: RequestState,
        start: int,
        out: np.ndarray,
        namespace: Namespace,
        step_reads: StepReads | None = None,
    ) -> None:
        """Rows ``[start, start + len(out))`` from the store into ``out`` (KV-cache hits;
        fails closed).

        With ``step_reads`` (this step's whole-block reads so far), requests of one step with
        the same prefix hit (a shared prompt, a group of samples of one prompt) copy the rows
        the first of them read and verified instead of reading them again: a store read has
        a fixed cost of some 40 small numpy calls."""
        block_size = self._layout.block_size
        end = start + len(out)
        first, last = start // block_size, -(-end // block_size)
        if last > len(state.keys):
            raise ArtifactError(
                f"the KV cache served tokens up to {end} but only "
                f"{len(state.keys) * block_size} have block hashes; R3 for them cannot be "
                "located"
            )
        keys = state.keys[first:last]
        # Whole blocks (the usual prefix hit)?
        whole = start == first * block_size and end == last * block_size
        span = (start, tuple(keys))
        if whole and step_reads is not None and (earlier := step_reads.get(span)) is not None:
            copy_blocks(out, earlier, block_size)
            return
        self._publication.flush(keys)  # only if some are still queued
        if whole:
            self._read_blocks(state, first, keys, out, namespace)
            if step_reads is not None:
                step_reads[span] = out
        else:
            blocks = self._layout.empty((last - first) * block_size)
            self._read_blocks(state, first, keys, blocks, namespace)
            copy_rows_into(out, blocks[start - first * block_size : end - first * block_size])
        self.reads += last - first

    def _read_blocks(
        self,
        state: RequestState,
        first: int,
        keys: list[ObjectKey],
        out: np.ndarray,
        namespace: Namespace,
    ) -> None:
        """Rows of the request's blocks ``first, first + 1, ...`` (``keys``) into ``out``.

        With the node's stores, blocks this engine's store lacks are read from another
        engine's store of the node (its KV arrived through a KV connector) and adopted: they
        are published into this engine's store, pinned for the KV blocks that now hold them
        here, like blocks it computed itself."""
        node = self._node_stores
        token_start = first * self._layout.block_size
        if node is None:
            self._store.read_into(keys, out, token_start=token_start)
            return
        try:
            adopted = node.read_into(
                keys, out, token_start=token_start, weight_version=namespace.weight_version
            )
        except NotOnNodeError as error:
            raise self._other_weights(state, first, error, namespace) or error from None
        if not adopted:
            return
        block_size = self._layout.block_size
        runs: list[BlockRun | PinChange] = []
        pins: list[ObjectKey] = []
        for start, end in adopted:
            rows = out[start * block_size : end * block_size]
            runs.append(BlockRun(keys[start:end], rows, (first + start) * block_size))
            pins += [
                keys[i] for i in range(start, end) if self._publication.claim_pin(state, first + i)
            ]
            self.adopted += end - start
        if pins:
            runs.append(PinChange(pins, pin=True))
        self._publication.submit(runs)

    def _other_weights(
        self, state: RequestState, first: int, error: NotOnNodeError, namespace: Namespace
    ) -> WeightVersionMismatchError | None:
        """The error to give when a store of the node holds the first absent block under
        another weight version (the engine that computed its KV runs other weights)."""
        if self._node_stores is None or not error.absent:
            return None
        index = first + error.absent[0]
        if index >= len(state.hashes):
            return None
        holder = self._node_stores.version_holding(namespace, state.hashes[index])
        if holder is None:
            return None
        store, version = holder
        return WeightVersionMismatchError(
            f"the KV of tokens from {index * self._layout.block_size} was computed under "
            f"weight version {version!r} (R3 in store {store.root}/{store.name}), but this "
            f"engine runs weight version {namespace.weight_version!r}. {NEVER_MIXED}"
        )
