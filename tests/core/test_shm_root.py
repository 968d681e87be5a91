"""Hostile roots and files: symlinks, outside /dev/shm, wrong owner or mode."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.store import ShmStore, check_root, check_store_name, default_root
from vllm_artifact.core.store.shm_arena import ARENA_NAME
from vllm_artifact.core.store.shm_gc import LOCK_NAME
from vllm_artifact.core.store.shm_metrics import METRICS_NAME
from vllm_artifact.errors import UnsafeRootError

from .conftest import key_for, rows_for

OTHER_UID = 54321


@pytest.fixture
def scratch() -> Iterator[str]:
    path = f"/dev/shm/vat-hostile-{os.getpid()}-{secrets.token_hex(3)}"
    os.mkdir(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def writer(root: str, layout: R3Layout) -> ShmStore:
    return ShmStore.create_or_open_writer(root, "s", layout=layout, capacity_bytes=1 << 20)


def test_default_root_and_creation(scratch: str) -> None:
    assert default_root() == f"/dev/shm/vllm-artifact-{os.geteuid()}"
    root = f"{scratch}/new"
    assert check_root(root) == root
    st = os.stat(root)
    assert st.st_mode & 0o777 == 0o700 and st.st_uid == os.geteuid()


@pytest.mark.parametrize(
    "bad",
    [
        "/tmp/vat-root",
        "/dev/shm",
        "/dev/shmx/a",
        "relative/root",
        "/dev/shm/a/../b",
        "/dev/shm/./a",
    ],
)
def test_outside_or_unnormalized_roots(bad: str) -> None:
    with pytest.raises(UnsafeRootError, match="refusing store root"):
        check_root(bad)


def test_symlinked_root_rejected(scratch: str, layout: R3Layout) -> None:
    real = f"{scratch}/real"
    os.mkdir(real, 0o700)
    os.symlink(real, f"{scratch}/link")
    with pytest.raises(UnsafeRootError, match="symlink"):
        check_root(f"{scratch}/link")
    with pytest.raises(UnsafeRootError):
        writer(f"{scratch}/link/sub", layout)  # symlink in the middle of the path
    os.symlink("/tmp", f"{scratch}/escape")
    with pytest.raises(UnsafeRootError):
        writer(f"{scratch}/escape", layout)
    assert not os.path.exists("/tmp/s")


def test_wrong_owner_or_mode(scratch: str, layout: R3Layout) -> None:
    loose = f"{scratch}/loose"
    os.mkdir(loose, 0o700)
    os.chmod(loose, 0o755)
    with pytest.raises(UnsafeRootError, match="mode is 0755"):
        writer(loose, layout)
    foreign = f"{scratch}/foreign"
    os.mkdir(foreign, 0o700)
    os.chown(foreign, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeRootError, match=f"uid {OTHER_UID}"):
        writer(foreign, layout)
    os.chmod(scratch, 0o777)  # world-writable ancestor
    try:
        with pytest.raises(UnsafeRootError, match="writable by others"):
            check_root(f"{scratch}/deeper")
    finally:
        os.chmod(scratch, 0o700)


def test_hostile_store_dir_and_files(scratch: str, layout: R3Layout, namespace: Namespace) -> None:
    root = f"{scratch}/root"
    with writer(root, layout) as store:
        store.put([(key_for(namespace, 1), rows_for(layout, 1), 0)])
    arena = f"{root}/s/{ARENA_NAME}"
    # Arena readable by others: refused.
    os.chmod(arena, 0o644)
    with pytest.raises(UnsafeRootError, match="0644"):
        ShmStore.open_reader(root, "s")
    os.chmod(arena, 0o600)
    # Arena replaced by a symlink: never followed.
    os.rename(arena, f"{root}/elsewhere")
    os.symlink(f"{root}/elsewhere", arena)
    with pytest.raises(UnsafeRootError, match="symlink"):
        ShmStore.open_reader(root, "s")
    os.unlink(arena)
    os.rename(f"{root}/elsewhere", arena)
    # Arena owned by someone else: refused.
    os.chown(arena, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeRootError, match="owned by uid"):
        ShmStore.open_reader(root, "s")
    os.chown(arena, os.geteuid(), os.getegid())
    reader = ShmStore.open_reader(root, "s")
    np.testing.assert_array_equal(reader.get([key_for(namespace, 1)])[0], rows_for(layout, 1))
    reader.close()
    # Store directory replaced by a symlink: refused.
    os.rename(f"{root}/s", f"{root}/t")
    os.symlink(f"{root}/t", f"{root}/s")
    with pytest.raises(UnsafeRootError):
        ShmStore.open_reader(root, "s")
    with pytest.raises(UnsafeRootError):
        writer(root, layout)


def _stored(root: str, layout: R3Layout, namespace: Namespace) -> None:
    with writer(root, layout) as store:
        store.put([(key_for(namespace, 1), rows_for(layout, 1), 0)])


def _opens(root: str, who: str, layout: R3Layout) -> None:
    store = writer(root, layout) if who == "writer" else ShmStore.open_reader(root, "s")
    store.close()


#: Which handles open each store file: the reader maps only the arena.
_OPENERS = [
    (ARENA_NAME, "writer"),
    (ARENA_NAME, "reader"),
    (LOCK_NAME, "writer"),
    (METRICS_NAME, "writer"),
]


@pytest.mark.parametrize(("name", "who"), _OPENERS)
@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_store_file_is_unsafe_not_a_raw_oserror(
    scratch: str, layout: R3Layout, namespace: Namespace, name: str, who: str, dangling: bool
) -> None:
    """Before the fix: a raw OSError(ELOOP) from the O_NOFOLLOW open."""
    root = f"{scratch}/root"
    _stored(root, layout, namespace)
    path = f"{root}/s/{name}"
    os.rename(path, f"{root}/elsewhere")
    os.symlink("/dev/shm/nowhere" if dangling else f"{root}/elsewhere", path)
    with pytest.raises(UnsafeRootError, match=f"'{name}' is a symlink"):
        _opens(root, who, layout)
    assert os.path.islink(path)  # refused, not replaced or followed


@pytest.mark.parametrize(("name", "who"), _OPENERS)
def test_a_hardlinked_store_file_is_refused(
    scratch: str, layout: R3Layout, namespace: Namespace, name: str, who: str
) -> None:
    """A store file with a second name can be changed (or kept) through that name. Before
    the fix it was accepted."""
    root = f"{scratch}/root"
    _stored(root, layout, namespace)
    os.link(f"{root}/s/{name}", f"{root}/second-name")
    with pytest.raises(UnsafeRootError, match=f"'{name}' has 2 links"):
        _opens(root, who, layout)
    os.unlink(f"{root}/second-name")
    _opens(root, who, layout)


def test_a_fifo_in_place_of_the_arena_does_not_hang_a_reader(
    scratch: str, layout: R3Layout, namespace: Namespace
) -> None:
    """Opening a FIFO for reading waits for a writer to open it: a reader used to hang."""
    root = f"{scratch}/root"
    _stored(root, layout, namespace)
    os.unlink(f"{root}/s/{ARENA_NAME}")
    os.mkfifo(f"{root}/s/{ARENA_NAME}", 0o600)
    code = (
        "import sys\n"
        "from vllm_artifact.core.store import ShmStore\n"
        "from vllm_artifact.errors import UnsafeRootError\n"
        "try:\n"
        "    ShmStore.open_reader(sys.argv[1], 's')\n"
        "except UnsafeRootError as err:\n"
        "    print(err)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, root], capture_output=True, text=True, timeout=60, check=True
    )
    assert "'arena' is not a regular file" in res.stdout
    with pytest.raises(UnsafeRootError, match="not a regular file"):
        writer(root, layout)


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden", "x" * 65, "sp ace", "ü"])
def test_store_names_are_single_safe_components(name: str) -> None:
    with pytest.raises(UnsafeRootError):
        check_store_name(name)
    assert check_store_name("dp0-ns.abc_1") == "dp0-ns.abc_1"
