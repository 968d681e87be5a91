"""The side-by-side benchmark's ratios: which pairs are reported, the geometric mean of a
pair's per-round ratios with its bootstrap interval, and the summary ``driver.py`` prints
after a run (``pool.py`` pools several runs' rounds with the same functions)."""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np

#: the ratios reported, first over second ("ours+nocap" prices vLLM's capture itself)
PAIRS = (
    ("off+twin", "off"),  # A/A: how far the measure strays with nothing changed
    ("ours+twin", "ours"),
    ("ours", "off"),
    ("native", "off"),
    ("ours", "native"),
    ("ours+process", "off"),  # --artifact-tracker process
    ("ours+process", "ours"),
    ("ours+process", "native"),
    ("ours+keys", "off"),  # the keys handoff: handles in the round, R3 read after it
    ("ours+keys", "ours"),
    ("ours+nocap", "ours"),
    ("ours+nocopy", "ours"),
    ("ours", "ours+pinnedviews"),
    ("ours", "ours+perlayer"),
    ("ours", "ours+fresh"),
    ("ours", "ours+background"),
    ("ours", "ours+allinline"),
    ("ours+copyframes", "ours"),
    ("off+copyframes", "off"),
    ("ours+switch", "ours"),  # the GIL switch interval 0.5 ms in the engine core
    ("ours+switch", "off"),
    ("off+switch", "off"),
    ("ours+switch", "off+switch"),
    ("ours", "ours+pyswitch"),  # ours' switch interval (0.5 ms) or the interpreter's (5 ms)
    ("ours", "off+switch"),
    ("ours+thp", "ours"),  # the allocator settings docs/configuration.md recommends
    ("off+thp", "off"),
    ("ours+thp", "off+thp"),
    ("ours+keep", "ours"),
    ("off+keep", "off"),
    ("ours+keep", "off+keep"),
    ("ours", "ours+earlyfacts"),  # a step's facts after its forward is queued, or before
    ("ours+nojoin", "ours"),  # the frontend's join of R3 skipped (R3 wrong by design)
    ("ours+nojoin", "off"),
)
#: configurations whose R3 must be right (the other variants are experiments that break it)
RIGHT_R3 = (
    "native",
    "ours",
    "ours+twin",
    "ours+pinnedviews",
    "ours+perlayer",
    "ours+fresh",
    "ours+background",
    "ours+allinline",
    "ours+copyframes",
    "ours+process",
    "ours+keys",
    "ours+switch",
    "ours+thp",
    "ours+keep",
    "ours+earlyfacts",
    "ours+pyswitch",
)


def paired(results: list[dict[str, Any]], workload: str, a: str, b: str) -> list[float]:
    """Per round: out tok/s of ``a`` over ``b``."""
    by = {(r["config"], r["seed"]): r for r in results if r["workload"] == workload}
    seeds = sorted({s for c, s in by if c == a} & {s for c, s in by if c == b})
    return [by[(a, s)]["out_tok_s"] / by[(b, s)]["out_tok_s"] for s in seeds]


def geomean_ci(ratios: list[float], draws: int = 4000) -> tuple[float, float, float]:
    """Geometric mean of paired ratios with a 95% bootstrap interval (fixed seed): a goal is
    resolved when the whole interval lies on one side of it."""
    import random

    logs = sorted(math.log(r) for r in ratios)  # the interval does not depend on the order
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(draws))
    return (
        math.exp(statistics.fmean(logs)),
        math.exp(means[int(0.025 * draws)]),
        math.exp(means[int(0.975 * draws) - 1]),
    )


