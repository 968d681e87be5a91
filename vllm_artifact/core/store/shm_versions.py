"""The weight versions a store's objects are keyed under, readable by other engines.

Why: keys bind the weight version, so an engine that looks for R3 another engine computed
under other weights (a PD producer updated before its consumer) finds nothing. To say *why*
rather than "missing", each writer keeps the versions it has keyed objects under in a small
file ``weights.json`` of its store directory (newest last, at most
:data:`MAX_RECORDED_VERSIONS`); a reader tries the key of a missing block under each of them.

The file is replaced atomically (written under a temporary name, then renamed), opened with
the same checks as every store file, and read with a size bound; an unreadable file reads as
no versions (it only sharpens an error message).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets

from vllm_artifact.core.store.shm_root import open_file, open_root, open_store_dir

__all__ = [
    "MAX_RECORDED_VERSIONS",
    "VERSIONS_NAME",
    "read_weight_versions",
    "record_weight_version",
]

VERSIONS_NAME = "weights.json"
VERSIONS_TMP_PREFIX = "weights.json.tmp-"
#: Versions a store remembers (its objects of older ones are long evicted in an RL loop).
MAX_RECORDED_VERSIONS = 32
_MAX_FILE_NBYTES = 1 << 20


def record_weight_version(root: str, name: str, version: str) -> tuple[str, ...]:
    """Add ``version`` (as the newest) to the versions of store ``root/name``; the writer
    calls this before it keys any object under the version. Returns the recorded versions."""
    root_fd = open_root(root, create=False)
    try:
        dir_fd = open_store_dir(root_fd, name, create=False, where=root)
    finally:
        os.close(root_fd)
    try:
        versions = [v for v in _read(dir_fd, f"{root}/{name}") if v != version]
        versions = [*versions, version][-MAX_RECORDED_VERSIONS:]
        tmp = f"{VERSIONS_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = open_file(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, where=f"{root}/{name}")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump({"weight_versions": versions}, file)
            os.rename(tmp, VERSIONS_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        return tuple(versions)
    finally:
        os.close(dir_fd)


def read_weight_versions(root: str, name: str) -> tuple[str, ...]:
    """The versions store ``root/name`` recorded, oldest first; () if there is no readable
    record (a store of an older vllm-artifact, a store being removed)."""
    try:
        root_fd = open_root(root, create=False)
        try:
            dir_fd = open_store_dir(root_fd, name, create=False, where=root)
        finally:
            os.close(root_fd)
    except Exception:  # UnsafeRootError, StoreNotFoundError, OSError: nothing to trust
        return ()
    try:
        return _read(dir_fd, f"{root}/{name}")
    finally:
        os.close(dir_fd)


def _read(dir_fd: int, where: str) -> tuple[str, ...]:
    try:
        fd = open_file(dir_fd, VERSIONS_NAME, os.O_RDONLY, where=where)
    except Exception:
        return ()
    try:
        raw = os.read(fd, _MAX_FILE_NBYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_FILE_NBYTES:
        return ()
    try:
        versions = json.loads(raw).get("weight_versions")
    except (ValueError, AttributeError):
        return ()
    if not isinstance(versions, list) or not all(isinstance(v, str) and v for v in versions):
        return ()
    return tuple(versions[-MAX_RECORDED_VERSIONS:])
