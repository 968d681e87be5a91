"""Hardware counters of one thread (Linux ``perf_event_open``), read around a round.

Why: in CPU-bound rounds the two engines' CPUs run at speeds that differ from round to round
by about 10%, which hides a 1% difference in throughput. The instructions a thread retires
do not depend on that speed: the instructions of the engine's main thread per round, ours
against off, say how much work R3 adds to the thread that bounds the round, and cycles per
instruction how fast that CPU ran it. Counters a virtual machine does not expose read as
None (``open_counters`` says why on the command line: ``python3 hw_counters.py``).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from pathlib import Path

__all__ = ["ThreadCounters", "open_counters"]

_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(os.uname().machine)
_PERF_TYPE_HARDWARE = 0
#: a software event (``PERF_TYPE_SOFTWARE``, config 1: the task clock in ns): any kernel has it,
#: so the tests check this module's way to the kernel with it where no PMU is exposed
SOFTWARE_TASK_CLOCK = (1, 1)
#: ``perf_event_attr.config`` of the hardware events read here.
EVENTS = {"instructions": 1, "cycles": 0}
# perf_event_attr's flag bits: exclude_kernel (5) and exclude_hv (6); the thread's user-space
# work is what R3 adds, and a VM's counters often refuse kernel counting.
_EXCLUDE_KERNEL_AND_HV = (1 << 5) | (1 << 6)
_ATTR_SIZE = 64  # PERF_ATTR_SIZE_VER0: the fields _attr packs, then zeros

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _attr(config: int, kind: int = _PERF_TYPE_HARDWARE) -> bytes:
    """A ``perf_event_attr`` (type, size, config, sample period, sample type, read format,
    flags, then zeros) counting ``config`` in user space."""
    head = struct.pack("IIQQQQQ", kind, _ATTR_SIZE, config, 0, 0, 0, _EXCLUDE_KERNEL_AND_HV)
    return head + bytes(_ATTR_SIZE - len(head))


def _open(tid: int, config: int, kind: int = _PERF_TYPE_HARDWARE) -> int:
    """A counting file descriptor of event ``config`` of type ``kind`` on thread ``tid``."""
    if _PERF_EVENT_OPEN is None:
        raise OSError("perf_event_open: unknown syscall number on this machine")
    attr = ctypes.create_string_buffer(_attr(config, kind), _ATTR_SIZE)
    # syscall(2) is variadic: pid, cpu and group_fd are ints, flags an unsigned long
    fd = _libc.syscall(
        ctypes.c_long(_PERF_EVENT_OPEN),
        attr,
        ctypes.c_int(tid),
        ctypes.c_int(-1),
        ctypes.c_int(-1),
        ctypes.c_ulong(0),
    )
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"perf_event_open: {os.strerror(errno)}")
    return int(fd)


class ThreadCounters:
    """The :data:`EVENTS` of thread ``tid`` since this was made; :meth:`read` then
    :meth:`close`."""

    def __init__(self, tid: int) -> None:
        self._fds: dict[str, int] = {}
        try:
            for name, config in EVENTS.items():
                self._fds[name] = _open(tid, config)
        except OSError:
            self.close()
            raise

    def read(self) -> dict[str, int]:
        return {name: struct.unpack("Q", os.read(fd, 8))[0] for name, fd in self._fds.items()}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def open_counters(tid: int) -> tuple[ThreadCounters | None, str]:
    """Counters of ``tid``, or None and why not (no PMU in the VM, a paranoid setting)."""
    try:
        return ThreadCounters(tid), ""
    except OSError as error:
        return None, str(error)


def _check() -> int:
    """Count a busy loop on this thread, then one twice as long: instructions should
    about double."""
    paranoid = Path("/proc/sys/kernel/perf_event_paranoid")
    print(f"perf_event_paranoid {paranoid.read_text().strip() if paranoid.exists() else '?'}")
    counts = []
    for n in (200_000, 400_000):
        counter, why = open_counters(threading.get_native_id())
        if counter is None:
            print(f"no counters: {why}")
            return 1
        sum(i * i for i in range(n))
        counts.append(counter.read())
        counter.close()
    doubled = counts[1]["instructions"] / max(counts[0]["instructions"], 1)
    print(counts, f"ratio of instructions {doubled:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(_check())
