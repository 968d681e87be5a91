"""Writer liveness and TTL collection of abandoned stores.

Liveness: the writer holds an exclusive ``flock`` on ``<store>/writer.lock``
for its whole lifetime. The kernel drops the lock when the process dies, even
on SIGKILL, so a held lock means a live writer, and PID reuse cannot fool it
(a PID file could). The lock file also records pid/host/start time for error
messages, and its mtime is the writer's heartbeat ("last active").

TTL: :func:`collect_expired_stores` removes a store only if it can take that
lock (writer dead) *and* the heartbeat is older than the TTL, so a live store
is never touched and a crashed engine that restarts within the TTL finds its
objects again. Removal renames the directory to ``.trash-*`` while holding the
lock, then deletes it; a writer that raced for the same name notices its
directory was unlinked and starts over (see :meth:`WriterLock.acquire`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import stat
import time
import weakref

from vllm_artifact.core.store.shm_root import allocate, check_store_name, open_file, open_root
from vllm_artifact.errors import StoreError, StoreNotFoundError, WriterConflictError

__all__ = ["LOCK_NAME", "TRASH_PREFIX", "WriterLock", "collect_expired_stores"]

LOCK_NAME = "writer.lock"
TRASH_PREFIX = ".trash-"


class StaleStoreDir(Exception):
    """The store directory was unlinked (collected) while we opened it; retry."""


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class WriterLock:
    """The flock held by a store's single writer.

    Not inherited: the fd is ``O_CLOEXEC`` (an exec'd child never sees it), and a forked
    child closes its copy at once (``os.register_at_fork``). A flock belongs to the open file
    description, which fork shares: a child that kept its copy would keep the store locked
    after the writer died. Closing the copy in the child leaves the parent's lock held (the
    parent still has its fd); the child's store handle then refuses to publish.
    """

    def __init__(self, fd: int, heartbeat_interval: float) -> None:
        self._fd: int | None = fd
        self._interval = heartbeat_interval
        self._last = time.monotonic()
        self.forked = False  # this is a forked child's copy: the lock is the parent's
        _HELD.add(self)

    @property
    def held(self) -> bool:
        """This process holds the lock (not released, not a forked child's copy)."""
        return self._fd is not None

    def _drop_in_child(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self.forked = True
            with contextlib.suppress(OSError):
                os.close(fd)

    @classmethod
    def acquire(
        cls, root_fd: int, dir_fd: int, name: str, *, where: str, heartbeat_interval: float = 1.0
    ) -> WriterLock:
        """Take the writer lock of the store directory ``dir_fd`` (= ``root/name``)."""
        fd = open_file(dir_fd, LOCK_NAME, os.O_RDWR | os.O_CREAT, where=where)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
                raise WriterConflictError(
                    f"R3 store {where!r} is owned by another live writer ({owner}). Give each "
                    "engine / data-parallel rank its own store name, or stop the other engine."
                ) from None
            try:
                linked_dir = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                linked_lock = os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise StaleStoreDir(where) from None
            if not (
                _same_file(linked_dir, os.fstat(dir_fd)) and _same_file(linked_lock, os.fstat(fd))
            ):
                raise StaleStoreDir(where)
            info = json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            ).encode()
            os.ftruncate(fd, 0)
            allocate(fd, len(info), what="its writer lock file", where=where)
            os.pwrite(fd, info, 0)
            os.utime(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, heartbeat_interval)

    def heartbeat(self, *, force: bool = False) -> None:
        """Refresh the lock file mtime (at most once per interval unless forced)."""
        fd = self._fd
        if fd is None:
            return
        now = time.monotonic()
        if force or now - self._last >= self._interval:
            self._last = now
            os.utime(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last fd drops the flock


#: Locks this process holds, for the fork hook below.
_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    for lock in list(_HELD):
        lock._drop_in_child()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _try_collect(root_fd: int, name: str, ttl_seconds: float, now: float) -> bool:
    try:
        dir_stat = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(dir_stat.st_mode) or dir_stat.st_uid != os.geteuid():
        return False  # not ours: never touch it
    dir_fd = os.open(
        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd
    )
    lock_fd: int | None = None
    try:
        if not _same_file(os.fstat(dir_fd), dir_stat):
            return False
        try:
            lock_fd = open_file(dir_fd, LOCK_NAME, os.O_RDWR, where=name)
        except FileNotFoundError:
            heartbeat = dir_stat.st_mtime  # writer died before creating its lock
        except StoreError:
            return False  # a lock that is not a plain file of ours: leave the store alone
        else:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # live writer
            heartbeat = os.fstat(lock_fd).st_mtime
        if now - heartbeat <= ttl_seconds:
            return False
        trash = f"{TRASH_PREFIX}{name}-{secrets.token_hex(4)}"
        os.rename(name, trash, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        os.close(dir_fd)
    shutil.rmtree(trash, dir_fd=root_fd)
    return True


def collect_expired_stores(
    root: str | os.PathLike[str], ttl_seconds: float, *, now: float | None = None
) -> list[str]:
    """Remove stores under ``root`` whose writer is dead and idle for > TTL.

    Returns the removed store names. Entries that are not our stores (wrong
    name, owner or type) are left alone; leftover ``.trash-*`` directories of
    an interrupted collection are deleted.
    """
    if ttl_seconds < 0:
        raise ValueError("ttl_seconds must be >= 0")
    try:
        root_fd = open_root(root, create=False)
    except StoreNotFoundError:
        return []
    now = time.time() if now is None else now
    removed = []
    try:
        for entry in os.scandir(root_fd):
            name = entry.name
            if name.startswith(TRASH_PREFIX) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
                continue
            try:
                check_store_name(name)
            except StoreError:
                continue
            if _try_collect(root_fd, name, ttl_seconds, now):
                removed.append(name)
    finally:
        os.close(root_fd)
    return removed
