"""Object stores: the backend-neutral contract and the /dev/shm backend."""

from vllm_artifact.core.store.contract import ObjectStore, PutItem, StoreStats
from vllm_artifact.core.store.shm import RecoveryReport, ScrubReport, ShmStore
from vllm_artifact.core.store.shm_gc import collect_expired_stores
from vllm_artifact.core.store.shm_root import (
    check_root,
    check_shm_space,
    check_store_name,
    default_root,
)

__all__ = [
    "ObjectStore",
    "PutItem",
    "RecoveryReport",
    "ScrubReport",
    "ShmStore",
    "StoreStats",
    "check_root",
    "check_shm_space",
    "check_store_name",
    "collect_expired_stores",
    "default_root",
]
