"""The trusted store root under /dev/shm, and safe file opening inside it.

Why so strict: /dev/shm is world-writable. Another local user could plant a
symlink or a directory of their own where we expect ours, to read R3, feed us
forged objects or make us write elsewhere. So the root must *really* be under
/dev/shm (no symlink anywhere in the path), be owned by us with mode 0700, and
every file below it is opened relative to a directory fd with ``O_NOFOLLOW``
and checked with ``fstat`` (owner, type, mode 0600) after opening.
"""

from __future__ import annotations

import errno
import os
import re
import stat

from vllm_artifact.errors import ShmSpaceError, StoreNotFoundError, UnsafeRootError

__all__ = [
    "SHM_MOUNT",
    "allocate",
    "check_root",
    "check_shm_space",
    "check_store_name",
    "default_root",
    "open_file",
    "open_root",
    "open_store_dir",
]

SHM_MOUNT = "/dev/shm"
#: errno values of a file system (or memory cgroup) that cannot back more pages.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOMEM})
_SPACE_FIX = (
    "Give the container more shared memory (docker --shm-size=<size> or --ipc=host), or set "
    "a smaller --artifact-capacity."
)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def default_root() -> str:
    """``/dev/shm/vllm-artifact-<uid>``: one private root per user."""
    return f"{SHM_MOUNT}/vllm-artifact-{os.geteuid()}"


def check_store_name(name: str) -> str:
    """A store name is one path component: ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UnsafeRootError(
            f"store name {name!r} is not allowed: use 1-64 characters of [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return name


def _unsafe(root: str, why: str) -> UnsafeRootError:
    return UnsafeRootError(
        f"refusing store root {root!r}: {why}. Use a directory under {SHM_MOUNT} that you "
        f"own with mode 0700 (default {default_root()}), or remove the offending path."
    )


def _lexical(root: str | os.PathLike[str]) -> str:
    path = os.fspath(root)
    if not isinstance(path, str) or not os.path.isabs(path):
        raise _unsafe(str(path), "the root must be an absolute path")
    norm = os.path.normpath(path)
    if norm != path.rstrip("/") or "/../" in f"{path}/":
        raise _unsafe(path, "the root must be a normalized path without '..'")
    if not norm.startswith(SHM_MOUNT + "/"):
        raise _unsafe(path, f"the root is not under {SHM_MOUNT}")
    return norm


def _check_dir_stat(root: str, dir_stat: os.stat_result, *, exact_mode: bool) -> None:
    if not stat.S_ISDIR(dir_stat.st_mode):
        raise _unsafe(root, "it is not a directory")
    if dir_stat.st_uid != os.geteuid():
        raise _unsafe(root, f"it is owned by uid {dir_stat.st_uid}, not by uid {os.geteuid()}")
    mode = stat.S_IMODE(dir_stat.st_mode)
    if exact_mode and mode != 0o700:
        raise _unsafe(root, f"its mode is {mode:04o}, not 0700 (chmod 700 it)")
    if not exact_mode and mode & 0o022:
        raise _unsafe(root, f"an ancestor has mode {mode:04o} (writable by others)")


def open_root(root: str | os.PathLike[str], *, create: bool) -> int:
    """Validate ``root`` and return an ``O_DIRECTORY`` fd for it.

    Creates the last component (mode 0700) when ``create`` is set. Every
    component between /dev/shm and the root must be a real directory owned by
    us and not writable by others; the root itself must be mode 0700.
    """
    norm = _lexical(root)
    if os.path.realpath(SHM_MOUNT) != SHM_MOUNT:
        raise _unsafe(norm, f"{SHM_MOUNT} itself is a symlink")
    parts = norm[len(SHM_MOUNT) + 1 :].split("/")
    fd = os.open(SHM_MOUNT, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            created = last and create and _make_private_dir(part, fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise StoreNotFoundError(
                    f"store root {norm!r} does not exist; start the engine (writer) first"
                ) from None
            except OSError as err:  # ELOOP (symlink) or ENOTDIR
                raise _unsafe(norm, f"{part!r} is a symlink or not a directory ({err})") from None
            os.close(fd)
            fd = child
            if created:
                os.fchmod(fd, 0o700)
            _check_dir_stat(norm, os.fstat(fd), exact_mode=last)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _make_private_dir(name: str, dir_fd: int) -> bool:
    """``mkdir name`` (mode 0700) under ``dir_fd``; False if it already existed."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def check_root(root: str | os.PathLike[str], *, create: bool = True) -> str:
    """Raise :class:`UnsafeRootError` unless ``root`` is a safe store root.

    Returns the normalized root path.
    """
    os.close(open_root(root, create=create))
    return _lexical(root)


