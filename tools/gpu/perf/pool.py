"""Per-round speed ratios pooled over several ``driver.py`` runs (each on its own machine).

    python tools/gpu/perf/pool.py RUN [RUN ...]

Each argument is a run's ``results.json``, its folder or its ``perf.tgz`` (run.sh packs the
file in it; a folder keeps the tarball alone). A round runs
the configurations back to back on one machine, so its ratios are the side-by-side figures;
pooling rounds of several runs gives more of them than one device call can hold. Profiled
rounds (slowed by py-spy) are left out.

Per workload and pair, three speed ratios (above 1: the first configuration is faster): the
whole round (output tokens/s), its median short step (the CUDA-graph decode steps) and its
median long step (the eager steps that carry prefill, ``analyze.step_gaps``);
each as the median, the geometric mean and its 95% bootstrap interval over rounds. Then, per
pair, how a round's two halves relate: the correlation over rounds (those in which both took
the same number of steps) of the log ratio over the first half of its steps with that over the
second. Near 0, a round's steps scatter independently; negative, what one configuration loses
in a round's first half it wins back in the second (in concurrent rounds, as if the engine that
fell behind had the GPU to itself at the end), so only the whole round's ratio is a measure.
And per pair, for the whole round: the standard deviation of a round's log ratio with the
rounds a 95% interval of +-1% and +-0.5% needs at that scatter, and with several runs each
run's geometric mean apart (runs have disagreed by more than their intervals: pooling hides
that, this shows it; a run's ``--repeat`` is named, as rounds of other lengths scatter apart).

Where the runs recorded threads' CPU, also the engine main thread's: the ratio of its CPU
seconds a round ("main CPU", above 1: the first configuration's thread did less), and how busy
it was (its CPU over the round's time). A thread busy nearly the whole round bounds the
round, and if its CPU ratio then scatters as widely as the round's, the rounds' scatter is that
CPU's speed, not R3's work. With step timers, the correlation over rounds of the round's log
ratio with that of the CPU seconds of vLLM's ``schedule`` (less the R3 connector part timed
inside it): how far the round's ratio follows the two engines' CPU speeds in that round
(``schedule`` does about the same work in both; some of ours runs inside it untimed, so it
cannot correct the ratio by itself). Where the machine let the runs count the main thread's
instructions (``hw_counters.py``), their ratio a round ("main instr", above 1: the first
configuration's thread retired fewer), which does not depend on the CPU's speed: how much work
R3 adds to the thread that bounds the round; and its cycles per instruction ("main CPI").
Where the runs recorded the GPU's timeline (``gpu_timeline.py``, with step timers): the ratio
of the GPU's seconds in forward passes a round ("GPU forward"), and per pair what a round's time
difference is made of ("GPU split"): the mean over rounds of the first configuration's round
seconds less the second's (ours/off: ours less off), of its seconds in forwards less the
second's, of its seconds outside forwards less the second's, of the part of those with
nothing queued, and of the round's time outside the GPU's span (before the first call's work,
after the last). More forward time is GPU work inside the forward (the capture); more time
outside forwards is the GPU waiting for the engine's main thread to queue the next one; more
time outside the span is the frontend (the process that takes in the outputs) lagging behind
the engine at the round's end, or handing the requests in later at its start: where the runs
anchored the round and its timeline on the host's clock, that part is split into the time
before the GPU's first work and after its last.
Where the timelines have the GPU's time between forwards, per pair where in the round the
GPU waited more ("GPU by step"): over rounds of equal forward count, the median per gap of the
first configuration's time between two forwards less the second's.
And per pair, the rounds in which either side's frontend ran a full cyclic-GC collection
(about 0.45 s in an offline ``LLM`` process; rare, and which round it lands in is chance) and
the pair's geometric mean over the other rounds ("full GC").
And per pair, where in the round the difference falls ("by step"): over rounds in which both
took the same number of steps (the most common number), the median of the first
configuration's time from one step output to the next less the second's, per step; the steps
that differ most are listed with the median of the rounds' whole difference.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from analyze import load_results, step_durations, step_gaps
from report import PAIRS, geomean_ci


def short_step(run: dict[str, Any]) -> float:
    return statistics.median(step_gaps(run)[0])


def long_step(run: dict[str, Any]) -> float:
    return statistics.median(step_gaps(run)[1] or [float("nan")])


def halves(run: dict[str, Any]) -> tuple[float, float]:
    """Seconds of the first and the second half of the run's steps."""
    times = [0.0, *(t for t, _ in run["steps"])]
    middle = (len(times) - 1) // 2
    return times[middle], times[-1] - times[middle]


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's r (nan if either side is constant)."""
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return float("nan")


