"""The three server configurations the benchmarks compare, and what their processes cost.

Shared by ``bench_e2e.py`` and ``profile_roles.py``: the flags and environment of R3 off,
vLLM's own routed experts and ours (``server_plans``), a process tree's memory and CPU, the role
of each process (API server = the root pid; vLLM titles its engine core and workers with
setproctitle) and CPU seconds per role and per thread, threads named after their Python thread
name from ``py-spy dump`` when py-spy is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

CONFIGS = ("off", "vllm", "ours")
LABELS = {"off": "R3 off", "vllm": "vLLM's own R3", "ours": "vllm-artifact"}


def server_plans(store_root: Path) -> dict[str, tuple[list[str], dict[str, str | None]]]:
    """config -> (``vllm serve`` flags, environment): the same serving flags everywhere; dev
    mode only for POST /reset_prefix_cache (set by the caller)."""
    common = ["--enable-prompt-tokens-details"]
    return {
        "off": (common, {}),
        # Only the CPU support plugin: neither our general plugin nor our platform plugin.
        "vllm": (
            [*common, "--enable-return-routed-experts"],
            {"VLLM_PLUGINS": "vllm_artifact_cpu_support"},
        ),
        "ours": ([*common, "--enable-routed-experts", "--artifact-root", str(store_root)], {}),
    }


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the duration of the block; a
    server started in it gets ``GLIBC_TUNABLES`` last (see :func:`_glibc_tunables_last`)."""
    old = {name: os.environ.get(name) for name in values}
    try:
        _glibc_tunables_last()
        _assign(values)
        yield
    finally:
        _assign(old)


def _glibc_tunables_last() -> None:
    """Move ``GLIBC_TUNABLES`` to the end of the environment. The shell's ``VAR=... cmd``
    form puts it first; glibc's start-up code replaces that entry with a copy elsewhere, and
    setproctitle then cannot retitle vLLM's engine processes, whose CPU this module finds by
    their titles (docs/configuration.md)."""
    value = os.environ.pop("GLIBC_TUNABLES", None)
    if value is not None:
        os.environ["GLIBC_TUNABLES"] = value  # unsetenv + setenv: appended to the C environ


