"""Each configuration's engine on physical cores of its own (``driver.py --split-cpus``).

Two engines sharing a GPU in concurrent rounds also share the host's cores: the kernel's
scheduler moves their threads among the same cores and, where the machine has hyperthreads, may
put one engine's launching thread beside the other's, and an engine whose eager steps are bound
by that thread slows for as long as that lasts (whole rounds, which then scatter). Pinning each
configuration's processes (its worker, engine core and any process the engine core starts) to
whole physical cores of their own keeps them apart; dealing the core sets out again each round,
in rotation, makes any difference between the sets hit every configuration alike. On an H100
machine without hyperthreads it did not narrow the prefill rounds' scatter
(``docs/benchmarks.md``): there each CPU's own speed varies from round to round.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["pin_tree", "process_tree", "split_cores"]

SYS_CPU = Path("/sys/devices/system/cpu")


def core_of(cpu: int) -> tuple[int, int]:
    """The (package, core) a logical CPU belongs to (its own number if sysfs does not say)."""
    topology = SYS_CPU / f"cpu{cpu}" / "topology"
    try:
        return (
            int((topology / "physical_package_id").read_text()),
            int((topology / "core_id").read_text()),
        )
    except (OSError, ValueError):
        return (-1, cpu)


def split_cores(
    cpus: Iterable[int], parts: int, core: Callable[[int], tuple[int, int]] = core_of
) -> list[set[int]]:
    """``cpus`` as ``parts`` sets of whole physical cores (every hyperthread of a core in one
    set), equal in cores, consecutive cores together; cores left over stay unused."""
    cores: dict[tuple[int, int], set[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core(cpu), set()).add(cpu)
    ordered = [cores[key] for key in sorted(cores)]
    per_part = len(ordered) // parts
    if per_part == 0:
        raise ValueError(f"{len(ordered)} physical cores cannot be split {parts} ways")
    return [set().union(*ordered[i * per_part : (i + 1) * per_part]) for i in range(parts)]


def process_tree(roots: Iterable[int]) -> list[int]:
    """``roots`` and every process descended from them (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the parent is the second field after the command, which may hold spaces
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo.extend(children.get(pid, []))
    return found


def pin_tree(roots: Iterable[int], cpus: set[int]) -> int:
    """Pin every thread of every process in the trees of ``roots`` to ``cpus`` (threads and
    processes started later inherit it); the number of threads pinned."""
    pinned = 0
    for pid in process_tree(roots):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task.name), cpus)
                    pinned += 1
    return pinned