def summary(results: list[dict[str, Any]], configs: list[str], workloads: list[str]) -> str:
    lines = []
    for workload in workloads:
        rows = [r for r in results if r["workload"] == workload]
        lines.append(f"== {workload}: {len(rows)} timed runs")
        for config in configs:
            mine = [r for r in rows if r["config"] == config]
            if mine:
                tok = [r["out_tok_s"] for r in mine]
                lines.append(
                    f"  {config:<7} out tok/s median {statistics.median(tok):9.1f} "
                    f"({min(tok):.1f}-{max(tok):.1f}), seconds "
                    f"{statistics.median(r['seconds'] for r in mine):.3f}, steps "
                    f"{statistics.median(len(r['steps']) for r in mine):.0f}"
                )
        for config in configs:
            timers = [r.get("step_timers") or {} for r in rows if r["config"] == config]
            names = sorted({name for t in timers for name in t})
            if names:  # each part's CPU a round, on the thread that ran it (one GPU: all on
                # the engine core's main thread; several: process_output on the output thread)
                ms = {n: statistics.median(t.get(n, [0, 0.0])[1] for t in timers) for n in names}
                parts = ", ".join(f"{name} {ms[name] * 1e3:.1f}" for name in names)
                lines.append(
                    f"  {config:<7} CPU per round in each timed part (its thread's clock), "
                    f"ms (median): {parts}"
                )
            waits = timed_waits(timers)
            if waits:
                lines.append(f"  {config:<7} {waits}")
            heavy = heavy_calls(timers)
            if heavy:
                lines.append(f"  {config:<7} {heavy}")
        for config in configs:
            line = keys_reading(r for r in rows if r["config"] == config)
            if line:
                lines.append(f"  {config:<7} {line}")
        for a, b in PAIRS:
            ratios = paired(results, workload, a, b)
            if ratios:
                mean, low, high = geomean_ci(ratios)
                lines.append(
                    f"  {a}/{b}: median {statistics.median(ratios):.4f} "
                    f"(min {min(ratios):.4f}, max {max(ratios):.4f}, n={len(ratios)}); "
                    f"geometric mean {mean:.4f}, 95% interval {low:.4f}-{high:.4f}"
                )
        for seed in sorted({r["seed"] for r in rows}):
            same = {r["config"]: r for r in rows if r["seed"] == seed}
            tokens = {r["tokens_digest"] for r in same.values()}
            r3 = {c: r["r3_digest"] for c, r in same.items() if c in RIGHT_R3}
            missing = sum(r["r3_missing"] for r in same.values())
            same_tokens = "identical" if len(tokens) == 1 else "DIFFER"
            verdict = "identical" if len(set(r3.values())) <= 1 else "DIFFER"
            if len(r3) < 2:  # nothing to compare it with
                verdict = "not compared (one configuration with R3)"
            if verdict == "DIFFER":
                verdict += differing_requests(same, sorted(r3))
            lines.append(
                f"  round seed {seed}: tokens {same_tokens}"
                f" across {sorted(same)}; R3 of {sorted(r3)} {verdict}; missing R3 {missing}"
            )
    return "\n".join(lines)


def differing_requests(runs: dict[str, dict[str, Any]], configs: list[str]) -> str:
    """How many requests' R3 differ, each configuration against the first (``ours`` if it is
    among them): near-ties in differently composed bf16 batches flip a few, a bug many. Where
    the runs carry span digests, each differing request (up to ``SHOWN_REQUESTS``) is
    located: the first differing token and the spans that differ."""
    first = "ours" if "ours" in configs else configs[0]
    mine = runs[first].get("r3_request_digests", [])
    my_spans = runs[first].get("r3_span_digests", [])
    parts = []
    for other in configs:
        if other == first:
            continue
        theirs = runs[other].get("r3_request_digests", [])
        differ = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b]
        part = f"{other} {len(differ)} of {min(len(mine), len(theirs))}"
        spans = runs[other].get("r3_span_digests", [])
        where = [
            located(i, my_spans[i], spans[i])
            for i in differ[:SHOWN_REQUESTS]
            if i < min(len(my_spans), len(spans))
        ]
        if where:
            part += " [" + "; ".join(where) + "]"
        parts.append(part)
    return f" in requests (against {first}: " + ", ".join(parts) + ")"