def _assign(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ------------------------------------------------------------------------------ processes


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(sum of peak RSS ``VmHWM``, sum of current RSS, sum of anonymous memory in transparent
    huge pages) over a process tree, in bytes. Huge pages matter for the model's compute:
    a server whose weights got them can be faster for reasons that have nothing to do with R3."""
    peak = current = huge = 0
    try:
        procs = process_tree(pid)
    except psutil.Error:  # the server is gone
        return 0, 0, 0
    for proc in procs:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    current += int(line.split()[1]) * 1024
            for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("AnonHugePages:"):
                    huge += int(line.split()[1]) * 1024
    return peak, current, huge


# ------------------------------------------------------------------------------ CPU by role

#: Roles of a server's processes. The API server is the root pid; vLLM titles its engine
#: processes with setproctitle (``VLLM::EngineCore``, ``VLLM::Worker_...``).
ROLES = ("api", "engine", "worker")


def process_role(proc: psutil.Process, root: int) -> str:
    if proc.pid == root:
        return "api"
    title = " ".join(proc.cmdline()) or proc.name()
    if "EngineCore" in title:
        return "engine"
    if "Worker" in title:
        return "worker"
    return f"other:{proc.name()}"


def py_spy_path() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


@dataclass
class CpuSample:
    """CPU seconds (user + sys) at one moment, of every server tree and of the machine."""

    #: (config, pid) -> (role, seconds, voluntary ctx switches, involuntary ctx switches)
    procs: dict[tuple[str, int], tuple[str, float, int, int]] = field(default_factory=dict)
    #: (config, pid, tid) -> (role, seconds)
    threads: dict[tuple[str, int, int], tuple[str, float]] = field(default_factory=dict)
    machine_busy: float = 0.0  # all CPUs: user + nice + system + irq + softirq
    steal: float = 0.0  # all CPUs: time the hypervisor ran something else
    client: float = 0.0  # this process (the HTTP client)


def cpu_sample(pids: dict[str, int]) -> CpuSample:
    t = psutil.cpu_times()
    sample = CpuSample(
        machine_busy=t.user + t.nice + t.system + getattr(t, "irq", 0.0) + t.softirq,
        steal=getattr(t, "steal", 0.0),
    )
    me = psutil.Process().cpu_times()
    sample.client = me.user + me.system
    for config, root in pids.items():
        try:
            procs = process_tree(root)
        except psutil.Error:  # the server is gone
            continue
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                role = process_role(proc, root)
                times = proc.cpu_times()
                switches = proc.num_ctx_switches()
                sample.procs[(config, proc.pid)] = (
                    role,
                    times.user + times.system,
                    switches.voluntary,
                    switches.involuntary,
                )
                for thread in proc.threads():
                    sample.threads[(config, proc.pid, thread.id)] = (
                        role,
                        thread.user_time + thread.system_time,
                    )
    return sample


class ThreadLabels:
    """A label for every server thread: its Python thread name (from ``py-spy dump``; CPython
    3.11 leaves the OS thread name at the process title), digits folded so that pools and
    counters compare across servers; threads py-spy does not list (OpenMP, ZMQ, ...) are
    ``native:<comm>``. A process is dumped again only when it has threads not seen before, and
    only between batches."""

    def __init__(self) -> None:
        self._py_spy = py_spy_path()
        self._labels: dict[tuple[int, int], str] = {}  # (pid, tid) -> label
        #: files of vllm_artifact frames seen in each server's dumps (where it imports from)
        self.artifact_files: dict[str, set[str]] = {}

    def refresh(self, sample: CpuSample) -> None:
        stale = {(c, pid) for (c, pid, tid) in sample.threads if (pid, tid) not in self._labels}
        for config, pid in sorted(stale):
            names = self._dump(config, pid)
            for c, p, tid in sample.threads:
                if (c, p) == (config, pid) and (pid, tid) not in self._labels:
                    name = names.get(tid)
                    if name is None:
                        comm = "?"
                        with contextlib.suppress(OSError):
                            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                        self._labels[(pid, tid)] = f"native:{comm}"
                    else:
                        self._labels[(pid, tid)] = re.sub(r"\d+", "N", name)

    def label(self, pid: int, tid: int) -> str:
        return self._labels.get((pid, tid), "unlabelled")

    def _dump(self, config: str, pid: int) -> dict[int, str]:
        """Native thread id -> Python thread name of one process (empty without py-spy)."""
        if self._py_spy is None:
            return {}
        try:
            out = subprocess.run(
                [self._py_spy, "dump", "--json", "--full-filenames", "-p", str(pid)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
            threads = json.loads(out)
        except (OSError, subprocess.SubprocessError, ValueError):
            return {}
        files = self.artifact_files.setdefault(config, set())
        for thread in threads:
            for frame in thread.get("frames") or ():
                path = frame.get("filename") or ""
                if "/vllm_artifact/" in path:
                    files.add(path.rsplit("/vllm_artifact/", 1)[0] + "/vllm_artifact")
        return {
            int(t["os_thread_id"]): str(t.get("thread_name") or "?")
            for t in threads
            if t.get("os_thread_id") is not None
        }


def cpu_delta(
    config: str, before: CpuSample, after: CpuSample, labels: ThreadLabels
) -> dict[str, Any]:
    """One batch's CPU seconds on the server ``config``, by role and by thread label, and the
    machine's busy seconds outside the three servers."""
    roles: dict[str, float] = {}
    switches: dict[str, list[int]] = {}
    servers = 0.0
    for key, (role, seconds, vol, invol) in after.procs.items():
        _, s0, v0, i0 = before.procs.get(key, (role, 0.0, 0, 0))
        servers += seconds - s0
        if key[0] != config:
            continue
        roles[role] = roles.get(role, 0.0) + seconds - s0
        total = switches.setdefault(role, [0, 0])
        total[0] += vol - v0
        total[1] += invol - i0
    threads: dict[str, dict[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for tkey, (role, seconds) in after.threads.items():
        if tkey[0] != config:
            continue
        label = labels.label(tkey[1], tkey[2])
        delta = seconds - before.threads.get(tkey, (role, 0.0))[1]
        by_label = threads.setdefault(role, {})
        by_label[label] = by_label.get(label, 0.0) + delta
        by_count = counts.setdefault(role, {})
        by_count[label] = by_count.get(label, 0) + 1
    client = after.client - before.client
    busy = after.machine_busy - before.machine_busy
    return {
        "roles": roles,
        "ctx_switches": {r: {"voluntary": v, "involuntary": i} for r, (v, i) in switches.items()},
        "threads": threads,
        "thread_counts": counts,
        "other_servers": servers - sum(roles.values()),
        "client": client,
        "machine_busy": busy,
        "steal": after.steal - before.steal,
        "outside": busy - servers - client,  # other jobs on the machine, kernel threads
    }


def describe_processes(pids: dict[str, int], labels: ThreadLabels) -> None:
    """Print each server's processes with the role they are counted under, and name the
    threads that exist now (py-spy dump)."""
    sample = cpu_sample(pids)
    labels.refresh(sample)
    for config, root in pids.items():
        with contextlib.suppress(psutil.Error):
            for proc in process_tree(root):
                threads: dict[str, int] = {}
                for c, pid, tid in sample.threads:
                    if (c, pid) == (config, proc.pid):
                        name = labels.label(pid, tid)
                        threads[name] = threads.get(name, 0) + 1
                names = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in sorted(threads.items()))
                print(
                    f"  {config:<4} pid {proc.pid:>7} {process_role(proc, root):<7} "
                    f"{' '.join(proc.cmdline())[:60]!r}: {names}"
                )
    for config, files in sorted(labels.artifact_files.items()):
        where = ", ".join(sorted(files)) or "(none on any stack at the dump)"
        print(f"  {config}: vllm_artifact frames seen from {where}")


def role_order(role: str) -> tuple[int, str]:
    return (ROLES.index(role) if role in ROLES else len(ROLES), role)


def role_pids(root_pid: int) -> dict[str, int]:
    """role -> pid of one server (the first process of each role)."""
    root = psutil.Process(root_pid)
    pids: dict[str, int] = {}
    for proc in process_tree(root_pid):
        with contextlib.suppress(psutil.Error):
            pids.setdefault(process_role(proc, root.pid), proc.pid)
    return pids
