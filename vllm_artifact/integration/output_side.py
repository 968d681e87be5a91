"""Rank zero's output side: the store, its publisher and the request tracker, opened from one
picklable :class:`OutputSetup`.

The worker connector opens it in the engine process (``--artifact-tracker engine``) or hands
the setup to the tracker process (``--artifact-tracker process``, ``tracker_process.py``),
which opens the very same objects there. No vLLM import: the tracker process must start
without loading vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_artifact.core.publisher import MEMORY_STORE_INLINE_FROM_BLOCKS, Publisher
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ObjectStore, ShmStore
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.engine_store import EngineStore, open_backend
from vllm_artifact.integration.kv_events import eviction_id

__all__ = ["OutputSetup", "OutputSide", "open_output_side"]

logger = logging.getLogger("vllm.artifact.worker")


@dataclass(frozen=True)
class OutputSetup:
    """What rank zero's output side is opened from (worked out by the worker connector from
    vLLM's configs and the KV cache's layout)."""

    config: ArtifactConfig
    #: Name prefix of every store of this model and layout (its engines, its DP ranks).
    family: str
    dp_rank: int
    layout: R3Layout
    model_id: str
    capacity: int
    #: Blocks a prefix hit can be served from (KV cache and offloaded KV), in hash blocks.
    kv_hash_blocks: int
    buffer_max_bytes: int


@dataclass
class OutputSide:
    """The open store, its publisher and the tracker that feeds both."""

    engine_store: EngineStore
    publisher: Publisher
    tracker: RequestTracker

    @property
    def store(self) -> ObjectStore:
        return self.engine_store.store

    def close(self) -> None:
        self.publisher.close()
        self.engine_store.close()


def open_output_side(setup: OutputSetup) -> OutputSide:
    """Open the store (``setup.config``'s backend) with its publisher and tracker."""
    config = setup.config
    engine_store = open_backend(
        config,
        family=setup.family,
        dp_rank=setup.dp_rank,
        layout=setup.layout,
        capacity=setup.capacity,
    )
    store = engine_store.store
    # A memory store's large batches are written inline (core/publisher.py says why).
    publisher = Publisher(
        store,
        inline_from_blocks=MEMORY_STORE_INLINE_FROM_BLOCKS if store.writes_local_memory else None,
    )
    tracker = RequestTracker(
        setup.layout,
        setup.model_id,
        store,
        publisher,
        buffer_max_bytes=setup.buffer_max_bytes,
        block_id=eviction_id,
        lease_seconds=config.keys_lease_seconds,
        # With /dev/shm, KV hits on blocks another engine of this node computed (a PD
        # producer, a shared KV tier) read their R3 from that engine's store.
        node_stores=engine_store.node_stores,
    )
    logger.info(
        "vllm-artifact: R3 store %s (%s) capacity=%.1f MiB ttl=%.0f s "
        "(KV, offloaded KV included, holds %d blocks of %d tokens) namespace: %s; tracker %s",
        engine_store.address.describe(),
        config.backend,
        setup.capacity / 2**20,
        config.ttl_seconds,
        setup.kv_hash_blocks,
        setup.layout.block_size,
        tracker.namespace.describe(),
        config.tracker,
    )
    if isinstance(store, ShmStore):
        _log_shm_store(store, setup.capacity, setup.kv_hash_blocks)
    return OutputSide(engine_store, publisher, tracker)


def _log_shm_store(store: ShmStore, capacity: int, kv_hash_blocks: int) -> None:
    """What a restarted engine recovered, and a capacity below the KV cache's R3."""
    recovery = store.recovery
    if recovery is not None and (recovery.objects or recovery.recreated):
        logger.info(
            "vllm-artifact: R3 store %s: %s; %d objects kept, %d half-written and %d "
            "invalid slots dropped",
            store.name,
            recovery.reason,
            recovery.objects,
            recovery.dropped_partial,
            recovery.dropped_invalid,
        )
    slots = store.geometry.slot_count
    if slots < kv_hash_blocks:
        logger.warning(
            "vllm-artifact: --artifact-capacity %.1f MiB holds %d R3 blocks but the KV cache "
            "can hold %d: a prefix hit on an evicted object fails that request; raise "
            "--artifact-capacity (or use auto) to avoid it",
            capacity / 2**20,
            slots,
            kv_hash_blocks,
        )
