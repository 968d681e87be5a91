"""Fault injection into a live R3 store, for tests: flip bytes in place, as a bad disk or a
stray writer would; mount a /dev/shm too small for a store."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import secrets
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from vllm_artifact.core.envelope import HEADER_NBYTES
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_arena import ARENA_NAME

#: Byte offset of the key inside a slot header (see vllm_artifact.core.envelope).
_KEY_OFFSET_IN_HEADER = 8


def only_store_name(root: Path) -> str:
    names = [p.name for p in root.iterdir() if p.name.startswith("r3-")]
    assert len(names) == 1, f"expected one store under {root}, found {names}"
    return names[0]


def flip_in_every_slot(root: Path, *, where: str) -> None:
    """Flip one byte of every slot's payload (objects become corrupt) or of its key (objects
    look deleted)."""
    if where not in ("payload", "key"):
        raise ValueError(f"where must be 'payload' or 'key', got {where!r}")
    name = only_store_name(root)
    reader = ShmStore.open_reader(str(root), name)
    geometry = reader.geometry
    reader.close()
    arena = max((p for p in (root / name).iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    slots = np.arange(geometry.slot_count)
    if where == "payload":
        offsets = geometry.payload_offset + slots * geometry.slot_nbytes + 3
    else:
        offsets = geometry.headers_offset + slots * HEADER_NBYTES + _KEY_OFFSET_IN_HEADER + 3
    with open(arena, "r+b") as f, mmap.mmap(f.fileno(), 0) as view:
        data = np.frombuffer(view, dtype=np.uint8)
        data[offsets] ^= 0x40
        del data


def flip_objects(root: Path, keys: Sequence[bytes]) -> int:
    """Flip one byte of the payload of the objects ``keys`` name in the one store under
    ``root`` (they become corrupt; every other object stays intact). Returns how many of the
    keys were found."""
    name = only_store_name(root)
    reader = ShmStore.open_reader(str(root), name)
    geometry = reader.geometry
    reader.close()
    wanted = {bytes(key) for key in keys}
    with open(root / name / ARENA_NAME, "r+b") as f, mmap.mmap(f.fileno(), 0) as view:
        data = np.frombuffer(view, dtype=np.uint8)
        headers = data[
            geometry.headers_offset : geometry.headers_offset + geometry.slot_count * HEADER_NBYTES
        ].reshape(geometry.slot_count, HEADER_NBYTES)
        stored = headers[:, _KEY_OFFSET_IN_HEADER : _KEY_OFFSET_IN_HEADER + 16]
        slots = [slot for slot in range(geometry.slot_count) if stored[slot].tobytes() in wanted]
        for slot in slots:
            data[geometry.payload_offset + slot * geometry.slot_nbytes + 3] ^= 0x40
        del data, headers, stored
    return len(slots)


@contextlib.contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on a fresh 0700 directory under /dev/shm (a store root
    must be strictly under /dev/shm), unmounted and removed afterwards. Needs root (the
    suite runs as root)."""
    path = Path(f"/dev/shm/vllm-artifact-test-tmpfs-{secrets.token_hex(4)}")
    path.mkdir(mode=0o700)
    try:
        opts = f"size={size_bytes},mode=0700,uid={os.geteuid()},gid={os.getegid()}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
        try:
            yield path
        finally:
            gc.collect()  # drop mappings of closed stores' leftover views
            if subprocess.run(["umount", str(path)], check=False).returncode:
                subprocess.run(["umount", "-l", str(path)], check=False)
    finally:
        path.rmdir()