#: tokens per span of ``span_digests``: a prefill request's 2,064 rows in 33 spans
SPAN_TOKENS = 64


def span_digests(experts: np.ndarray) -> str:
    """One byte of digest per ``SPAN_TOKENS`` rows of a request's R3, as hex (the worker
    keeps it per request): two engines' digests of a request locate where its rows differ
    for about 1% of the rows' size."""
    rows = np.ascontiguousarray(experts)
    return "".join(
        hashlib.blake2b(rows[start : start + SPAN_TOKENS].tobytes(), digest_size=1).hexdigest()
        for start in range(0, len(rows), SPAN_TOKENS)
    )


#: differing requests ``differing_requests`` locates, per configuration
SHOWN_REQUESTS = 4


def located(request: int, mine: str, theirs: str) -> str:
    """Where one request's rows differ, from two span digests (two hex digits a span)."""
    a = [mine[i : i + 2] for i in range(0, len(mine), 2)]
    b = [theirs[i : i + 2] for i in range(0, len(theirs), 2)]
    if len(a) != len(b):
        return f"request {request}: {len(a)} against {len(b)} spans (row counts differ)"
    spans = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if not spans:  # a one-byte digest misses one difference in 256
        return f"request {request}: no span's digest differs"
    return (
        f"request {request}: from token {spans[0] * SPAN_TOKENS}, {len(spans)} of {len(a)} "
        f"spans of {SPAN_TOKENS} tokens"
    )


def keys_reading(runs: Iterable[dict[str, Any]]) -> str | None:
    """The keys handles' reading after each round (``ours+keys``: a trainer's side, not in
    the round's time): median seconds, the rate, and handles that could not be read."""
    read = [r["keys_read"] for r in runs if isinstance(r.get("keys_read"), dict)]
    if not read:
        return None
    seconds = statistics.median(k["seconds"] for k in read)
    nbytes = statistics.median(k["bytes"] for k in read)
    failed = sum(k.get("failed", 0) for k in read)
    first = next((k["first_error"] for k in read if k.get("first_error")), None)
    return (
        f"R3 read through the keys after each round (median): {seconds:.3f} s, "
        f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s; handles not read {failed}"
        + (f" (first: {first})" if first else "")
    )


def heavy_calls(timers: list[dict[str, list[float]]]) -> str | None:
    """Of each timed part's CPU a round, the share in its heavy calls (1 ms of CPU or more,
    ``engine_hooks.HEAVY_CALL_S``): medians over rounds of their CPU in ms and their count;
    None where the rounds did not record them."""
    names = sorted({n for t in timers for n, entry in t.items() if len(entry) > 4})
    if not names:
        return None

    def median(n: str, field: int) -> float:
        return statistics.median(t[n][field] if len(t.get(n, ())) > 4 else 0.0 for t in timers)

    parts = ", ".join(
        f"{n} {median(n, 4) * 1e3:.1f} in {median(n, 3):.0f} of {median(n, 0):.0f} calls"
        for n in names
    )
    return f"CPU in calls of 1 ms or more per round, ms (median): {parts}"


def timed_waits(timers: list[dict[str, list[float]]]) -> str | None:
    """The time the timed parts waited a round (wall less CPU: for the GIL, the connector's
    lock, the tracker process), medians over rounds in ms; None where the rounds recorded no
    wall time (before the timers kept it)."""
    names = sorted({n for t in timers for n, entry in t.items() if len(entry) > 2})
    if not names:
        return None
    ms = {
        n: statistics.median(
            max(0.0, t[n][2] - t[n][1]) if len(t.get(n, ())) > 2 else 0.0 for t in timers
        )
        for n in names
    }
    parts = ", ".join(f"{name} {ms[name] * 1e3:.1f}" for name in names)
    return f"waiting inside the timed parts per round, ms (median, wall less CPU): {parts}"
