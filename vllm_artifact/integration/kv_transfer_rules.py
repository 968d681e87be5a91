"""Which KV connectors and roles R3 supports, decided at startup from ``--kv-transfer-config``.

R3 of KV another engine computed is read from that engine's store (see
``core/store/node_stores.py``), which lives under ``/dev/shm`` on the node that computed it.
So:

* ``kv_both`` connectors (KV offload, caches an engine writes and reads itself) work with any
  connector: the KV an engine loads back is KV it (or an earlier start of it) computed;
* prefill/decode roles (``kv_producer``, ``kv_consumer``) work with connectors that move KV
  between engines of one node: vLLM's shared-storage ``ExampleConnector``, verified end to end;
* connectors built to move KV between nodes (NIXL, Mooncake, MoRIIO, LMCache, ...) in those
  roles are refused: their consumer would run where the producer's R3 cannot be read. Other
  connectors in those roles are refused as not verified.

A shared-storage path on a network file system can join engines on different nodes; that is
only a warning (the engines may well share a node), and such a request fails closed with the
reason when its R3 is not on the node.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_artifact.errors import ArtifactConfigError

__all__ = ["check_kv_transfer", "cross_node_message"]

logger = logging.getLogger("vllm.artifact")

#: Connectors that move KV between engines of one node in PD roles, verified with R3.
SAME_NODE_PD_CONNECTORS = frozenset({"ExampleConnector"})
#: Connectors (vLLM 0.32's names) built to move KV between engines on different nodes.
CROSS_NODE_CONNECTORS = frozenset(
    {
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "MoRIIOConnector",
        "MooncakeConnector",
        "MooncakeStoreConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "HF3FSKVConnector",
        "FlexKVConnectorV1",
        "P2pNcclConnector",
    }
)
_NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "9p")

_SUPPORTED = (
    "R3 with prefill/decode disaggregation works between engines of one node: kv_connector "
    "'ExampleConnector' (shared storage) in kv_producer / kv_consumer roles, every engine with "
    "the same model path and --artifact-root; any connector works with kv_role 'kv_both' "
    "(e.g. --kv-offloading-size). Otherwise drop --enable-routed-experts on this deployment."
)
_CROSS_NODE = (
    "--enable-routed-experts with --kv-transfer-config {connector} (kv_role={role!r}): this "
    "connector moves KV between engines on different nodes, but the R3 of that KV stays in "
    "the /dev/shm store of the node that computed it, which an engine on another node cannot "
    "read. " + _SUPPORTED
)
_UNVERIFIED = (
    "--enable-routed-experts with --kv-transfer-config {connector} (kv_role={role!r}): R3 "
    "with this connector in a prefill/decode role has not been verified. " + _SUPPORTED
)


def cross_node_message(connector: str, role: str) -> str:
    """The refusal of a cross-node connector in a PD role (also for vLLM's own refusal)."""
    return _CROSS_NODE.format(connector=connector, role=role)


def check_kv_transfer(kv_transfer_config: Any) -> None:
    """Refuse KV connector settings R3 cannot serve (see module docstring)."""
    if kv_transfer_config is None:
        return
    connector, role, extra = _fields(
        kv_transfer_config, "kv_connector", "kv_role", "kv_connector_extra_config"
    )
    if connector is None or role is None or role == "kv_both":
        return  # no transfer at all, or vLLM itself rejects the missing role
    if connector in SAME_NODE_PD_CONNECTORS:
        path = (extra or {}).get("shared_storage_path") if isinstance(extra, dict) else None
        filesystem = _network_filesystem(path) if isinstance(path, str) else None
        if filesystem is not None:
            logger.warning(
                "vllm-artifact: %s shared_storage_path %s is on a %s file system: a KV "
                "producer on another node can fill it, but the R3 of its KV stays on that "
                "node, so such requests fail closed. Keep the engines of a prefill/decode pair "
                "on one node with the same --artifact-root.",
                connector,
                path,
                filesystem,
            )
        return
    if connector in CROSS_NODE_CONNECTORS:
        raise ArtifactConfigError(cross_node_message(connector, role))
    raise ArtifactConfigError(_UNVERIFIED.format(connector=connector, role=role))


def _network_filesystem(path: str) -> str | None:
    """The type of the network file system ``path`` is on, or None (local, or unknown)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, best_type = "", None
    for mount_point, fs_type in entries:
        mount_point = mount_point.replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fs_type
    if best_type is None:
        return None
    base = best_type.removeprefix("fuse.")
    return best_type if base in _NETWORK_FILESYSTEMS else None


def _fields(obj: Any, *names: str) -> tuple[Any, ...]:
    """Fields of a vLLM config object or of the dict a user passed instead."""
    if isinstance(obj, dict):
        return tuple(obj.get(name) for name in names)
    return tuple(getattr(obj, name, None) for name in names)