def scatter(ratios: Iterable[float]) -> str:
    """The standard deviation of the rounds' log ratios, and the rounds a 95% interval of
    +-1% and +-0.5% needs at that scatter (a normal approximation of the bootstrap's)."""
    sd = statistics.stdev(math.log(r) for r in ratios)
    need = [math.ceil((1.96 * sd / math.log(1 + half)) ** 2) for half in (0.01, 0.005)]
    return (
        f"standard deviation of a round's log ratio {sd:.4f}; rounds for a 95% interval of "
        f"+-1%: {need[0]}, of +-0.5%: {need[1]}"
    )


def main_thread_cpu(run: dict[str, Any]) -> float:
    """CPU seconds of the engine core's main thread in the round (nan if not recorded)."""
    threads = run.get("threads_cpu_s", {}).get("engine1", {})
    seconds = sum(v for name, v in threads.items() if name.split(":")[0] == "MainThread")
    return seconds or float("nan")


def main_thread_counter(run: dict[str, Any], event: str) -> float:
    """``event`` (instructions, cycles) counted on the engine core's main thread in the round
    (nan where the machine had no counters)."""
    count = (run.get("main_thread_counters") or {}).get(event)
    return float(count) if isinstance(count, int) and count > 0 else float("nan")


def main_thread_cpi(run: dict[str, Any]) -> float:
    """Cycles per instruction of the engine core's main thread in the round (nan without
    counters)."""
    return main_thread_counter(run, "cycles") / main_thread_counter(run, "instructions")


def gpu_seconds(run: dict[str, Any], field: str) -> float:
    """A seconds field of the round's GPU timeline (nan where not recorded)."""
    value = (run.get("gpu_timeline") or {}).get(field)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def span_ends(run: dict[str, Any]) -> tuple[float, float]:
    """The round's seconds before the GPU's first work and after its last (the frontend
    handing the requests in; the last outputs reaching it), from the host clock's anchors of
    the round and of its timeline; nan where a run has no anchors."""
    timeline = run.get("gpu_timeline") or {}
    anchors = (
        run.get("started_host_s"),
        run.get("seconds"),
        timeline.get("origin_host_s"),
        timeline.get("first_start_ms"),
        timeline.get("last_end_ms"),
    )
    values = [float(x) for x in anchors if isinstance(x, (int, float))]
    if len(values) < len(anchors):
        return math.nan, math.nan
    started, seconds, origin, first_ms, last_ms = values
    return origin + first_ms / 1000 - started, started + seconds - (origin + last_ms / 1000)


