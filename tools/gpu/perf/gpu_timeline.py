"""When the GPU worked and when it waited, per round, from CUDA events on the engine's stream.

A round can lose time to R3 in two ways that the CPU timers cannot tell apart: more GPU work
(the capture's copies, the rows' copy, contention for the GPU) or more time with the GPU idle,
waiting for the engine's main thread to queue the next step. :func:`gpu_timeline` records a
timing event on the model runner's stream before and after each ``execute_model`` and
``sample_tokens`` call and around each forward pass inside (a CUDA graph's replay, or the
model's eager forward). An event completes when the GPU reaches it, so:

- a forward's two events time the GPU's work on it alone (the forward's kernels, queued back
  to back once it starts): R3's work inside the graph counts here;
- the rest of the round's span, outside forwards, is the GPU waiting for the main thread to
  queue the next forward (its own work there, e.g. ``begin_step`` inside ``execute_model``,
  shows as a later forward start) plus the small kernels that prepare inputs and sample;
- the gaps between one call's last event and the next call's first are time with nothing
  queued at all.

:func:`timeline_figures` sums them (pure, tested here). Six events a step cost the main thread
a few microseconds; every configuration pays them alike. Work on other streams (the output
copies) is not counted.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

#: at most this many calls are kept between reads (an unread engine does not grow forever)
MAX_CALLS = 100_000
#: gaps at least this long are counted apart and the longest listed (ms)
GAP_MS = 1.0


def timeline_figures(calls: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Figures of calls ``(name, start_ms, end_ms)``, their times those of the events (one
    origin): top-level calls in stream order, with the forwards inside them named
    ``"forward"``. In calls: each top-level call's end less its start (the GPU's work on what
    it queued, and any wait inside it before it queued anything); idle: each call's start less
    the previous one's end (never negative: events on one stream complete in order, so only
    rounding makes it so); outside forwards: the span less the forwards' time."""
    top = [call for call in calls if call[0] != "forward"]
    spans = sorted((start, end) for name, start, end in calls if name == "forward")
    forwards = [end - start for start, end in spans]
    if not top:
        return {"calls": 0}
    in_calls: dict[str, list[float]] = {}
    gaps: list[tuple[float, str]] = []  # (ms, the call that waited)
    previous_end = None
    for name, start, end in top:
        in_calls.setdefault(name, []).append(max(0.0, end - start))
        if previous_end is not None:
            gaps.append((max(0.0, start - previous_end), name))
        previous_end = end
    span = top[-1][2] - top[0][1]
    long_gaps = sorted((g for g in gaps if g[0] >= GAP_MS), reverse=True)
    return {
        "calls": len(top),
        "forwards": len(forwards),
        "span_s": span / 1000,
        "forward_s": sum(forwards) / 1000,
        "outside_forwards_s": (span - sum(forwards)) / 1000,
        "median_forward_ms": round(statistics.median(forwards), 4) if forwards else None,
        "in_calls_s": sum(sum(v) for v in in_calls.values()) / 1000,
        "idle_s": sum(ms for ms, _ in gaps) / 1000,
        "in_calls_by_name_s": {name: round(sum(v) / 1000, 6) for name, v in in_calls.items()},
        "gaps_over_1ms": len(long_gaps),
        "idle_in_gaps_over_1ms_s": sum(ms for ms, _ in long_gaps) / 1000,
        "longest_gaps_ms": [[round(ms, 3), name] for ms, name in long_gaps[:8]],
        # where the span lies from the origin (the first event since the last read)
        "first_start_ms": round(top[0][1], 4),
        "last_end_ms": round(top[-1][2], 4),
        # the GPU's time from each forward's end to the next one's start, in order: where in
        # the round it waited between forwards
        "between_forwards_ms": [
            round(max(0.0, b[0] - a[1]), 3) for a, b in itertools.pairwise(spans)
        ],
    }


def gpu_timeline(worker: Any, read: bool = False) -> dict[str, Any]:
    """Install the events on the worker's model runner (first call), or with ``read`` return
    :func:`timeline_figures` of the calls since the last read and start again. Runs where
    collective_rpc runs (the engine core's process on a one-GPU engine)."""
    import contextlib
    import functools

    import torch

    runner = worker.model_runner
    calls: list[tuple[str, Any, Any]] | None = getattr(runner, "_perf_gpu_calls", None)
    if calls is not None:
        if not read:
            return {}
        origin, runner._perf_gpu_origin = runner._perf_gpu_origin, None
        runner._perf_gpu_calls = []
        if not calls:
            return {"calls": 0}
        torch.cuda.synchronize()
        figures = timeline_figures(
            [(name, origin.elapsed_time(a), origin.elapsed_time(b)) for name, a, b in calls]
        )
        # the host's clock when the origin was recorded: a round's first event finds the GPU
        # idle and completes at once, so the span's ends lie on the frontend's clock too
        # (time.perf_counter is CLOCK_MONOTONIC, one clock for the machine's processes)
        figures["origin_host_s"] = runner._perf_gpu_origin_host
        return figures
    if not torch.cuda.is_available():
        return {"unavailable": "no CUDA device"}
    runner._perf_gpu_calls = []
    runner._perf_gpu_origin = None  # the first event since the last read: times count from it
    runner._perf_gpu_origin_host = None

    def event() -> Any:
        made = torch.cuda.Event(enable_timing=True)
        made.record()
        if runner._perf_gpu_origin is None:
            runner._perf_gpu_origin = made
            runner._perf_gpu_origin_host = time.perf_counter()
        return made

    def keep(name: str, before: Any) -> None:
        kept = runner._perf_gpu_calls
        if before is not None and len(kept) < MAX_CALLS:
            kept.append((name, before, event()))

    def maybe_event() -> Any:
        """An event, or None if recording failed (the step must not fail for the aid)."""
        try:
            return event()
        except Exception:
            return None

    capturing = torch.cuda.is_current_stream_capturing  # no events inside a graph's capture

    def timed(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if capturing():
                return original(*args, **kwargs)
            before = maybe_event()
            result = original(*args, **kwargs)
            with contextlib.suppress(Exception):
                keep(name, before)
            return result

        return wrapper

    for name in ("execute_model", "sample_tokens"):
        original = getattr(runner, name, None)
        if callable(original):
            setattr(runner, name, timed(name, original))
    # forwards: a full CUDA graph's replay (MRV2's graph manager), else the model's forward
    # (eager, or piecewise graphs: MRV2 calls the model for both)
    graphs = getattr(runner, "cudagraph_manager", None)
    if graphs is not None and callable(getattr(graphs, "run_fullgraph", None)):
        graphs.run_fullgraph = timed("forward", graphs.run_fullgraph)
    model = runner.get_model() if hasattr(runner, "get_model") else None
    if model is not None:
        started: list[Any] = []

        def before_forward(*_: Any) -> None:
            if not capturing():
                started.append(maybe_event())

        def after_forward(*_: Any) -> None:
            if started and not capturing():
                with contextlib.suppress(Exception):
                    keep("forward", started.pop())

        model.register_forward_pre_hook(before_forward)
        model.register_forward_hook(after_forward)
    return {}
