"""Which store an engine writes: one per model, R3 layout and DP rank, reused across restarts.

Backend ``shm``:

The store's name (``r3-<digest of model and layout>-dp<rank>``) is the same for every start of
the same engine, so a restarted engine takes its predecessor's store over and its objects stay
readable. A second live engine of the same model on the same root cannot share a store (one
writer each); it takes the first of ``<name>-2``, ``<name>-3``, ... whose writer is gone, so a
restarted second engine also takes its own predecessor's (or any dead sibling's) store over
instead of leaving a new full-capacity arena behind on every start.

Backend ``mooncake``: the same name is the engine's key prefix in the Mooncake Store (one
live engine per model and DP rank per master: the prefix's pins are its writer's), and the
engine's capacity is the memory it adds to the store as its segment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from vllm_artifact.client.reader import host_address
from vllm_artifact.core.handoff import StoreAddress
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ObjectStore, ShmStore, check_shm_space
from vllm_artifact.core.store.node_stores import NodeStores
from vllm_artifact.core.store.shm_arena import ARENA_NAME
from vllm_artifact.core.store.shm_metrics import StoreMetrics
from vllm_artifact.errors import WriterConflictError
from vllm_artifact.integration.config import ArtifactConfig

logger = logging.getLogger("vllm.artifact.worker")

#: The smallest segment a Mooncake client may add to the store.
MOONCAKE_MIN_SEGMENT = 16 * 2**20
#: Live engines of one model and DP rank that may share a root.
MAX_ENGINES_PER_ROOT = 16


def store_names(base: str) -> list[str]:
    """The names an engine tries, in order."""
    return [base, *(f"{base}-{i}" for i in range(2, MAX_ENGINES_PER_ROOT + 1))]


def open_engine_store(
    root: Path | str, base: str, *, layout: R3Layout, capacity_bytes: int, ttl_seconds: float
) -> ShmStore:
    """Open the first store of :func:`store_names` that has no live writer."""
    for name in store_names(base):
        try:
            return ShmStore.create_or_open_writer(
                root, name, layout=layout, capacity_bytes=capacity_bytes, ttl_seconds=ttl_seconds
            )
        except WriterConflictError:
            logger.info("vllm-artifact: store %s has a live writer; trying the next name", name)
    raise WriterConflictError(
        f"{MAX_ENGINES_PER_ROOT} live engines of this model already write stores named {base} "
        f"under {root}; give this engine its own --artifact-root"
    )


@dataclass
class EngineStore:
    """An engine's open store, where keys handles find it, and (``shm``) the node's other
    stores of its family, which KV hits on blocks other engines computed read."""

    store: ObjectStore
    address: StoreAddress
    node_stores: NodeStores | None = None

    def close(self) -> None:
        if self.node_stores is not None:
            self.node_stores.close()
        self.store.close()


def open_backend(
    config: ArtifactConfig, *, family: str, dp_rank: int, layout: R3Layout, capacity: int
) -> EngineStore:
    """The engine's store on the configured backend (``family``: the name prefix of every
    store of the model and layout; this engine's base name is ``family`` + its DP rank)."""
    base = f"{family}{dp_rank}"
    if config.backend == "mooncake":
        from vllm_artifact.core.store.mooncake import MooncakeStore

        master, metadata = str(config.mooncake_master), config.mooncake_metadata
        store = MooncakeStore.connect(
            master_address=master,
            metadata_url=metadata,
            local_hostname=config.mooncake_host or host_address(),
            layout=layout,
            key_prefix=base,
            segment_bytes=mooncake_segment(config, capacity),
            local_buffer_bytes=config.mooncake_buffer,
        )
        # Its counters live on this node, under the root, where /metrics reads every store's.
        store.metrics = StoreMetrics.create_in(str(config.root), base)
        return EngineStore(
            store, StoreAddress(backend="mooncake", root=master, name=base, metadata=metadata)
        )
    # A restarted engine reuses or replaces its own arena: its bytes count as free.
    own_arena = config.root / base / ARENA_NAME
    reclaimable = own_arena.stat().st_size if own_arena.is_file() else 0
    check_shm_space(config.root, capacity, reclaimable_bytes=reclaimable)
    shm = open_engine_store(
        config.root, base, layout=layout, capacity_bytes=capacity, ttl_seconds=config.ttl_seconds
    )
    record_weight_version(shm, DEFAULT_WEIGHT_VERSION)
    return EngineStore(
        shm, StoreAddress(root=str(shm.root), name=shm.name), NodeStores(shm, family)
    )


def mooncake_segment(config: ArtifactConfig, capacity: int) -> int:
    """The memory the engine adds to the Mooncake Store: none with ``0`` (objects go to store
    nodes), else the capacity, at least the 16 MiB Mooncake accepts."""
    if config.mooncake_segment == "auto":
        return max(capacity, MOONCAKE_MIN_SEGMENT)
    return config.mooncake_segment and max(config.mooncake_segment, MOONCAKE_MIN_SEGMENT)


def record_weight_version(store: ObjectStore, version: str) -> None:
    """Let other engines see which weight versions a /dev/shm store's objects are keyed under
    (it only sharpens their error messages: a failure is logged, never raised)."""
    if not isinstance(store, ShmStore):
        return
    try:
        store.record_weight_version(version)
    except Exception:
        logger.warning(
            "vllm-artifact: weight version %r not recorded in store %s",
            version,
            store.name,
            exc_info=True,
        )
