"""R3 object store on Mooncake Store (a distributed object store), so R3 can cross nodes.

One object = one Mooncake value under ``<prefix>/<key hex>``: the 64-byte envelope
(:mod:`vllm_artifact.core.envelope`) followed by the payload, verified on every read as the
shm backend verifies it (key, envelope fields against the layout, token continuity, xxh3 on
the bytes received). Mooncake's semantics are weaker than our contract; this module closes
the gaps:

* **Immutability.** A second ``put`` of a key silently keeps the first value, so every put
  first checks which keys exist and compares their content: identical is accepted,
  different is :class:`KeyCollisionError`. One writer per prefix (as one writer per shm
  store): two writers racing on one new key are not detected.
* **Pins.** Mooncake 0.3.13 has no pin RPC: a *hard pin* can only be asked for when a value
  is written (``ReplicateConfig.with_hard_pin``), is never evicted, and is dropped only by
  removing the object. So pins are refcounted here, in the writer process: an object gets
  its hard pin when first pinned (written pinned, or rewritten pinned if it was stored
  unpinned), and when its last pin goes it is **removed** - an unpinned object "may be
  evicted", and removal is the only eviction Mooncake lets a client ask for. Objects put
  with ``pin=False`` are ordinary Mooncake objects, evicted when segments fill (after their
  lease, ``default_kv_lease_ttl``). Pins die with the writer process: a writer that crashes
  leaves its hard-pinned objects until they are removed or the master restarts.
* **Failures.** Return codes become typed errors (:mod:`.mooncake_codes`); a master that is
  down is :class:`StoreUnavailableError` (within ~4 s for reads and writes, at once for
  ``connect``), full segments :class:`CapacityError`.

Objects live in the segments that clients mount (``segment_bytes``): a client that closes
or dies takes the objects placed in its segment with it (after ``client_ttl``), and a master
restart loses all of them. Reads therefore fail closed as missing, never partial.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_artifact.core.envelope import HEADER_NBYTES, HeaderWords, checksum
from vllm_artifact.core.keys import ObjectKey, keys_to_words
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.contract import ObjectStore, PutItem, StoreStats
from vllm_artifact.core.store.mooncake_codes import (
    HEALTHY,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    StagingBuffer,
    bind_address_default,
    check_prefix,
    check_reachable,
    code_error,
    first_failure,
    import_mooncake,
)
from vllm_artifact.core.store.mooncake_reads import StagedReads
from vllm_artifact.core.store.shm_metrics import StoreMetrics
from vllm_artifact.core.store.shm_write import BatchBuilder, PutBatch
from vllm_artifact.errors import (
    ArtifactConfigError,
    StoreClosedError,
    StoreReadOnlyError,
    StoreUnavailableError,
)

__all__ = ["MooncakeStore"]

#: ``seq`` of a stored envelope: even and non-zero, "published" in the shm seqlock's terms.
_PUBLISHED_SEQ = 2
_MIN_SEGMENT = 16 << 20
#: Pauses before writing again what found no room (0.4 s in all, then CapacityError).
_ROOM_WAITS = (0.02, 0.05, 0.1, 0.25)


class MooncakeStore(ObjectStore):
    """R3 objects in a Mooncake Store (see module docstring). Open with :meth:`connect`."""

    def __init__(
        self,
        client: Any,
        *,
        layout: R3Layout,
        prefix: str,
        where: str,
        writable: bool,
        owns_client: bool = True,
    ) -> None:
        self._client: Any = client
        self._owns_client = owns_client
        self._mooncake = import_mooncake()
        self._layout = layout
        self._prefix = prefix
        self.where = where
        self.writable = writable
        self._lock = threading.RLock()
        self._words = HeaderWords(layout)
        self._reads = StagedReads(self, StagingBuffer(client))
        self._write_stage = StagingBuffer(client)
        self._pins: dict[ObjectKey, int] = {}  # pin references of the hard-pinned objects
        self._published = 0  # objects this handle wrote and has not removed
        self._removed = 0  # objects removed when their last pin went
        # Names of the objects this handle wrote: only those does it rewrite (to pin) or remove
        # (at their last unpin). Another writer's objects under the same prefix (the other
        # engine of a prefill/decode pair) keep the lifetime their writer gives them.
        self._written: set[str] = set()
        #: The writer's exported counters (``/metrics``), set by the engine; None: not counted.
        self.metrics: StoreMetrics | None = None

    @classmethod
    def connect(
        cls,
        *,
        master_address: str,
        metadata_url: str,
        local_hostname: str,
        layout: R3Layout,
        key_prefix: str,
        segment_bytes: int,
        local_buffer_bytes: int = 16 << 20,
        protocol: str = "tcp",
        writable: bool = True,
        connect_timeout: float = 2.0,
    ) -> MooncakeStore:
        """Set up a Mooncake client and wrap it.

        ``segment_bytes`` of this process's memory join the store (0 for a reader that
        holds no objects); ``local_buffer_bytes`` is Mooncake's own staging buffer (our puts
        and reads use registered buffers of their own). ``key_prefix`` separates
        deployments and models sharing one master. ``writable=False`` opens a reader.
        """
        if protocol != "tcp":
            raise ArtifactConfigError(f"Mooncake protocol {protocol!r} is not supported yet (tcp)")
        check_prefix(key_prefix)
        if local_buffer_bytes < 0 or not (segment_bytes == 0 or segment_bytes >= _MIN_SEGMENT):
            raise ArtifactConfigError(
                f"Mooncake segment_bytes={segment_bytes} must be 0 (a reader holding no "
                f"objects) or at least {_MIN_SEGMENT >> 20} MiB, Mooncake's smallest segment"
            )
        store_module = import_mooncake()
        check_reachable(master_address, metadata_url, connect_timeout)
        bind_address_default(local_hostname)
        client = store_module.MooncakeDistributedStore()
        code = client.setup(
            local_hostname,
            metadata_url,
            segment_bytes,
            local_buffer_bytes,
            protocol,
            "",
            master_address,
        )
        where = f"mooncake://{master_address}/{key_prefix}"
        if code != 0:
            raise StoreUnavailableError(
                f"R3 store {where}: Mooncake client setup failed ({code}); check that "
                f"{local_hostname} is this host's address and the metadata URL {metadata_url}"
            )
        return cls(client, layout=layout, prefix=key_prefix, where=where, writable=writable)

    # ------------------------------------------------------------------- basics

    @property
    def layout(self) -> R3Layout:
        return self._layout

    @property
    def key_prefix(self) -> str:
        """The prefix of this handle's Mooncake keys."""
        return self._prefix

    @property
    def value_stride(self) -> int:
        """Bytes of the largest value (envelope and one full block)."""
        return HEADER_NBYTES + self._layout.block_nbytes

    def names(self, keys: Sequence[ObjectKey]) -> list[str]:
        """Mooncake keys of our keys."""
        prefix = self._prefix
        return [f"{prefix}/{key.hex()}" for key in keys]

    def live(self) -> Any:
        """The Mooncake client; :class:`StoreClosedError` once closed."""
        client = self._client
        if client is None:
            raise StoreClosedError(f"R3 store {self.where} handle is closed")
        return client

    def reconnecting(self) -> bool:
        """Whether the client says its master is unreachable (cheap, local)."""
        return bool(self.live().health_check() != HEALTHY)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            if client is None:
                return
            self._reads.staging.release()
            self._write_stage.release()
            if self.metrics is not None:
                self.metrics.close()
            if self._owns_client:
                client.close()  # takes 1-2 s (Mooncake stops its threads)

    def sharing_client(self, key_prefix: str, *, writable: bool | None = None) -> MooncakeStore:
        """Another handle on this handle's Mooncake client, under another key prefix (one
        client, one segment, for several namespaces of a process). It does not own the
        client: close it before this one."""
        check_prefix(key_prefix)
        return MooncakeStore(
            self.live(),
            layout=self._layout,
            prefix=key_prefix,
            where=f"{self.where.rpartition('/')[0]}/{key_prefix}",
            writable=self.writable if writable is None else writable,
            owns_client=False,
        )

    def stats(self) -> StoreStats:
        """This handle's view: Mooncake tells a client neither store-wide object counts nor
        its evictions, so ``objects`` counts what this handle published and has not removed
        (evicted unpinned ones included) and ``evictions`` the removals at a last unpin."""
        with self._lock:
            self.live()
            return StoreStats(
                objects=self._published,
                bytes_used=self._published * self.value_stride,
                capacity_bytes=0,
                capacity_objects=0,
                pinned_objects=len(self._pins),
                evictions=self._removed,
                writable=self.writable,
            )

    def _writer(self) -> Any:
        client = self.live()
        if not self.writable:
            raise StoreReadOnlyError(
                f"R3 store {self.where} is open read-only; only its writer may publish or pin"
            )
        return client

    # ------------------------------------------------------------------ reading

    def exists(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is stored (key presence only: no envelope is fetched)."""
        if not keys:
            return []
        with self._lock:
            codes = list(self.live().batch_is_exist(self.names(keys)))
            error = first_failure(codes, f"R3 store {self.where}: exists", self.reconnecting())
            if error is not None:
                raise error
            return [code == 1 for code in codes]

    def get(self, keys: Sequence[ObjectKey]) -> list[np.ndarray]:
        started = time.perf_counter()
        with self._lock:
            arrays = self._reads.get(keys)
        self._observe_read(started, len(keys))
        return arrays

    def read_into(
        self, keys: Sequence[ObjectKey], out: np.ndarray, *, token_start: int = 0
    ) -> np.ndarray:
        started = time.perf_counter()
        with self._lock:
            checksums = self._reads.read_into(keys, out, token_start)
        self._observe_read(started, len(keys))
        return checksums

    # ------------------------------------------------------------------ writing

    def put(
        self, items: Sequence[PutItem | tuple[ObjectKey, np.ndarray, int]], *, pin: bool = True
    ) -> None:
        if not items:
            return
        builder = BatchBuilder(self._layout)
        for key, rows, token_start in items:
            builder.add_object(key, rows, token_start)
        self._put_batch(builder.build(), pin)

    def put_runs(
        self,
        runs: Sequence[tuple[Sequence[ObjectKey], np.ndarray, int]],
        *,
        pin: bool = True,
    ) -> None:
        builder = BatchBuilder(self._layout)
        for keys, rows, token_start in runs:
            builder.add_run(keys, rows, token_start)
        self._put_batch(builder.build(), pin)

    def _observe_read(self, started: float, objects: int) -> None:
        if self.metrics is not None and objects:
            self.metrics.observe_read(time.perf_counter() - started, objects)

    def _count(self) -> None:
        """Refresh the exported occupancy gauges (this handle's view, see :meth:`stats`)."""
        if self.metrics is None:
            return
        stats = self.stats()
        self.metrics.set_occupancy(
            objects=stats.objects,
            bytes_used=stats.bytes_used,
            capacity_bytes=stats.capacity_bytes,
            pinned=stats.pinned_objects,
            evictions=stats.evictions,
        )

    def _put_batch(self, batch: PutBatch | None, pin: bool) -> None:
        started = time.perf_counter()
        try:
            self._put_batch_unmetered(batch, pin)
        finally:
            self._count()
        if self.metrics is not None and batch is not None:
            self.metrics.observe_publish(time.perf_counter() - started, len(batch.keys))

    def _put_batch_unmetered(self, batch: PutBatch | None, pin: bool) -> None:
        """Check existing keys (identical: kept; corrupt: replaced; different: collision,
        before anything is written), write the new ones, then count the pins."""
        if batch is None:
            return
        with self._lock:
            self._writer()
            names = self.names(batch.keys)
            present = np.array(self.exists(batch.keys), dtype=bool)
            replace = np.zeros(len(names), dtype=bool)
            if present.any():
                found = np.flatnonzero(present)
                replace[found] = self._reads.compare_stored(batch, found)
            if replace.any():
                self._remove(np.flatnonzero(replace), names)
            write = ~present | replace
            counted = np.array([key in self._pins for key in batch.keys], dtype=bool)
            ours = np.array([name in self._written for name in names], dtype=bool)
            if pin:
                unpinned = np.flatnonzero(present & ~replace & ~counted & ours)
                if len(unpinned):  # stored without a hard pin: rewrite them pinned
                    self._remove(unpinned, names)
                    write[unpinned] = True
            hard = write & (pin | counted)  # a replaced pinned object keeps its pin
            written = np.zeros(len(names), dtype=bool)
            try:
                self._write(batch, names, np.flatnonzero(write & ~hard), hard=False, ok=written)
                self._write(batch, names, np.flatnonzero(hard), hard=True, ok=written)
            finally:
                # Also when a write failed in part (no room): what was stored is pinned
                # (hard-pinned in Mooncake), so it is counted, else no unpin would remove it.
                if pin:
                    stored = (present & ~write) | written
                    for key, ok in zip(batch.keys, stored.tolist(), strict=True):
                        if ok:
                            self._pins[key] = self._pins.get(key, 0) + 1

    def _write(
        self,
        batch: PutBatch,
        names: list[str],
        idx: np.ndarray,
        *,
        hard: bool,
        ok: np.ndarray | None = None,
    ) -> None:
        """Write batch objects ``idx`` (envelope + payload, staged in registered memory)
        with one ``batch_put_from``; ``ok[i]`` is set for each object ``i`` written (also
        when others failed and this raises)."""
        if not len(idx):
            return
        stride = self.value_stride
        count = len(idx)
        staged = self._write_stage.get(count * stride)[: count * stride].reshape(count, stride)
        key_words = keys_to_words([batch.keys[i] for i in idx.tolist()])
        starts, n_tokens = batch.starts[idx], batch.n_tokens[idx]
        envelopes = self._words.build(key_words, starts, n_tokens)
        envelopes[:, HeaderWords.SEQ] = _PUBLISHED_SEQ
        sums = list(
            map(checksum, batch.src_views(idx), self._words.seeds_for(key_words, starts, n_tokens))
        )
        envelopes[:, HeaderWords.CSUM] = sums
        staged[:, :HEADER_NBYTES] = envelopes.view(np.uint8)
        nbytes = (n_tokens * self._layout.row_nbytes).tolist()
        for row, view, size in zip(staged, batch.src_views(idx), nbytes, strict=True):
            row[HEADER_NBYTES : HEADER_NBYTES + size] = np.frombuffer(view, dtype=np.uint8)
        config = self._mooncake.ReplicateConfig()
        config.with_hard_pin = hard
        base = staged.ctypes.data
        todo = list(range(count))
        for pause in (*_ROOM_WAITS, None):
            codes = list(
                self.live().batch_put_from(
                    [names[idx[i]] for i in todo],
                    [base + i * stride for i in todo],
                    [HEADER_NBYTES + nbytes[i] for i in todo],
                    config,
                )
            )
            self._published += sum(code == 0 for code in codes)
            if ok is not None:
                ok[[idx[i] for i, code in zip(todo, codes, strict=True) if code == 0]] = True
            self._written.update(
                names[idx[i]] for i, code in zip(todo, codes, strict=True) if code == 0
            )
            full = [i for i, code in zip(todo, codes, strict=True) if code == NO_AVAILABLE_HANDLE]
            if pause is None or not full or len(full) < sum(code < 0 for code in codes):
                break
            # The master evicts in the background (5% a round past 90% full): a batch
            # larger than that fails in part although unpinned objects could make room.
            time.sleep(pause)
            todo = full
        error = first_failure(codes, f"R3 store {self.where}: put", self.reconnecting())
        if error is not None:
            raise error

    def _remove(self, idx: np.ndarray, names: list[str]) -> None:
        """Remove objects (``force``: past their lease and any hard pin)."""
        removed = [names[i] for i in idx.tolist()]
        codes = list(self.live().batch_remove(removed, True))
        self._published -= sum(code == 0 for code in codes)
        self._written.difference_update(removed)
        failed = [code for code in codes if code not in (0, OBJECT_NOT_FOUND)]
        if failed:
            raise code_error(
                failed[0], f"R3 store {self.where}: remove", reconnecting=self.reconnecting()
            )

    # --------------------------------------------------------------------- pins

    def pin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """One pin reference per present key; an object stored without a hard pin is read
        (verified) and rewritten hard-pinned (readers may miss it for that moment)."""
        if not keys:
            return []
        with self._lock:
            self._writer()
            present = self.exists(keys)
            written = self._written
            fresh = [
                key
                for key, name, ok in zip(keys, self.names(keys), present, strict=True)
                if ok and key not in self._pins and name in written
            ]
            fresh = list(dict.fromkeys(fresh))
            if fresh:
                self._rewrite_pinned(fresh)
            for key, ok in zip(keys, present, strict=True):
                if ok:
                    self._pins[key] = self._pins.get(key, 0) + 1
            self._count()
            return present

    def _rewrite_pinned(self, keys: list[ObjectKey]) -> None:
        rows, starts = self._reads.get_with_starts(keys)
        builder = BatchBuilder(self._layout)
        for key, array, start in zip(keys, rows, starts, strict=True):
            builder.add_object(key, array, start)
        batch = builder.build()
        if batch is None:
            return
        names = self.names(batch.keys)
        everything = np.arange(len(names))
        self._remove(everything, names)
        self._write(batch, names, everything, hard=True)

    def unpin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Drop one pin reference per key; an object whose last pin goes is removed (a
        hard pin cannot be lifted otherwise in Mooncake 0.3.13)."""
        if not keys:
            return []
        with self._lock:
            self._writer()
            result = []
            last: list[ObjectKey] = []
            for key in keys:
                count = self._pins.get(key, 0)
                result.append(count > 0)
                if count > 1:
                    self._pins[key] = count - 1
                elif count == 1:
                    del self._pins[key]
                    if self.names([key])[0] in self._written:
                        last.append(key)
            if last:
                before = self._published
                self._remove(np.arange(len(last)), self.names(last))
                self._removed += before - self._published
            self._count()
            return result