def gpu_split(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str | None:
    """Mean differences (ms, first less second) of the round's seconds and of its GPU
    timeline's parts over rounds with a timeline in both; None without such rounds."""
    fields = ("forward_s", "outside_forwards_s", "idle_s")

    def beyond_span(run: dict[str, Any]) -> float:
        """The round's seconds outside the GPU's span: before the first call's work and after
        the last (the frontend taking in the last outputs, or falling behind)."""
        return run.get("seconds", math.nan) - gpu_seconds(run, "span_s")

    rows = [
        [
            1000 * (first.get("seconds", math.nan) - second.get("seconds", math.nan)),
            *(1000 * (gpu_seconds(first, f) - gpu_seconds(second, f)) for f in fields),
            1000 * (beyond_span(first) - beyond_span(second)),
        ]
        for first, second in pairs
    ]
    kept = [i for i, row in enumerate(rows) if all(x == x for x in row)]
    if len(kept) < 2:
        return None
    means = [statistics.mean(column) for column in zip(*(rows[i] for i in kept), strict=True)]
    # the time outside the span, before the GPU's first work and after its last
    ends = [
        [
            1000 * (a - b)
            for a, b in zip(span_ends(pairs[i][0]), span_ends(pairs[i][1]), strict=True)
        ]
        for i in kept
    ]
    ends = [row for row in ends if all(x == x for x in row)]
    apart = ""
    if len(ends) == len(kept):
        before, after = (statistics.mean(column) for column in zip(*ends, strict=True))
        apart = f" (before its first work {before:+.1f}, after its last {after:+.1f})"
    return (
        f"mean over rounds of the first less the second, ms: round {means[0]:+.1f}, GPU in "
        f"forwards {means[1]:+.1f}, outside forwards {means[2]:+.1f} (nothing queued "
        f"{means[3]:+.1f}), outside the GPU's span {means[4]:+.1f}{apart}, n={len(kept)}"
    )


#: a round ending this long (s) after the GPU's last work had its frontend fall behind
LAGGING_S = 0.1


def frontend_lag(runs: list[dict[str, Any]]) -> str | None:
    """How long a configuration's rounds ended after the GPU's last work (the frontend taking
    in the last outputs): the median, and the rounds whose frontend fell :data:`LAGGING_S`
    or more behind the engine, which a mean over rounds hides, and the outputs' waits
    (:func:`output_waits`); None with neither anchors nor waits recorded."""
    after = sorted(x for run in runs if (x := span_ends(run)[1]) == x)
    if not after:  # no GPU timeline (a CPU run): the outputs' waits alone, where recorded
        return output_waits(runs).removeprefix("; ") or None
    lagging = [x for x in after if x >= LAGGING_S]
    worst = f", the longest {1000 * after[-1]:.0f} ms" if lagging else ""
    return (
        f"median {1000 * statistics.median(after):+.1f} ms; {len(lagging)} of {len(after)} "
        f"rounds {1000 * LAGGING_S:.0f} ms or more behind{worst}{output_waits(runs)}"
    )


def frontend_full_gc(run: dict[str, Any]) -> float:
    """Seconds the round's frontend spent in full (oldest-generation) cyclic-GC collections;
    0 without GC records."""
    return float(run.get("gc", {}).get("frontend", {}).get("gen2_s", 0.0))


def full_gc(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str | None:
    """Rounds in which either side's frontend ran a full cyclic-GC collection, and the pair's
    geometric mean over the others. Such a collection scans every object the frontend process
    tracks (an offline ``LLM``'s process is not frozen as ``vllm serve``'s is): about 0.45 s
    with 780,000 objects, landing in whichever round crosses CPython's threshold (likely
    decided by a few thousand objects more or less in a call); None where none ran one."""
    hit: list[tuple[dict[str, Any], dict[str, Any]]] = []
    rest: list[float] = []  # the other rounds' ratios
    for a, b in pairs:
        if frontend_full_gc(a) or frontend_full_gc(b):
            hit.append((a, b))
        else:
            rest.append(a["out_tok_s"] / b["out_tok_s"])
    if not hit:
        return None
    sides = [
        f"{sum(1 for pair in hit if frontend_full_gc(pair[side]))} rounds "
        f"({sum(frontend_full_gc(pair[side]) for pair in hit):.2f} s) on the "
        f"{'first' if side == 0 else 'second'}"
        for side in (0, 1)
    ]
    line = f"in {len(hit)} of {len(pairs)} rounds: {', '.join(sides)}"
    if len(rest) > 1:
        mean, low, high = geomean_ci(rest)
        line += f"; the other rounds {mean:.4f} (95% {low:.4f}-{high:.4f}), n={len(rest)}"
    return line


def output_waits(runs: list[dict[str, Any]]) -> str:
    """From rounds that recorded ``output_delays`` (per frontend step: how long its outputs
    waited after the engine made them, and how long the frontend then took on them): the
    median over rounds of the round's longest wait and of its processing seconds."""
    longest, processing = [], []
    for run in runs:
        delays = run.get("output_delays") or []
        waits = [wait for wait, _ in delays if wait == wait]  # nan: no engine timestamp
        if waits:
            longest.append(max(waits))
            processing.append(sum(took for _, took in delays))
    if not longest:
        return ""
    return (
        f"; outputs waited for the frontend up to {1000 * statistics.median(longest):.1f} ms "
        f"a round and it took {statistics.median(processing):.3f} s on them (medians, "
        f"n={len(longest)})"
    )


def paired_differences(
    pairs: list[tuple[list[float], list[float]]], scale: float = 1.0
) -> list[float]:
    """Per index, the median over pairs of ``scale`` times the first list's value less the
    second's; then the median of the pairs' summed difference and the number of pairs. Only
    pairs of equal length, of the most common one, count (so that an index means the same
    step in every pair); empty without two such pairs."""
    equal = [(a, b) for a, b in pairs if len(a) == len(b)]
    if not equal:
        return []
    count = statistics.mode(len(a) for a, _ in equal)
    rows = [
        [scale * (x - y) for x, y in zip(a, b, strict=True)] for a, b in equal if len(a) == count
    ]
    if len(rows) < 2 or not count:
        return []
    return [statistics.median(column) for column in zip(*rows, strict=True)] + [
        statistics.median(sum(row) for row in rows),
        len(rows),
    ]


def step_differences(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
    """:func:`paired_differences` of the runs' times from the previous step output (the
    round's start for the first) to each step output, and after the last, in ms."""

    def gaps(run: dict[str, Any]) -> list[float]:
        after_last = run["seconds"] - (run["steps"][-1][0] if run["steps"] else 0.0)
        return [*step_durations(run), after_last]

    return paired_differences(
        [(gaps(a), gaps(b)) for a, b in pairs if "seconds" in a and "seconds" in b], 1000.0
    )


def forward_gap_differences(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
    """:func:`paired_differences` of the runs' GPU time between two forwards (the GPU's
    timeline), in ms."""

    def gaps(run: dict[str, Any]) -> list[float] | None:
        found = (run.get("gpu_timeline") or {}).get("between_forwards_ms")
        return found if isinstance(found, list) else None

    return paired_differences(
        [
            (a, b)
            for first, second in pairs
            if (a := gaps(first)) is not None and (b := gaps(second)) is not None
        ]
    )


def largest(values: list[float], top: int) -> list[int]:
    """The indices of the ``top`` values farthest from zero, largest first."""
    return sorted(range(len(values)), key=lambda i: -abs(values[i]))[:top]


def gpu_by_step(differences: list[float], top: int = 5) -> str:
    """:func:`forward_gap_differences` in one line: the rounds' median summed difference and
    the gaps of the largest medians (gap i: before the round's forward i + 1)."""
    *gaps, total, count = differences
    named = ", ".join(f"before forward {i + 2} {gaps[i]:+.2f}" for i in largest(gaps, top))
    return (
        f"the GPU's time between forwards, medians over {count:.0f} rounds of one forward "
        f"count, ms: summed {total:+.1f}; largest: {named}"
    )


def by_step(differences: list[float], top: int = 5) -> str:
    """:func:`step_differences` in one line: the round's median total, its steps' medians
    summed, and the steps of the largest medians (1 = the first output)."""
    *steps, total, count = differences
    named = ", ".join(
        f"{'after the last' if i == len(steps) - 1 else f'step {i + 1}'} {steps[i]:+.1f}"
        for i in largest(steps, top)
    )
    return (
        f"medians over {count:.0f} rounds of one step count, ms: the round {total:+.1f}, its "
        f"steps' summed {sum(steps):+.1f}; largest: {named}"
    )


def schedule_cpu(run: dict[str, Any]) -> float:
    """CPU seconds of vLLM's ``schedule`` less the R3 connector's timed part inside it (nan
    without step timers)."""
    timers = run.get("step_timers") or {}
    if "scheduler.schedule" not in timers:
        return float("nan")
    inside = timers.get("scheduler_connector.build_connector_meta", [0, 0.0])[1]
    return float(timers["scheduler.schedule"][1] - inside)


def main_thread_busy(runs: Iterable[dict[str, Any]]) -> float:
    """The median share of a round the engine core's main thread spent on a CPU."""
    shares = [main_thread_cpu(run) / run["seconds"] for run in runs]
    return statistics.median(share for share in shares if share == share)


#: name -> seconds-like measure of one run (smaller is faster)
PARTS: dict[str, Callable[[dict[str, Any]], float]] = {
    "round": lambda run: 1 / run["out_tok_s"],
    "short step": short_step,
    "long step": long_step,
    "main CPU": main_thread_cpu,
    "main instr": lambda run: main_thread_counter(run, "instructions"),
    "GPU forward": lambda run: gpu_seconds(run, "forward_s"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    rounds: dict[str, dict[tuple[int, int], dict[str, dict[str, Any]]]] = {}
    repeats: dict[tuple[int, str], int] = {}  # (run, workload) -> its rounds' --repeat
    for index, path in enumerate(args.runs):
        for result in load_results(path)["results"]:
            if result.get("profiled") or not result.get("steps"):
                continue
            repeats[index, result["workload"]] = result.get("repeat", 1)
            by_round = rounds.setdefault(result["workload"], {})
            by_round.setdefault((index, result["seed"]), {})[result["config"]] = result
    print(f"per-round speed ratios, {len(args.runs)} runs pooled")
    for workload, by_round in sorted(rounds.items()):
        for top, bottom in PAIRS:
            round_ratios: dict[tuple[int, int], float] = {}  # (run, seed) -> whole round's
            cpu_ratios: list[float] = []  # the main thread's CPU, where recorded
            for part, measure in PARTS.items():
                keyed = {
                    key: measure(runs[bottom]) / measure(runs[top])
                    for key, runs in by_round.items()
                    if top in runs and bottom in runs
                }
                if part == "round":
                    round_ratios = keyed
                # a run without long steps has none
                ratios = sorted(r for r in keyed.values() if r == r)
                if part == "main CPU":
                    cpu_ratios = ratios
                if len(ratios) < 2:
                    continue
                mean, low, high = geomean_ci(ratios)
                print(
                    f"{workload:8s} {top}/{bottom} {part:10s}: median "
                    f"{statistics.median(ratios):.4f}, geometric mean {mean:.4f} "
                    f"(95% {low:.4f}-{high:.4f}), min {ratios[0]:.3f} max {ratios[-1]:.3f}, "
                    f"n={len(ratios)}"
                )
            if len(round_ratios) > 2:
                print(f"{workload:8s} {top}/{bottom} scatter   : {scatter(round_ratios.values())}")
            speeds = [
                (math.log(round_ratios[key]), math.log(schedule_cpu(runs[bottom]) / s))
                for key, runs in by_round.items()
                if key in round_ratios and (s := schedule_cpu(runs[top])) == s
            ]
            if len(speeds) > 2:
                rounds_ratio = [ratio for ratio, _ in speeds]
                schedule_ratio = [ratio for _, ratio in speeds]
                print(
                    f"{workload:8s} {top}/{bottom} cpu speed : correlation of the round's log "
                    f"ratio with that of vLLM's schedule CPU seconds (the same way round) "
                    f"{correlation(rounds_ratio, schedule_ratio):+.2f}, n={len(speeds)}"
                )
            if len(cpu_ratios) > 2:
                busy = {
                    config: main_thread_busy(
                        runs[config] for runs in by_round.values() if config in runs
                    )
                    for config in (top, bottom)
                }
                print(
                    f"{workload:8s} {top}/{bottom} main busy : the engine main thread's CPU "
                    f"over the round, medians: {top} {busy[top]:.3f}, {bottom} "
                    f"{busy[bottom]:.3f}; its CPU ratio's {scatter(cpu_ratios)}"
                )
            cpi = {  # rounds without counters (nan) left out
                config: [
                    c
                    for runs in by_round.values()
                    if config in runs and (c := main_thread_cpi(runs[config])) == c
                ]
                for config in (top, bottom)
            }
            if all(cpi.values()):
                print(
                    f"{workload:8s} {top}/{bottom} main CPI  : the engine main thread's cycles "
                    "per instruction, median (min-max): "
                    + ", ".join(
                        f"{config} {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                        for config, v in cpi.items()
                    )
                )
            paired = [
                (runs[top], runs[bottom])
                for runs in by_round.values()
                if top in runs and bottom in runs
            ]
            split = gpu_split(paired)
            if split:
                print(f"{workload:8s} {top}/{bottom} GPU split : {split}")
            for config, side in ((top, 0), (bottom, 1)):
                lag = frontend_lag([pair[side] for pair in paired])
                if lag:
                    print(f"{workload:8s} {top}/{bottom} {config} frontend lag: {lag}")
            collections = full_gc(paired)
            if collections:
                print(f"{workload:8s} {top}/{bottom} full GC   : {collections}")
            differences = step_differences(paired)
            if differences:
                print(f"{workload:8s} {top}/{bottom} by step   : {by_step(differences)}")
            forward_gaps = forward_gap_differences(paired)
            if forward_gaps:
                print(f"{workload:8s} {top}/{bottom} GPU by step: {gpu_by_step(forward_gaps)}")
            for index, path in enumerate(args.runs) if len(args.runs) > 1 else ():
                mine = [r for (run_index, _), r in round_ratios.items() if run_index == index]
                if len(mine) > 1:
                    mean, low, high = geomean_ci(mine)
                    print(
                        f"{workload:8s} {top}/{bottom} run {index + 1}     : geometric mean "
                        f"{mean:.4f} (95% {low:.4f}-{high:.4f}), n={len(mine)}, repeat "
                        f"{repeats.get((index, workload), 1)} ({path})"
                    )
            pairs = [
                (halves(runs[top]), halves(runs[bottom]))
                for runs in by_round.values()
                # the same number of steps, so that the halves cover the same steps
                if top in runs
                and bottom in runs
                and len(runs[top]["steps"]) == len(runs[bottom]["steps"]) > 1
            ]
            if len(pairs) > 2:
                first = [math.log(b[0] / a[0]) for a, b in pairs]
                second = [math.log(b[1] / a[1]) for a, b in pairs]
                print(
                    f"{workload:8s} {top}/{bottom} halves    : correlation of the first and the "
                    f"second half's log ratio {correlation(first, second):+.2f}, "
                    f"n={len(pairs)}"
                )


if __name__ == "__main__":
    main()
