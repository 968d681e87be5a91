"""The arena file: one preallocated, mmap'd file per store.

Why one file: creating or opening a file costs 25-60 us on this tmpfs, and a
32K-token DeepSeek-V3 request is 2048 objects (16-token blocks), so
file-per-object costs 50-120 ms per request. One mapped arena turns a publish
or a read into memory copies, and lets a whole request be validated with a few
vectorized numpy operations.

Layout (every section 4 KiB aligned)::

    [superblock 4 KiB][index: buckets x 64 B][headers: slots x 64 B][payloads]

* superblock: format version, geometry, R3 layout, creation time, a random
  incarnation, and an xxh3 checksum over all of it;
* index: :mod:`.shm_index` (key -> slot hints);
* headers: one 64-byte envelope per slot (:mod:`vllm_artifact.core.envelope`),
  kept apart from the payloads so validating 2048 headers touches 128 KiB;
* payloads: ``slot_count`` slots of exactly one full block each with no
  padding, so objects that sit in consecutive slots (a request published in
  one batch usually does) are one contiguous byte range and are gathered with
  a single copy.

The file is created under a temporary name, fully allocated with
``posix_fallocate`` (so a full /dev/shm fails here with a clear error instead
of a SIGBUS in the middle of serving), and renamed into place: readers never
see a half-initialized arena.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import xxhash

from vllm_artifact.core.envelope import HEADER_DTYPE, HEADER_NBYTES
from vllm_artifact.core.schema import DTYPE_CODES, MAX_LAYERS, R3Layout
from vllm_artifact.core.store.shm_index import BUCKET_WAYS, index_buckets_for
from vllm_artifact.core.store.shm_root import allocate, open_file
from vllm_artifact.errors import SchemaError, StoreFormatError

__all__ = ["ARENA_NAME", "Arena", "ArenaGeometry", "create_arena", "open_arena"]

ARENA_NAME = "arena"
TMP_PREFIX = "arena.tmp-"
FORMAT_VERSION = 1
_MAGIC = b"VARTSHM1"
_PAGE = 4096
_BITMAP_NBYTES = MAX_LAYERS // 8
# Prefault the mapping once at open: otherwise the first publish or read of
# every 4 KiB page pays a page fault (~5 ms per 14.5 MiB request).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

SUPER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("format_version", "<u4"),
        ("header_nbytes", "<u4"),
        ("slot_count", "<u8"),
        ("slot_nbytes", "<u8"),
        ("index_buckets", "<u8"),
        ("index_offset", "<u8"),
        ("headers_offset", "<u8"),
        ("payload_offset", "<u8"),
        ("file_nbytes", "<u8"),
        ("block_size", "<u4"),
        ("num_layers", "<u4"),
        ("top_k", "<u4"),
        ("num_experts", "<u4"),
        ("dtype_code", "<u4"),
        ("reserved", "<u4"),
        ("created_ns", "<u8"),
        ("incarnation", "<u8"),
        ("dense_bitmap", "u1", (_BITMAP_NBYTES,)),
        ("checksum", "<u8"),
    ]
)
assert SUPER_DTYPE.itemsize <= _PAGE
assert SUPER_DTYPE.fields is not None
_CSUM_AT: int = SUPER_DTYPE.fields["checksum"][1]


def _align(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


@dataclass(frozen=True)
class ArenaGeometry:
    """Sizes and offsets of an arena for a layout and a slot count."""

    layout: R3Layout
    slot_count: int

    @classmethod
    def for_capacity(cls, layout: R3Layout, capacity_bytes: int) -> ArenaGeometry:
        """Largest arena whose file fits in ``capacity_bytes``."""
        per_slot = layout.block_nbytes + HEADER_NBYTES + 4 * 8  # payload, header, index
        slots = max(0, (capacity_bytes - _PAGE) // per_slot)
        while slots > 0 and cls(layout, slots).file_nbytes > capacity_bytes:
            slots -= 1
        if slots < 1:
            raise SchemaError(
                f"store capacity {capacity_bytes} bytes cannot hold one R3 block "
                f"({layout.block_nbytes} bytes + overhead); raise --artifact-capacity"
            )
        return cls(layout, slots)

    @cached_property
    def index_buckets(self) -> int:
        return index_buckets_for(self.slot_count)

    @cached_property
    def slot_nbytes(self) -> int:
        return self.layout.block_nbytes

    @cached_property
    def index_offset(self) -> int:
        return _PAGE

    @cached_property
    def headers_offset(self) -> int:
        return self.index_offset + _align(self.index_buckets * BUCKET_WAYS * 8)

    @cached_property
    def payload_offset(self) -> int:
        return self.headers_offset + _align(self.slot_count * HEADER_NBYTES)

    @cached_property
    def file_nbytes(self) -> int:
        return self.payload_offset + _align(self.slot_count * self.slot_nbytes)


class Arena:
    """A mapped arena: numpy views over its sections (read-only for readers)."""

    def __init__(
        self,
        mapping: mmap.mmap,
        geometry: ArenaGeometry,
        *,
        writable: bool,
        incarnation: int,
        file_id: tuple[int, int] = (0, 0),
    ) -> None:
        self.geometry = geometry
        self.writable = writable
        self.incarnation = incarnation
        #: ``(st_dev, st_ino)`` of the mapped file: a handle whose store was removed or
        #: replaced since (its name now names another file, or none) can tell.
        self.file_id = file_id
        self._mapping: mmap.mmap | None = mapping
        buf = memoryview(mapping)
        self._buf: memoryview | None = buf
        slot_count, slot_nbytes = geometry.slot_count, geometry.slot_nbytes
        self.index_table = np.frombuffer(
            buf,
            dtype="<u8",
            count=geometry.index_buckets * BUCKET_WAYS,
            offset=geometry.index_offset,
        ).reshape(geometry.index_buckets, BUCKET_WAYS)
        self.headers = np.frombuffer(
            buf, dtype=HEADER_DTYPE, count=slot_count, offset=geometry.headers_offset
        )
        #: The same headers as ``[slots, 8]`` uint64 words (:class:`HeaderWords`).
        self.words = self.headers.view("<u8").reshape(slot_count, 8)
        self.seq = self.words[:, 0]
        #: And as one opaque item per header: fancy indexing copies a whole header per
        #: index, fast and without releasing the GIL (see StoreReads.locate).
        self.header_items = self.words.view(np.dtype((np.void, HEADER_NBYTES)))[:, 0]
        payload_offset = geometry.payload_offset
        self.payload = buf[payload_offset : payload_offset + slot_count * slot_nbytes]
        #: The same payload as ``[slots, slot_nbytes]`` bytes (whole-block copies in one call).
        self.payload_blocks = np.frombuffer(
            buf, dtype=np.uint8, count=slot_count * slot_nbytes, offset=payload_offset
        ).reshape(slot_count, slot_nbytes)
        #: And as one opaque item per slot (fancy indexing moves whole slots, see
        #: StoreReads._copy).
        self.payload_items = self.payload_blocks.view(np.dtype((np.void, slot_nbytes)))[:, 0]

    def published(self) -> np.ndarray:
        """Which slots hold a published object (envelope set, ``seq`` even)."""
        return (self.headers["magic"] != 0) & ((self.seq & np.uint64(1)) == 0)

    def close(self) -> None:
        """Drop every view, then unmap (numpy views pin the mapping)."""
        mapping, buf = self._mapping, self._buf
        if mapping is None or buf is None:
            return
        self._mapping = self._buf = None
        del self.index_table, self.headers, self.words, self.seq, self.header_items
        del self.payload_blocks, self.payload_items
        self.payload.release()
        try:
            buf.release()
            mapping.close()
        except BufferError:
            # A caller still holds a view (e.g. a traceback frame); the mapping
            # is unmapped when that view is garbage collected.
            pass


#: Geometry fields the superblock records, each checked against the geometry it implies.
_GEOMETRY_FIELDS = (
    "slot_count",
    "slot_nbytes",
    "index_buckets",
    "index_offset",
    "headers_offset",
    "payload_offset",
    "file_nbytes",
)
_LAYOUT_FIELDS = ("block_size", "num_layers", "top_k", "num_experts", "dtype_code")


def _superblock(geometry: ArenaGeometry, incarnation: int) -> bytes:
    superblock = np.zeros(1, dtype=SUPER_DTYPE)
    superblock["magic"] = _MAGIC
    superblock["format_version"] = FORMAT_VERSION
    superblock["header_nbytes"] = HEADER_NBYTES
    for field in _GEOMETRY_FIELDS:
        superblock[field] = getattr(geometry, field)
    for field in _LAYOUT_FIELDS:
        superblock[field] = getattr(geometry.layout, field)
    superblock["created_ns"] = time.time_ns()
    superblock["incarnation"] = incarnation
    dense = np.zeros(MAX_LAYERS, dtype=bool)
    dense[list(geometry.layout.dense_layers)] = True
    superblock["dense_bitmap"][0] = np.packbits(dense, bitorder="little")
    superblock["checksum"] = xxhash.xxh3_64_intdigest(superblock.tobytes()[:_CSUM_AT])
    return superblock.tobytes()


def _parse_superblock(raw: bytes, where: str) -> tuple[ArenaGeometry, int]:
    bad = StoreFormatError(
        f"{where} is not a valid R3 store arena (bad superblock); remove the store directory "
        "or let the writer recreate it"
    )
    if len(raw) < SUPER_DTYPE.itemsize:
        raise bad
    superblock = np.frombuffer(raw, dtype=SUPER_DTYPE, count=1)[0]
    if bytes(superblock["magic"]) != _MAGIC or int(
        superblock["checksum"]
    ) != xxhash.xxh3_64_intdigest(raw[:_CSUM_AT]):
        raise bad
    version = int(superblock["format_version"])
    if version != FORMAT_VERSION or int(superblock["header_nbytes"]) != HEADER_NBYTES:
        raise StoreFormatError(
            f"{where} has store format {version}, this build reads "
            f"{FORMAT_VERSION}; use matching vllm-artifact versions for engine and readers"
        )
    dense_mask = np.unpackbits(superblock["dense_bitmap"], bitorder="little").astype(bool)
    try:
        layout = R3Layout(
            num_layers=int(superblock["num_layers"]),
            top_k=int(superblock["top_k"]),
            num_experts=int(superblock["num_experts"]),
            block_size=int(superblock["block_size"]),
            dense_layers=tuple(int(i) for i in np.flatnonzero(dense_mask)),
        )
        geometry = ArenaGeometry(layout, int(superblock["slot_count"]))
    except SchemaError:
        raise bad from None
    if (
        any(getattr(geometry, field) != int(superblock[field]) for field in _GEOMETRY_FIELDS)
        or layout.dtype_code != int(superblock["dtype_code"])
        or DTYPE_CODES[layout.dtype.name] != int(superblock["dtype_code"])
    ):
        raise bad
    return geometry, int(superblock["incarnation"])


def create_arena(dir_fd: int, geometry: ArenaGeometry, *, where: str) -> Arena:
    """Create a fresh, empty arena and atomically rename it into place."""
    incarnation = secrets.randbits(63)
    tmp = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    fd = open_file(dir_fd, tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, where=where)
    try:
        allocate(fd, geometry.file_nbytes, what="its arena", where=where)
        os.pwrite(fd, _superblock(geometry, incarnation), 0)
        mapping = mmap.mmap(fd, geometry.file_nbytes, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        os.rename(tmp, ARENA_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    file_stat = os.fstat(fd)
    os.close(fd)
    return Arena(
        mapping,
        geometry,
        writable=True,
        incarnation=incarnation,
        file_id=(file_stat.st_dev, file_stat.st_ino),
    )


def open_arena(dir_fd: int, *, writable: bool, where: str) -> Arena:
    """Map an existing arena after validating its superblock and size."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    fd = open_file(dir_fd, ARENA_NAME, flags, where=where)
    try:
        file_stat = os.fstat(fd)
        size = file_stat.st_size
        geometry, incarnation = _parse_superblock(os.pread(fd, _PAGE, 0), f"{where}/arena")
        if size != geometry.file_nbytes:
            raise StoreFormatError(
                f"{where}/arena has {size} bytes, its superblock says "
                f"{geometry.file_nbytes}; remove the store directory"
            )
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapping = mmap.mmap(fd, size, _MAP_FLAGS, prot)
    finally:
        os.close(fd)
    return Arena(
        mapping,
        geometry,
        writable=writable,
        incarnation=incarnation,
        file_id=(file_stat.st_dev, file_stat.st_ino),
    )
