"""Fault injection into a live R3 store, for tests: flip bytes in place, as a bad disk or a
stray writer would."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from vllm_artifact.core.envelope import HEADER_NBYTES
from vllm_artifact.core.store import ShmStore

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
