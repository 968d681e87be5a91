"""A /dev/shm that is (nearly) full: every store file is allocated when the writer opens, so
the writer fails at startup with ShmSpaceError naming the fix, never with SIGBUS later; and a
store that changes capacity needs room for the new arena only, not for old and new at once.

Each test mounts a small tmpfs under /dev/shm (the suite runs as root). Opens that could die
of SIGBUS run in a subprocess, where a SIGBUS shows as return code -7 instead of killing
pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_arena import ARENA_NAME, ArenaGeometry
from vllm_artifact.core.store.shm_gc import LOCK_NAME
from vllm_artifact.core.store.shm_metrics import METRICS_NAME

from .conftest import key_for, remount_tmpfs, rows_for

PAGE = 4096
#: The writer's files beside the arena: writer.lock and metrics, one page each.
SIDE_FILES = 2 * PAGE

_OPEN = """
import sys
from vllm_artifact.core import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import ShmSpaceError

layout = R3Layout(num_layers=6, top_k=4, num_experts=64, block_size=16, dense_layers=(2,))
try:
    store = ShmStore.create_or_open_writer(
        sys.argv[1], "s", layout=layout, capacity_bytes=int(sys.argv[2]), collect_expired=False
    )
except ShmSpaceError as err:
    print("ShmSpaceError:", err)
else:
    print("opened:", store.stats().objects, "objects")
    store.close()
"""


def open_in_subprocess(root: str, capacity: int) -> str:
    """Open the writer in a fresh process; its output, or a failure that names a SIGBUS."""
    res = subprocess.run(
        [sys.executable, "-c", _OPEN, root, str(capacity)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode != -signal.SIGBUS, "the writer died of SIGBUS:\n" + res.stderr
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_full_shm_fails_at_startup_with_the_fix_not_sigbus(
    small_tmpfs: Callable[[int], str], layout: R3Layout
) -> None:
    """Room for the lock file and the arena but not for the metrics file: before the fix the
    arena was allocated, the metrics file was created sparse, and its first write died of
    SIGBUS (at every restart)."""
    geometry = ArenaGeometry(layout, 64)
    root = small_tmpfs(geometry.file_nbytes + PAGE)  # lock + arena; not the metrics page
    out = open_in_subprocess(root, geometry.file_nbytes)
    assert out.startswith("ShmSpaceError:"), out
    assert "--shm-size" in out and "--ipc=host" in out and "--artifact-capacity" in out
    assert not [n for n in os.listdir(f"{root}/s") if n.startswith("arena.tmp-")]
    # With the room the message asks for, the same writer starts.
    remount_tmpfs(root, geometry.file_nbytes + SIDE_FILES)
    assert open_in_subprocess(root, geometry.file_nbytes).startswith("opened: 0 objects")


@pytest.mark.parametrize("lost", [METRICS_NAME, LOCK_NAME])
def test_reopen_with_no_room_for_a_side_file_is_a_clean_error(
    small_tmpfs: Callable[[int], str], layout: R3Layout, namespace: Namespace, lost: str
) -> None:
    """The arena is already there (a restart reuses it, so no space check runs); the
    metrics or lock file must be allocated again and /dev/shm has no page left for it.
    Before the fix: SIGBUS for the metrics file, a raw OSError(ENOSPC) for the lock."""
    geometry = ArenaGeometry(layout, 64)
    root = small_tmpfs(geometry.file_nbytes + SIDE_FILES)
    key = key_for(namespace, 1)
    with _open(root, geometry) as store:
        store.put([(key, rows_for(layout, 1), 0)])
    os.unlink(f"{root}/s/{METRICS_NAME}")
    if lost == LOCK_NAME:
        os.unlink(f"{root}/s/{LOCK_NAME}")
    _fill(root)
    out = open_in_subprocess(root, geometry.file_nbytes)
    assert out.startswith("ShmSpaceError:"), out
    assert "--shm-size" in out and "--ipc=host" in out and "--artifact-capacity" in out
    # The store is intact: once there is room, the next writer finds the object again.
    os.unlink(f"{root}/filler")
    with _open(root, geometry) as store:
        assert store.recovery is not None and store.recovery.objects == 1
        np.testing.assert_array_equal(store.get([key])[0], rows_for(layout, 1))


def test_a_larger_capacity_needs_room_for_the_new_arena_only(
    small_tmpfs: Callable[[int], str], layout: R3Layout, namespace: Namespace
) -> None:
    """Before the fix the new arena was allocated beside the old one (the space check counted
    the old one as reclaimable, but it was still there): ShmSpaceError although the new arena
    alone fits."""
    old, new = ArenaGeometry(layout, 64), ArenaGeometry(layout, 128)
    room = new.file_nbytes + SIDE_FILES
    assert room < old.file_nbytes + new.file_nbytes + SIDE_FILES
    root = small_tmpfs(room)
    with _open(root, old) as store:
        store.put([(key_for(namespace, 1), rows_for(layout, 1), 0)])
    with _open(root, new) as store:
        assert store.recovery is not None and store.recovery.recreated
        assert store.geometry == new
        keys = [key_for(namespace, i) for i in range(new.slot_count)]
        store.put_blocks(keys, rows_for(layout, 7, len(keys) * layout.block_size), 0)
        assert store.stats().objects == new.slot_count
    assert sorted(os.listdir(f"{root}/s")) == [ARENA_NAME, METRICS_NAME, LOCK_NAME]
    # And back to the smaller one.
    with _open(root, old) as store:
        assert store.recovery is not None and store.recovery.recreated


def _open(root: str, geometry: ArenaGeometry) -> ShmStore:
    return ShmStore.create_or_open_writer(
        root,
        "s",
        layout=geometry.layout,
        capacity_bytes=geometry.file_nbytes,
        collect_expired=False,
    )


def _fill(root: str) -> None:
    """Take every free page of the tmpfs (a file beside the store)."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    fd = os.open(f"{root}/filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if free:
            os.posix_fallocate(fd, 0, free)
    finally:
        os.close(fd)
    assert os.statvfs(root).f_bavail == 0
