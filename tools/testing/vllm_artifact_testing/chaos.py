"""Crash injection for reliability tests: SIGKILL a vLLM engine, or only its rank-zero worker
(the R3 writer), mid-generation; then check what a restarted engine finds on the same root."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from vllm_artifact.core.store import ScrubReport, ShmStore
from vllm_artifact.core.store.shm_arena import TMP_PREFIX
from vllm_artifact.core.store.shm_metrics import StoreMetrics

#: What to kill: every vLLM process under a parent, or only TP rank zero's worker.
TARGETS = ("engine", "rank-zero-worker")


def vllm_processes(parent_pid: int) -> dict[str, list[psutil.Process]]:
    """vLLM's processes below ``parent_pid`` by role, from the titles vLLM gives them
    (``VLLM::EngineCore``, ``VLLM::Worker`` / ``VLLM::Worker_TP0``, ...)."""
    found: dict[str, list[psutil.Process]] = {"engine": [], "rank-zero-worker": []}
    try:
        children = psutil.Process(parent_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            title = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "VLLM::" not in title:
            continue
        found["engine"].append(child)
        worker = title.split("VLLM::", 1)[1].split()[0]
        if worker.startswith("Worker") and ("_TP" not in worker or "_TP0" in worker):
            found["rank-zero-worker"].append(child)
    return found


def sigkill(parent_pid: int, target: str) -> list[int]:
    """SIGKILL ``target`` (see :data:`TARGETS`) below ``parent_pid``; returns the pids."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    victims = vllm_processes(parent_pid)[target]
    if not victims:
        raise RuntimeError(f"no vLLM {target} process below pid {parent_pid}")
    return sigkill_processes(victims)


def vllm_shm_segments(processes: list[psutil.Process]) -> set[str]:
    """The ``/dev/shm`` segments of vLLM's own that ``processes`` map (its CPU build's tensor-
    parallel ``vllm_dist_*`` buffers): a SIGKILL leaves them behind, so the killer unlinks
    them."""
    segments: set[str] = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            segments.update(
                region.path
                for region in process.memory_maps()
                if region.path.startswith("/dev/shm/vllm_dist_")
            )
    return segments


def sigkill_processes(processes: list[psutil.Process]) -> list[int]:
    """SIGKILL ``processes`` and wait until they are gone; raises if one outlives 30 s."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(processes, timeout=30)
    if alive:
        raise RuntimeError(f"processes survived SIGKILL for 30 s: {alive}")
    return [process.pid for process in processes]


def published(root: Path) -> int:
    """Objects the writer of the one store under ``root`` has published so far (its
    counters file; 0 before it exists)."""
    names = store_names(root)
    snapshot = StoreMetrics.read(root / names[0]) if names else None
    return 0 if snapshot is None else snapshot.published_objects


def wait_for_publications(root: Path, more_than: int, timeout: float = 120.0) -> int:
    """Wait until the writer under ``root`` has published more than ``more_than`` objects
    (the engine is busy publishing); returns the count."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        count = published(root)
        if count > more_than:
            return count
        time.sleep(0.05)
    raise TimeoutError(f"the store under {root} published no more than {more_than} objects")


def store_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("r3-"))


@dataclass(frozen=True)
class RootCheck:
    """What a restarted engine's root holds: its stores, leftover temporary files, and the
    scrub (every object read back with its checks) of each store."""

    stores: list[str]
    leftovers: list[str]
    scrubs: dict[str, ScrubReport]

    @property
    def corrupt(self) -> int:
        return sum(len(report.corrupt) for report in self.scrubs.values())

    @property
    def objects(self) -> int:
        return sum(report.checked for report in self.scrubs.values())


def check_root(root: Path) -> RootCheck:
    stores = store_names(root)
    leftovers = [
        str(path.relative_to(root))
        for name in stores
        for path in (root / name).iterdir()
        if path.name.startswith(TMP_PREFIX)
    ]
    scrubs = {}
    for name in stores:
        reader = ShmStore.open_reader(str(root), name)
        try:
            scrubs[name] = reader.scrub()
        finally:
            reader.close()
    return RootCheck(stores, leftovers, scrubs)
