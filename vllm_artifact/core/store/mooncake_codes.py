"""Mooncake Store client plumbing: the optional import, reachability checks, return codes
turned into our typed errors, and the registered staging buffers.

Mooncake's Python client never raises: every failure is a negative return code (or empty
bytes), and ``setup()`` against a master that is not there blocks for about 90 s before it
returns -1. Everything here exists so that the store fails fast and typed instead.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from vllm_artifact.errors import (
    ArtifactConfigError,
    CapacityError,
    StoreError,
    StoreUnavailableError,
)

__all__ = [
    "NO_AVAILABLE_HANDLE",
    "OBJECT_NOT_FOUND",
    "StagingBuffer",
    "bind_address_default",
    "check_prefix",
    "check_reachable",
    "code_error",
    "code_name",
    "first_failure",
    "import_mooncake",
]

# Return codes of mooncake-transfer-engine 0.3.13 (ErrorCode in mooncake-store's types.h).
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no segment has room (what is left is pinned or leased)
INVALID_PARAMS = -600  # also "client is not initialized" and "buffer too small"
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master unreachable (after ~4 s for reads and writes)
RPC_TIMEOUT = -901
_NAMES = {
    INTERNAL_ERROR: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}
#: ``health_check()``: 0 healthy, 1 not initialized or closed, 2 master unreachable.
HEALTHY = 0


def import_mooncake() -> Any:
    """``mooncake.store``, imported on first use: the core must import without it."""
    try:
        from mooncake import store
    except ImportError as error:
        raise ArtifactConfigError(
            f"the Mooncake store backend needs the Mooncake client ({error}); install it with "
            "pip install vllm-artifact[mooncake] (mooncake-transfer-engine, or "
            "mooncake-transfer-engine-non-cuda on hosts without CUDA)"
        ) from None
    return store


def check_prefix(key_prefix: str) -> None:
    """A key prefix is 1..200 printable characters without spaces."""
    if (
        not key_prefix
        or len(key_prefix) > 200
        or any(ch.isspace() or not ch.isprintable() for ch in key_prefix)
    ):
        raise ArtifactConfigError(
            f"Mooncake key prefix {key_prefix!r} must be 1..200 printable characters without spaces"
        )


def _host_port(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ArtifactConfigError(f"Mooncake {what} {address!r} is not host:port")
    return host.strip("[]"), int(port)


def check_reachable(master_address: str, metadata_url: str, timeout: float) -> None:
    """Connect once to the master's RPC port and to an HTTP metadata server (skipped for
    ``P2PHANDSHAKE``), so a missing master is :class:`StoreUnavailableError` within
    ``timeout`` seconds instead of a 90 s hang in ``setup()``."""
    targets = [("master", *_host_port(master_address, "master address"))]
    if metadata_url.startswith(("http://", "https://")):
        parts = urlsplit(metadata_url)
        default = 443 if parts.scheme == "https" else 80
        targets.append(("metadata server", parts.hostname or "", parts.port or default))
    for what, host, port in targets:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except OSError as error:
            raise StoreUnavailableError(
                f"Mooncake {what} at {host}:{port} does not accept connections ({error}); "
                "start mooncake_master (with --enable_http_metadata_server for an HTTP "
                "metadata URL) or fix the address"
            ) from None


def code_name(code: int) -> str:
    return f"{_NAMES.get(code, 'error')} ({code})"


def code_error(code: int, what: str, *, reconnecting: bool = False) -> StoreError:
    """The typed error of a failed call. ``reconnecting``: the client's health check says
    the master is unreachable (right after a master restart puts fail with
    NO_AVAILABLE_HANDLE until the client has mounted its segment again)."""
    name = code_name(code)
    if code in (RPC_FAIL, RPC_TIMEOUT) or reconnecting:
        return StoreUnavailableError(
            f"{what}: the Mooncake master is unreachable ({name}); R3 reads fail closed "
            "until it is back (a restarted master has lost every object)"
        )
    if code == TRANSFER_FAIL:
        # Seen when the client or store node whose segment holds the objects has died: the
        # master keeps its segment (and the objects in it) until its client_ttl passes.
        return StoreUnavailableError(
            f"{what}: the Mooncake segment holding them did not answer ({name}); the engine "
            "or store node (mooncake_client) that mounted it died or is unreachable. Its "
            "objects read as missing once the master drops it (after --client_ttl)."
        )
    if code == NO_AVAILABLE_HANDLE:
        return CapacityError(
            f"{what}: no Mooncake segment has room ({name}); pinned objects (those the KV "
            "cache can still hit) and leased ones fill the mounted segments. Mount more "
            "segment memory (global_segment_size of the store clients)."
        )
    return StoreError(f"{what}: Mooncake returned {name}")


def first_failure(codes: Sequence[int], what: str, reconnecting: bool) -> StoreError | None:
    """The error for the first negative code of a batch, or None if none failed."""
    failed = [code for code in codes if code < 0]
    if not failed:
        return None
    return code_error(
        failed[0], f"{what} ({len(failed)} of {len(codes)} failed)", reconnecting=reconnecting
    )


class StagingBuffer:
    """A grow-only byte buffer registered with the client (its transfers must target
    registered memory: required for RDMA, and what Mooncake documents for TCP too).
    Registering 15 MiB takes ~0.3 ms, so it is registered again only when it grows."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._array = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        """At least ``nbytes`` registered bytes (contents undefined)."""
        if nbytes > len(self._array):
            self.release()
            array = np.empty(max(nbytes, 2 * len(self._array), 1 << 16), dtype=np.uint8)
            code = self._client.register_buffer(array.ctypes.data, array.nbytes)
            if code != 0:  # registration goes through the metadata server (the master's)
                raise StoreUnavailableError(
                    f"registering a {array.nbytes}-byte staging buffer with the Mooncake "
                    f"metadata server failed ({code_name(code)}); is the master down?"
                )
            self._array = array
        return self._array

    def release(self) -> None:
        if len(self._array):
            self._client.unregister_buffer(self._array.ctypes.data)
            self._array = np.empty(0, dtype=np.uint8)


def bind_address_default(local_hostname: str) -> None:
    """Have the TCP transport bind (and advertise) ``local_hostname``'s address unless the
    deployment chose one: without it, a client on 127.0.0.1 advertises the host's first
    non-loopback address. Process-wide (the transfer engine reads it at setup)."""
    host = local_hostname.rpartition(":")[0] if local_hostname.count(":") == 1 else local_hostname
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
