"""What the benchmark reads of its processes around a round: each thread's CPU seconds,
context switches and page faults (``/proc``, psutil), cyclic-GC pauses, and Python's thread
names. ``gc_totals`` and ``python_thread_names`` also run in the engine core, shipped there by
value (``worker.py`` registers this module with cloudpickle)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any


def thread_cpu(pid: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, keyed ``name:tid`` (Python's
    thread name where known, else the kernel's)."""
    import psutil

    out: dict[str, float] = {}
    with contextlib.suppress(psutil.Error):
        for thread in psutil.Process(pid).threads():
            name = names.get(thread.id, "?")
            if name == "?":
                with contextlib.suppress(OSError):
                    name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
            out[f"{name}:{thread.id}"] = thread.user_time + thread.system_time
    return out


def thread_waits(pid: int, names: dict[int, str]) -> dict[str, dict[str, int]]:
    """Voluntary context switches and minor page faults of each thread of ``pid`` so far,
    keyed as :func:`thread_cpu` under ``switches`` and ``faults``. A switch is the thread
    blocking (on the GIL, a lock, the GPU, a socket), so against its CPU time it says whether a
    slower thread computes more or waits more; faults say which thread touches fresh memory."""
    out: dict[str, dict[str, int]] = {"switches": {}, "faults": {}}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                task = f"/proc/{pid}/task/{tid}"
                status = Path(f"{task}/status").read_text()
                stat = Path(f"{task}/stat").read_text().rsplit(")", 1)[1].split()
                name = names.get(int(tid)) or Path(f"{task}/comm").read_text().strip()
                switches = status.split("voluntary_ctxt_switches:")[1].split()[0]
                out["switches"][f"{name}:{tid}"] = int(switches)
                out["faults"][f"{name}:{tid}"] = int(stat[7])  # minflt, as process_counters
    return out


def gc_totals(_: Any = None) -> dict[str, float]:
    """Cyclic-GC collections and seconds per generation so far in this process (a callback
    installed on first call), and the objects the collector tracks now."""
    import gc

    # kept on the gc module: collective_rpc ships this function by value to the engine core
    seen: dict[str, float] | None = getattr(gc, "_perf_seen", None)
    if seen is None:
        seen = {}
        started: list[float] = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
                return
            assert seen is not None
            gen = info["generation"]
            took = time.perf_counter() - started[0]
            seen[f"gen{gen}_n"] = seen.get(f"gen{gen}_n", 0) + 1
            seen[f"gen{gen}_s"] = seen.get(f"gen{gen}_s", 0.0) + took
            seen[f"gen{gen}_max_s"] = max(seen.get(f"gen{gen}_max_s", 0.0), took)

        gc.callbacks.append(on_gc)
        gc._perf_seen = seen  # type: ignore[attr-defined]
    totals = dict(seen)
    totals["tracked"] = len(gc.get_objects())
    totals["frozen"] = gc.get_freeze_count()
    return totals


def gc_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: (v if k.endswith("max_s") or k in ("tracked", "frozen") else v - before.get(k, 0))
        for k, v in after.items()
    }


def process_counters(pid: int) -> dict[str, int]:
    """Page faults (minor, major) of a process and context switches (voluntary, involuntary)
    of its main thread so far (``/proc/PID/status`` counts the main thread's only; every
    thread's are in :func:`thread_waits`): fresh memory touched, and the main thread blocking
    or losing its CPU."""
    import psutil

    with contextlib.suppress(OSError, psutil.Error):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        switches = psutil.Process(pid).num_ctx_switches()
        return {
            "minflt": int(fields[7]),
            "majflt": int(fields[9]),
            "ctx_voluntary": switches.voluntary,
            "ctx_involuntary": switches.involuntary,
        }
    return {}


def python_thread_names() -> dict[int, str]:
    import threading

    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


#: ``driver.py --freeze-frontend-gc``: set in every configuration's environment, its frontend
#: freezes its heap after warming up
FREEZE_FRONTEND_GC = "PERF_FREEZE_FRONTEND_GC"

#: ``+thp``, ``+keep``: the environment of a configuration's processes (the frontend and its
#: engine), the allocator settings docs/configuration.md recommends for a process that takes
#: in large R3 arrays (the driver sets it at their start: glibc reads it then)
ALLOCATOR_VARIANTS = {
    "thp": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    "keep": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"},
}


def allocator_setting() -> str:
    """The allocator environment this process started with, glibc's version and the
    kernel's transparent huge pages mode (``hugetlb=1`` needs glibc 2.35 and ``madvise`` or
    ``always``)."""
    import platform

    names = sorted({name for env in ALLOCATOR_VARIANTS.values() for name in env})
    env = " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or "glibc defaults"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError as error:
        thp = f"unknown ({error.strerror})"
    return f"allocator: {env}; glibc {platform.libc_ver()[1]}; transparent huge pages {thp}"
