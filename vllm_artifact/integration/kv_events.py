"""The ids vLLM's KV cache events give blocks, so rank zero can unpin exactly their objects.

``BlockRemoved.block_hashes`` carries, per evicted block, its hash's last 8 bytes as a
big-endian int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default) or the raw hash bytes;
:func:`eviction_id` maps both, and a block hash rank zero keyed a block under, to one 64-bit
id. No vLLM import: rank zero's tracker takes :func:`eviction_id` as its ``block_id``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["eviction_id", "eviction_ids"]

_ID_MASK = (1 << 64) - 1


def eviction_id(block_hash: bytes | int) -> int:
    """The 64-bit id of a KV block: its hash's last 8 bytes, big endian (vLLM's int ids
    already are; raw hashes map to the same id)."""
    if isinstance(block_hash, int):
        return block_hash & _ID_MASK
    return int.from_bytes(bytes(block_hash)[-8:], "big")


def eviction_ids(block_hashes: Sequence[bytes | int]) -> list[int]:
    """:func:`eviction_id` of each hash of a KV event. vLLM's default ints already are their
    ids (64-bit), which ``min``/``max`` confirm in C; a call per hash, for hundreds of evictions
    a step, would cost more (benchmarks/bench_connector_step.py --workload prefill)."""
    if not block_hashes:
        return []
    try:
        if min(block_hashes) >= 0 and max(block_hashes) <= _ID_MASK:  # type: ignore[operator]
            return list(block_hashes)  # type: ignore[arg-type]
    except TypeError:  # raw bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
        pass
    return [eviction_id(h) for h in block_hashes]
