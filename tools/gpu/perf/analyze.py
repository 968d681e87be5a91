"""Where ours spends its time against R3 off: the per-step trace, thread CPU and py-spy
profiles of one ``driver.py`` run (its ``--out`` folder, or the ``perf.tgz`` run.sh packs).

    python tools/gpu/perf/analyze.py DIR_OR_TGZ [--against off] [--frames 25]

Per workload and configuration (medians over the timed rounds): wall seconds split into
the engine steps the frontend saw (long steps, the prefill-carrying ones, are those well above
a decode step: ``step_gaps``; the rest decode) and the time after the last step; with
``--step-timers``, R3's main-thread CPU and its share of the round (``step_timer_share``); then CPU
seconds per thread of the frontend and engine core; then, from the py-spy round, each
thread's busy samples and the inclusive frames whose share differs most from ``--against``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tarfile
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

# Frames a thread sits in while it has nothing to do (ZMQ and queue waits, GPU syncs).
IDLE = (
    "poll",
    "recv",
    "_recv",
    "wait (threading.py)",
    "get (queue.py)",
    "select",
    "sleep",
    "synchronize",
    "_wait_for",
    "acquire",
)


def step_durations(run: dict[str, Any]) -> list[float]:
    """The run's step durations as the frontend saw them: from the round's start (or the
    previous step output) to each step output."""
    times = [t for t, _ in run["steps"]]
    return [b - a for a, b in zip([0.0, *times], times, strict=False)]


def step_gaps(run: dict[str, Any]) -> tuple[list[float], list[float]]:
    """:func:`step_durations`, split: the short ones (decode) and
    the long ones (those carrying prefill), above 1.5x the run's median step; in a round of
    several workloads (``--repeat``) most steps carry prefill, so there above twice the median
    of the run's shorter half (a decode step while a quarter of the steps or more decode)."""
    gaps = step_durations(run)
    if not gaps:
        return [], []
    if run.get("repeat", 1) > 1:
        limit = 2 * statistics.median(sorted(gaps)[: (len(gaps) + 1) // 2])
    else:
        limit = 1.5 * statistics.median(gaps)
    return [g for g in gaps if g <= limit], [g for g in gaps if g > limit]


def phases(run: dict[str, Any]) -> dict[str, float]:
    """Wall seconds of one run split by the frontend's step trace."""
    times = [t for t, _ in run["steps"]]
    if not times:
        return {"total": run["seconds"]}
    short, long = step_gaps(run)
    return {
        "total": run["seconds"],
        "steps": len(short) + len(long),
        "long_steps": len(long),
        "long_s": sum(long),
        "short_s": sum(short),
        "median_step_ms": 1000 * statistics.median(short + long),
        "last_step_ms": 1000 * (times[-1] - (times[-2] if len(times) > 1 else 0.0)),
        "after_last_ms": 1000 * (run["seconds"] - times[-1]),
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    values = [p[key] for p in runs if key in p]
    return statistics.median(values) if values else float("nan")


def thread_key(name: str) -> str:
    return re.sub(r":\d+$", "", name)


def answered_here(rounds: list[dict[str, Any]]) -> str:
    """How many steps the engine answered itself, not waiting for the tracker process
    (steady-decode steps), against the steps of the round's frontend trace (medians over
    ``rounds``)."""
    answered = statistics.median(r["store"]["steps_answered_here"] for r in rounds)
    steps = statistics.median(len(r["steps"]) for r in rounds)
    return (
        f"steps answered by the engine itself (median over {len(rounds)} rounds): "
        f"{answered:.0f} of {steps:.0f} a round"
    )


def publish_rate(rounds: list[dict[str, Any]]) -> str:
    """The store's publish rate against the tokens the engine computed, per round (medians
    over ``rounds``, one configuration's with store counts). A round's store counts are
    differences: once the store is full, what it publishes it evicts, so objects published =
    objects added + objects evicted."""
    published = [(r["store"]["objects"] + r["store"]["evictions"]) / r["seconds"] for r in rounds]
    sized = [r["store"] for r in rounds if r["store"]["objects"] > 0]
    object_nbytes = sized[0]["bytes_used"] / sized[0]["objects"] if sized else 0.0
    computed = statistics.median(
        (r["prompt_tokens"] - r["cached_tokens"] + r["out_tokens"]) / r["seconds"] for r in rounds
    )
    reads = statistics.median(r["store"].get("reads", 0) / r["seconds"] for r in rounds)
    rate = statistics.median(published)
    volume = (
        f"{rate * object_nbytes / 1e6:.1f} MB/s at {object_nbytes:,.0f} bytes each"
        if object_nbytes
        else "bytes unknown: no round added objects"
    )
    return (
        f"store (median over {len(rounds)} rounds): {rate:,.0f} objects/s published "
        f"({volume}), "
        f"{reads:,.0f} objects/s read, against {computed:,.0f} computed tokens/s (prompt "
        "tokens not cached, plus output)"
    )


def per_thread_median(runs: list[dict[str, Any]], field: str = "threads_cpu_s") -> dict[str, float]:
    """Median over runs of ``field`` (CPU seconds, voluntary switches or page faults) per
    (role, thread name), threads of one name summed."""
    per_run = []
    for run in runs:
        sums: collections.Counter[str] = collections.Counter()
        for role, threads in run.get(field, {}).items():
            for name, seconds in threads.items():
                sums[f"{role}/{thread_key(name)}"] += seconds
        per_run.append(sums)
    keys = {k for s in per_run for k in s}
    return {k: statistics.median(s.get(k, 0.0) for s in per_run) for k in keys}


#: Step-timer parts that are R3's own work (the connectors' per-step methods, the capture).
R3_PARTS = ("capture", "worker_connector.", "scheduler_connector.")
#: vLLM's scheduler parts; R3 also runs inside them (the eviction hook in ``schedule``, the
#: rows taken per request in ``update_from_output``), seen only against a run without R3.
SCHEDULER_PARTS = ("scheduler.schedule", "scheduler.update_from_output")


class R3Share(NamedTuple):
    """R3's main-thread CPU per round (seconds, medians over rounds) and its share of it."""

    own: float  # the capture and the connectors' per-step methods
    scheduler_excess: float  # vLLM's scheduler parts over the base run's (0 if not known)
    excess_known: bool  # the base is a run without R3, with step timers
    share: float  # (own + scheduler_excess) / the round's seconds


def step_timer_share(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> R3Share:
    """R3's main-thread CPU per round from ``--step-timers``: its own parts and the scheduler's
    excess over ``base`` (the same parts of a run without R3; the scheduler connector's
    ``build_connector_meta``, nested in ``schedule``, counted once). On an engine whose main
    thread is the bottleneck (eager prefill here) the share is about what R3 costs the round's
    throughput."""

    def per_round(part: str, rounds: list[dict[str, Any]]) -> float:
        return statistics.median(
            (r.get("step_timers") or {}).get(part, [0, 0.0])[1] for r in rounds
        )

    names = {n for r in runs for n in (r.get("step_timers") or {})}
    own = sum(per_round(n, runs) for n in _r3_names(names))
    nested = sum(per_round(n, runs) for n in names if n.startswith("scheduler_connector."))
    base_names = {n for r in base for n in (r.get("step_timers") or {})}
    # Against a base that runs R3 itself (vLLM's own) the scheduler's excess is not R3's.
    known = bool(base) and all(r.get("step_timers") for r in base) and not _r3_names(base_names)
    excess = 0.0
    if known:
        excess = sum(per_round(p, runs) - per_round(p, base) for p in SCHEDULER_PARTS) - nested
    seconds = statistics.median(r["seconds"] for r in runs)
    return R3Share(own, excess, known, (own + excess) / seconds)


def gpu_timeline_line(runs: list[dict[str, Any]]) -> str | None:
    """The rounds' GPU timelines in one line (medians), None where none was recorded."""
    lines = [t for r in runs if (t := r.get("gpu_timeline") or {}).get("calls")]
    if not lines:
        return None

    def median(field: str) -> float:
        return statistics.median(float(t[field]) for t in lines)

    forwards = [t["median_forward_ms"] for t in lines if t.get("median_forward_ms") is not None]
    forward = f" (a forward {statistics.median(forwards):.2f} ms)" if forwards else ""
    return (
        f"span {median('span_s'):.3f} s, in forwards {median('forward_s'):.3f} s{forward}, "
        f"outside forwards {1000 * median('outside_forwards_s'):.1f} ms, nothing queued "
        f"{1000 * median('idle_s'):.1f} ms ({median('gaps_over_1ms'):.0f} gaps over 1 ms: "
        f"{1000 * median('idle_in_gaps_over_1ms_s'):.1f} ms); n={len(lines)}"
    )


def _r3_names(names: set[str]) -> set[str]:
    return {n for n in names if n.startswith(R3_PARTS)}


def load_profile(path: Path) -> list[tuple[str, list[str], int]]:
    stacks = []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            thread, *frames = stack.split(";")
            # line numbers and native addresses (ASLR) differ between processes: drop both
            frames = [re.sub(r"0x[0-9a-f]+", "0x?", re.sub(r":\d+\)$", ")", f)) for f in frames]
            stacks.append((thread, frames, int(count)))
    return stacks


def is_idle(stack: list[str]) -> bool:
    """Waiting, by the innermost Python frames (with --native the leaves are libc's)."""
    python = [f for f in stack if ".py)" in f]
    return any(word in frame for frame in (stack[-2:] + python[-2:]) for word in IDLE)


def native_library(frame: str) -> str:
    """The shared library of a native frame ("libcuda"), or "python" for a Python frame."""
    found = re.search(r"\((lib[A-Za-z0-9_+-]+|python[0-9.]*)[^)]*\)$", frame)
    return found.group(1) if found else "python"


def main_thread_libraries(path: Path) -> collections.Counter[str]:
    """The engine main thread's busy samples by the library of the innermost frame: time in
    ``libcuda`` is kernel launches and the driver's locks, ``python`` the interpreter."""
    libraries: collections.Counter[str] = collections.Counter()
    for thread, stack, n in load_profile(path):
        if "MainThread" in thread and stack and not is_idle(stack):
            libraries[native_library(stack[-1])] += n
    return libraries


def profile_summary(path: Path) -> tuple[dict[str, list[int]], collections.Counter[str]]:
    """Per thread [idle, busy] samples; busy samples per inclusive frame (thread-qualified)."""
    threads: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    frames: collections.Counter[str] = collections.Counter()
    for thread, stack, n in load_profile(path):
        name = re.sub(r"\(?0x[0-9a-f]+\)?|\d+", "N", thread)
        idle = is_idle(stack)
        threads[name][0 if idle else 1] += n
        if not idle:
            for frame in set(stack):
                frames[f"{name[:30]}: {frame}"] += n
    return threads, frames


def print_waits(runs: list[dict[str, Any]], config: str) -> None:
    """The engine main thread's states and waits (``--wait-sampler``), ms per round (median
    over rounds of each round's share of samples times its length)."""
    sampled = [r for r in runs if (r.get("main_thread_waits") or {}).get("samples")]
    if not sampled:
        return
    for field in ("states", "syscalls", "futex_addresses", "wchan", "kernel_stacks"):
        keys: collections.Counter[str] = collections.Counter()
        for r in sampled:
            keys.update(r["main_thread_waits"][field])
        cells = []
        for key, _ in keys.most_common(5):
            ms = statistics.median(
                1000
                * r["seconds"]
                * r["main_thread_waits"][field].get(key, 0)
                / r["main_thread_waits"]["samples"]
                for r in sampled
            )
            cells.append(f"{key[:70]} {ms:.0f}")
        print(f"    {config:<7} {field}: " + "; ".join(cells))


def load_results(path: Path) -> dict[str, Any]:
    """A run's ``results.json``: the file itself, or read from the ``perf.tgz`` beside it (or
    given) that run.sh packs, so results folders keep the tarball alone, not a copy of it."""
    if path.is_dir():
        path = path / "results.json"
    if path.suffix != ".tgz" and not path.exists():
        path = path.parent / "perf.tgz"
    if path.suffix != ".tgz":
        return dict(json.loads(path.read_text()))
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if Path(m.name).name == "results.json")
        packed = tar.extractfile(member)
        if packed is None:
            raise FileNotFoundError(f"{path}: results.json is not a file")
        return dict(json.loads(packed.read()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--against", default="off")
    parser.add_argument("--frames", type=int, default=25)
    parser.add_argument(
        "--rate", type=int, default=0, help="py-spy's samples a second (default: the run's)"
    )
    args = parser.parse_args()
    folder = args.path
    packed = folder if folder.suffix == ".tgz" else folder / "perf.tgz"
    if not (folder / "results.json").exists() and packed.exists():
        folder = Path(tempfile.mkdtemp())
        with tarfile.open(packed) as tar:
            tar.extractall(folder, filter="data")
    data = load_results(folder)
    args.rate = args.rate or data.get("spy_rate", 250)
    timed = [r for r in data["results"] if not r.get("profiled")]
    if not timed:
        print("no timed rounds: the profiled round's figures (slowed by py-spy) follow")
        timed = data["results"]
    workloads = sorted({r["workload"] for r in timed})
    configs = sorted({r["config"] for r in timed})
    for workload in workloads:
        print(f"== {workload}: wall time split by the frontend's step trace (medians, s/ms)")
        for config in configs:
            runs = [phases(r) for r in timed if r["workload"] == workload and r["config"] == config]
            print(
                f"  {config:<7} total {median_of(runs, 'total'):.3f} s = long steps "
                f"{median_of(runs, 'long_steps'):.0f} x -> {median_of(runs, 'long_s'):.3f} s + "
                f"short {median_of(runs, 'short_s'):.3f} s (median step "
                f"{median_of(runs, 'median_step_ms'):.2f} ms); last step "
                f"{median_of(runs, 'last_step_ms'):.1f} ms, after it "
                f"{median_of(runs, 'after_last_ms'):.1f} ms"
            )
        if any((r.get("main_thread_waits") or {}).get("samples") for r in timed):
            print("  engine main thread, ms per round (median) by state and, asleep, what on:")
            for config in configs:
                print_waits(
                    [r for r in timed if r["workload"] == workload and r["config"] == config],
                    config,
                )
        print("  per round, median long step ms (the prefill-carrying steps): min/median/max")
        for config in configs:
            per_round = [
                1000 * statistics.median(long)
                for r in timed
                if r["workload"] == workload and r["config"] == config
                if (long := step_gaps(r)[1])
            ]
            if per_round:
                print(
                    f"    {config:<7} {min(per_round):6.1f} {statistics.median(per_round):6.1f} "
                    f"{max(per_round):6.1f}  (n={len(per_round)})"
                )
        base_runs = [r for r in timed if r["workload"] == workload and r["config"] == args.against]
        for config in configs:
            runs = [r for r in timed if r["workload"] == workload and r["config"] == config]
            if config != args.against and any(r.get("step_timers") for r in runs):
                r3 = step_timer_share(runs, base_runs)
                excess = (
                    f" + scheduler over {args.against} {1000 * r3.scheduler_excess:.1f} ms"
                    if r3.excess_known
                    else f" (scheduler excess not known: {args.against} is no run without R3 "
                    "with step timers)"
                )
                print(
                    f"  {config} R3 main-thread CPU per round (step timers, medians): own parts "
                    f"{1000 * r3.own:.1f} ms{excess} = {100 * r3.share:.2f}% of the round"
                )
        for config in configs:
            line = gpu_timeline_line(
                [r for r in timed if r["workload"] == workload and r["config"] == config]
            )
            if line:
                print(f"  {config} GPU per round (medians, gpu_timeline.py): {line}")
        print("  cyclic GC per round (median): collections and seconds per generation")
        for config in configs:
            for role in ("engine", "frontend"):
                rounds = [
                    r["gc"][role]
                    for r in timed
                    if r["workload"] == workload and r["config"] == config and r.get("gc")
                ]
                if rounds and rounds[0]:
                    cells = "  ".join(
                        f"gen{g} {statistics.median(x.get(f'gen{g}_n', 0) for x in rounds):.0f}"
                        f" x {1000 * statistics.median(x.get(f'gen{g}_s', 0) for x in rounds):.1f}"
                        f" ms (max {1000 * max(x.get(f'gen{g}_max_s', 0) for x in rounds):.1f})"
                        for g in range(3)
                    )
                    tracked = statistics.median(x.get("tracked", 0) for x in rounds)
                    print(f"    {config:<7} {role:<8} {cells}; tracked {tracked:.0f}")
        if any(r.get("process") for r in timed if r["workload"] == workload):  # newer runs
            print(
                "  per round (median): page faults minor/major; the main thread's context"
                " switches vol./invol."
            )
        for config in configs:
            rounds = [
                r["process"]
                for r in timed
                if r["workload"] == workload and r["config"] == config and r.get("process")
            ]
            for role in sorted({k for x in rounds for k in x}):
                got = [x[role] for x in rounds if x.get(role)]
                if got:
                    cells = " / ".join(
                        f"{statistics.median(x.get(k, 0) for x in got):.0f}"
                        for k in ("minflt", "majflt", "ctx_voluntary", "ctx_involuntary")
                    )
                    print(f"    {config:<7} {role:<9} {cells}")
        print("  CPU seconds per thread (median over rounds; threads above 0.05 s)")
        cpu = {
            c: per_thread_median(
                [r for r in timed if r["workload"] == workload and r["config"] == c]
            )
            for c in configs
        }
        for key in sorted({k for c in cpu.values() for k in c}):
            cells = "  ".join(f"{c} {cpu[c].get(key, 0.0):6.3f}" for c in configs)
            if max(cpu[c].get(key, 0.0) for c in configs) > 0.05:
                print(f"    {key[:44]:<44} {cells}")
        this = [r for r in timed if r["workload"] == workload]
        for field, what in (
            ("threads_voluntary_switches", "voluntary context switches"),
            ("threads_minor_faults", "minor page faults"),
        ):
            if not any(r.get(field) for r in this):  # older runs
                continue
            print(f"  {what} per thread (median over rounds; above 50)")
            counts = {
                c: per_thread_median([r for r in this if r["config"] == c], field=field)
                for c in configs
            }
            for key in sorted({k for c in counts.values() for k in c}):
                cells = "  ".join(f"{c} {counts[c].get(key, 0):6.0f}" for c in configs)
                if max(counts[c].get(key, 0) for c in configs) > 50:
                    print(f"    {key[:44]:<44} {cells}")
        for config in configs:
            rounds = [r for r in this if r["config"] == config and r.get("store")]
            if rounds and "steps_answered_here" in rounds[0]["store"]:  # the tracker process
                print(f"  {config} {answered_here(rounds)}")
            elif rounds:
                run = next(r for r in this if r["config"] == config)
                print(
                    f"  {config} store per round: {rounds[0]['store']} for {run['out_tokens']} "
                    f"output, {run['prompt_tokens']} prompt tokens"
                )
                print(f"  {config} {publish_rate(rounds)}")
        profiles = {c: folder / f"{c}-{workload}-engine0.txt" for c in configs}
        fronts = {c: folder / f"{c}-{workload}-frontend.txt" for c in configs}
        for role, files in (("engine core", profiles), ("frontend", fronts)):
            summaries = {c: profile_summary(p) for c, p in files.items() if p.exists()}
            if not summaries:
                continue
            print(f"  py-spy {role}: busy / idle seconds per thread")
            for c, (threads, _) in summaries.items():
                for name, (idle, busy) in sorted(threads.items(), key=lambda x: -x[1][1])[:6]:
                    print(
                        f"    {c:<7} {name[:60]:<60} busy {busy / args.rate:6.2f} "
                        f"idle {idle / args.rate:6.2f}"
                    )
            if role == "engine core":
                print("  py-spy engine main thread: busy seconds by the innermost frame's library")
                libraries = {c: main_thread_libraries(p) for c, p in files.items() if p.exists()}
                names = sorted({k for counts in libraries.values() for k in counts})
                for name in sorted(names, key=lambda k: -sum(c[k] for c in libraries.values())):
                    row = "  ".join(
                        f"{c} {counts[name] / args.rate:6.2f}" for c, counts in libraries.items()
                    )
                    print(f"    {name:<28} {row}")
            if args.against in summaries:
                base = summaries[args.against][1]
                for c, (_, frames) in summaries.items():
                    if c == args.against:
                        continue
                    print(f"  py-spy {role}: busy frames, {c} minus {args.against} (s)")
                    keys = set(frames) | set(base)
                    top = sorted(keys, key=lambda k: -abs(frames.get(k, 0) - base.get(k, 0)))
                    for k in top[: args.frames]:
                        print(
                            f"    {(frames.get(k, 0) - base.get(k, 0)) / args.rate:+7.3f} "
                            f"({frames.get(k, 0) / args.rate:6.3f})  {k[:150]}"
                        )


if __name__ == "__main__":
    main()
