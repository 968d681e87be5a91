"""What one thread waits on: samples its state, system call and kernel stack from /proc.

    python tools/gpu/perf/waits.py PID [--tid TID] [--out FILE]

Runs beside the engine (another process, another core) until SIGINT or SIGTERM, then writes
JSON counts: samples by state (R running, S sleeping, D uninterruptible), and for each
sleeping sample its system call (``futex``: a lock, the GIL among them; ``ioctl``: the GPU
driver), the futex address (one dominant address is one lock), the kernel's wait channel and,
where /proc lets root read it, the top of the kernel stack (``rwsem_down_read_slowpath``: the
address space lock). py-spy shows where the Python code is; this shows what the thread waits
for while it is off the CPU, at a cost to the engine of a few /proc reads a millisecond.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# x86_64 system call numbers of the calls a waiting engine thread sits in.
SYSCALLS = {
    0: "read",
    1: "write",
    7: "poll",
    9: "mmap",
    11: "munmap",
    16: "ioctl",
    23: "select",
    24: "sched_yield",
    35: "nanosleep",
    44: "sendto",
    45: "recvfrom",
    46: "sendmsg",
    47: "recvmsg",
    202: "futex",
    230: "clock_nanosleep",
    232: "epoll_wait",
    270: "pselect6",
    271: "ppoll",
    281: "epoll_pwait",
    441: "epoll_pwait2",
}


def read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace")


def open_or_none(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY)
        read(fd)  # root-only files open but fail to read otherwise
        return fd
    except OSError:
        return None


def mapping_of(pid: int, addresses: list[str]) -> dict[str, str]:
    """Each futex address's mapping in /proc/PID/maps: a lock in the interpreter's static data
    (the GIL) names python's binary or libpython, a driver lock libcuda or an anonymous heap."""
    named: dict[str, str] = {}
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return named
    for address in addresses:
        value = int(address, 16)
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= value < high:
                named[address] = (rest[4] if len(rest) > 4 else "[anonymous]").rsplit("/", 1)[-1]
                break
    return named


def sample(pid: int, tid: int, stop_after: float) -> dict[str, object]:
    base = f"/proc/{pid}/task/{tid}"
    stat = os.open(f"{base}/stat", os.O_RDONLY)
    syscall = open_or_none(f"{base}/syscall")
    wchan = open_or_none(f"{base}/wchan")
    stack = open_or_none(f"{base}/stack")
    states: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    futexes: collections.Counter[str] = collections.Counter()
    channels: collections.Counter[str] = collections.Counter()
    stacks: collections.Counter[str] = collections.Counter()
    stopping = [False]

    def stop(*_: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print("sampling", flush=True)  # the caller starts its round after this line
    started = time.perf_counter()
    n = 0
    while not stopping[0] and time.perf_counter() - started < stop_after:
        try:
            state = read(stat).rpartition(")")[2].split()[0]
        except OSError:
            break  # the thread is gone
        n += 1
        states[state] += 1
        if state in ("S", "D"):
            if syscall is not None:
                fields = read(syscall).split()
                if fields and fields[0].lstrip("-").isdigit():
                    name = SYSCALLS.get(int(fields[0]), fields[0])
                    calls[name] += 1
                    if name == "futex" and len(fields) > 1:
                        futexes[fields[1]] += 1
                else:
                    calls[fields[0] if fields else "?"] += 1
            if wchan is not None:
                channels[read(wchan).strip() or "0"] += 1
            if stack is not None:
                frames = [line.split()[-1].split("+")[0] for line in read(stack).splitlines()]
                stacks[" < ".join(frames[:4])] += 1
        time.sleep(0.0002)
    seconds = time.perf_counter() - started
    top_futexes = [address for address, _ in futexes.most_common(6)]
    mappings = mapping_of(pid, top_futexes)
    return {
        "samples": n,
        "seconds": round(seconds, 3),
        "states": dict(states),
        "syscalls": dict(calls.most_common(12)),
        "futex_addresses": {
            f"{address} {mappings.get(address, '?')}": futexes[address] for address in top_futexes
        },
        "wchan": dict(channels.most_common(12)),
        "kernel_stacks": dict(stacks.most_common(12)),
        "readable": {
            "syscall": syscall is not None,
            "wchan": wchan is not None,
            "stack": stack is not None,
        },
    }


class WaitSampler:
    """This script in its own process for the length of a ``with`` block (a timed round)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.result: dict[str, object] = {}

    def __enter__(self) -> WaitSampler:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(self.pid)], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # "sampling"
        return self

    def __exit__(self, *_: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=30)
        self.result = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--tid", type=int, default=0, help="default: the main thread (= pid)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args()
    result = sample(args.pid, args.tid or args.pid, args.max_seconds)
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