def open_store_dir(root_fd: int, name: str, *, create: bool, where: str) -> int:
    """Open (maybe create) the store directory ``name`` under ``root_fd``."""
    check_store_name(name)
    created = create and _make_private_dir(name, root_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        raise StoreNotFoundError(
            f"no store {name!r} under {where!r}; is the engine running with R3 enabled, "
            "and are root and store name the same as the engine's?"
        ) from None
    except OSError as err:
        raise _unsafe(f"{where}/{name}", f"not a plain directory ({err})") from None
    try:
        if created:
            os.fchmod(fd, 0o700)
        _check_dir_stat(f"{where}/{name}", os.fstat(fd), exact_mode=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, name: str, flags: int, *, where: str) -> int:
    """Open a file below a checked directory: no symlinks, a regular file with no other
    name, ours, mode 0600. A missing file raises ``FileNotFoundError``.

    ``O_NONBLOCK``: a FIFO planted in place of a store file must not block the open (it is
    then refused as not a regular file); regular files ignore the flag.
    """
    try:
        fd = os.open(
            name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=dir_fd
        )
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _unsafe(where, f"{name!r} is a symlink") from None
        if err.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.ETXTBSY):
            raise _unsafe(where, f"{name!r} is not a regular file ({err.strerror})") from None
        if err.errno in _NO_SPACE:
            raise ShmSpaceError(
                f"{SHM_MOUNT} has no room to create {name!r} of R3 store {where}: "
                f"{err.strerror}. {_SPACE_FIX}"
            ) from err
        raise
    try:
        file_stat = os.fstat(fd)
        if not stat.S_ISREG(file_stat.st_mode):
            raise _unsafe(where, f"{name!r} is not a regular file")
        if file_stat.st_uid != os.geteuid():
            raise _unsafe(where, f"{name!r} is owned by uid {file_stat.st_uid}")
        if file_stat.st_nlink != 1:
            raise _unsafe(
                where,
                f"{name!r} has {file_stat.st_nlink} links: another name can change it (or keep it "
                "alive); remove the other names",
            )
        if stat.S_IMODE(file_stat.st_mode) != 0o600:
            if flags & os.O_CREAT and file_stat.st_size == 0:
                os.fchmod(fd, 0o600)  # just created under a restrictive umask
            else:
                raise _unsafe(
                    where, f"{name!r} has mode {stat.S_IMODE(file_stat.st_mode):04o}, not 0600"
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def allocate(fd: int, nbytes: int, *, what: str, where: str) -> None:
    """Back the first ``nbytes`` of the file ``fd`` with memory now (``posix_fallocate``).

    Every file the store maps or writes is allocated up front: a page of a sparse tmpfs file
    is allocated when it is first touched, and if /dev/shm is full then, a mapped write dies
    with SIGBUS (and again at every restart). Here a full /dev/shm is a
    :class:`ShmSpaceError` that names the fix.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno in _NO_SPACE:
            raise ShmSpaceError(
                f"{SHM_MOUNT} has no room for {what} of R3 store {where} ({nbytes} bytes): "
                f"{os.strerror(err.errno)}. {_SPACE_FIX}"
            ) from err
        raise


def check_shm_space(
    root: str | os.PathLike[str], needed_bytes: int, *, reclaimable_bytes: int = 0
) -> None:
    """Fail early, with the fix, when the /dev/shm mount cannot hold the store.

    Containers often mount only 64 MiB at /dev/shm; a store that outgrows the
    mount would die with SIGBUS mid-run instead of a clear startup error.
    """
    path = _lexical(root)
    probe = path if os.path.exists(path) else SHM_MOUNT
    filesystem = os.statvfs(probe)
    free = filesystem.f_bavail * filesystem.f_frsize + reclaimable_bytes
    if free < needed_bytes:
        raise ShmSpaceError(
            f"{SHM_MOUNT} has {_size(free)} free but the R3 store needs {_size(needed_bytes)}. "
            f"{_SPACE_FIX}"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 10 * 2**20 else f"{nbytes / 2**10:.0f} KiB"
