"""Read a keys-only R3 handle from the engine's ``/dev/shm`` store (same node, same user).

The engine answers a ``routed_experts_format="keys"`` request as soon as the completion
finishes; its last blocks reach the store one engine step later (the background publisher
writes them). :meth:`R3Reader.read` therefore waits, bounded by ``timeout``, for every key
to appear, then copies the rows with the store's checks: key, envelope and xxh3 checksum of
every object, seqlock retries against a concurrent writer. A key that stays absent (evicted,
or never published because the request's R3 failed) raises :class:`ObjectMissingError`, a
damaged object :class:`ObjectCorruptError`, objects holding other routing than the handle's
request used (its ``objects_xxh3`` or ``rows_xxh3`` differs) :class:`KeyCollisionError`; a
reader never returns partial or another request's R3. :meth:`R3Reader.verify` answers the
same question without the rows, from the objects' envelopes where it can (the frontend's
check before it answers a keys request).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from vllm_artifact.client.experts import RoutedExperts
from vllm_artifact.core.handoff import R3Keys, RowsDigest, StoreAddress
from vllm_artifact.core.objects_digest import digest_of_checksums
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ObjectStore, ShmStore
from vllm_artifact.errors import KeyCollisionError, ObjectMissingError, SchemaError

__all__ = ["R3Reader", "read_r3_keys"]

#: Default bound on waiting for the engine to publish a finished completion's last blocks.
DEFAULT_TIMEOUT_S = 10.0
_POLL_S = 0.002
_MAX_OPEN_STORES = 8


class R3Reader:
    """Materializes :class:`R3Keys` handles; keeps a few stores open between reads.

    Thread-safe. A store its engine replaced (a restart with another capacity makes a new
    arena) is reopened here after a miss. Stores dropped from the cache are not closed, so a
    read in another thread never loses its mapping; they close when no read holds them.
    """

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._stores: OrderedDict[StoreAddress, ObjectStore] = OrderedDict()
        self._lock = threading.Lock()

    def read(
        self, handle: R3Keys | str | bytes | Mapping[str, Any], *, timeout: float | None = None
    ) -> RoutedExperts:
        """The completion's R3 (``[num_rows, layers, top_k]`` plus its dense layers) from a
        handle: an ``R3Keys``, its JSON text (``routed_experts`` of an HTTP choice) or that
        text parsed."""
        if not isinstance(handle, R3Keys):
            handle = R3Keys.from_json(handle)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        keys, first_token, held = handle.object_keys()
        store = self._store(handle, fresh=False)
        if not keys:
            return RoutedExperts(store.layout.empty(0), store.layout.dense_layers)
        out = store.layout.empty(held)
        try:
            checksums = store.read_into(keys, out, token_start=first_token)
        except ObjectMissingError:
            # The engine answered before its publisher wrote the last blocks: wait for them.
            while not all(store.exists(keys)):
                if time.monotonic() >= deadline:
                    store = self._store(handle, fresh=True)  # the engine may have restarted
                    break
                time.sleep(_POLL_S)
            try:
                checksums = store.read_into(keys, out, token_start=first_token)
            except ObjectMissingError as err:
                raise ObjectMissingError(
                    f"{err} The keys handle was not read within {wait:.1f} s of the response "
                    "or its objects were evicted since: read handles promptly, or raise "
                    "--artifact-capacity."
                ) from None
        skip = handle.first_row - first_token
        rows = out[skip : skip + handle.num_rows]
        # the checksums were verified on the rows read: their digest is that of the rows
        if (
            handle.objects_xxh3 is not None
            and digest_of_checksums(checksums) != handle.objects_xxh3
        ) or (handle.rows_xxh3 is not None and RowsDigest.of(rows) != handle.rows_xxh3):
            raise KeyCollisionError(
                f"R3 store {handle.store.describe()} holds other routing under "
                "this handle's keys than its request used (another request published the same "
                "token blocks first with different routing, e.g. nondeterministic GPU kernels; "
                "the store keeps the first): this request's R3 is not available from the "
                "store. Ask for it as an array (routed_experts_format=array) if this repeats."
            )
        return RoutedExperts(rows, store.layout.dense_layers)

    def envelopes_match(self, handle: R3Keys) -> bool | None:
        """Whether ``handle`` resolves, told without reading payloads where its store keeps
        envelopes apart (``/dev/shm``) and the handle carries ``objects_xxh3``: True when
        every object is published with exactly the envelope checksums of the request's rows;
        None while some are not published yet; False when a :meth:`read` must decide (no
        such digest or store, other checksums, a store that cannot be opened: the read then
        says what is wrong). A payload damaged since it was published is caught by the read
        of whoever takes the rows: every read checks every object's checksum."""
        try:
            keys, _, _ = handle.object_keys()
            store = self._store(handle, fresh=False)
            if not (handle.objects_xxh3 is not None and store.reads_envelopes):
                return False if all(store.exists(keys)) else None
            sums = store.envelope_checksums(keys)
        except Exception:  # the read reports it, with its reason
            return False
        if sums is None:
            return None
        return digest_of_checksums(sums) == handle.objects_xxh3

    def verify(
        self, handle: R3Keys | str | bytes | Mapping[str, Any], *, timeout: float | None = None
    ) -> None:
        """Raise as :meth:`read` would if ``handle`` does not resolve to its request's rows,
        from the envelopes alone where :meth:`envelopes_match` can tell (a read otherwise).
        Waits, bounded by ``timeout``, for the engine to publish the last objects."""
        if not isinstance(handle, R3Keys):
            handle = R3Keys.from_json(handle)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while (match := self.envelopes_match(handle)) is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        if not match:
            self.read(handle, timeout=max(0.0, deadline - time.monotonic()))

    def _store(self, handle: R3Keys, *, fresh: bool) -> ObjectStore:
        address = handle.store
        with self._lock:
            store = self._stores.pop(address, None)
            if store is None or fresh:
                store = _open_reader(address, handle.layout)
            self._stores[address] = store
            while len(self._stores) > _MAX_OPEN_STORES:
                self._stores.popitem(last=False)
        if store.layout.canonical() != handle.layout:
            raise SchemaError(
                f"R3 store {address.describe()} holds layout {store.layout.canonical()!r}, "
                f"the handle wants {handle.layout!r}"
            )
        if store.layout.block_size != handle.block_size:
            raise SchemaError("the handle's block size differs from its store's")
        return store

    def close(self) -> None:
        with self._lock:
            while self._stores:
                self._stores.popitem()[1].close()

    def __enter__(self) -> R3Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _open_reader(address: StoreAddress, layout: str) -> ObjectStore:
    """A read-only handle on the store a keys handle names: a /dev/shm store of this node, or
    a Mooncake Store (from any node; a client that adds no memory to it)."""
    if address.backend == "shm":
        return ShmStore.open_reader(address.root, address.name)
    from vllm_artifact.core.store.mooncake import MooncakeStore

    return MooncakeStore.connect(
        master_address=address.root,
        metadata_url=str(address.metadata),
        local_hostname=host_address(),
        layout=R3Layout.from_canonical(layout),
        key_prefix=address.name,
        segment_bytes=0,
        writable=False,
    )


def host_address() -> str:
    """This host's address, as the Mooncake transfer engine advertises it."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


_DEFAULT: R3Reader | None = None
_DEFAULT_LOCK = threading.Lock()


def default_reader() -> R3Reader:
    """The process-wide :class:`R3Reader` (its stores stay open between reads)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = R3Reader()
        return _DEFAULT


def read_r3_keys(
    handle: R3Keys | str | bytes | Mapping[str, Any], *, timeout: float | None = None
) -> RoutedExperts:
    """Read one handle with the process-wide :class:`R3Reader`."""
    return default_reader().read(handle, timeout=timeout)
