"""What the side-by-side benchmark installs in an engine core through ``collective_rpc``:
profilers (torch.profiler, cProfile), CPU timers around the step's parts, and the experiment
variants of ``ours`` (``ours+nocap``, ``+nocopy``, ``+pinnedviews``, ``+perlayer``, ``+fresh``,
``+background``, ``+allinline``, ``+earlyfacts``, and ``+copyframes`` and ``+switch`` on any
configuration).

Each function runs in the engine core's process, on its main thread (on a one-GPU engine the
one that schedules, launches the forward and runs the connectors). ``worker.py`` registers
this module with cloudpickle by value, so the engine core needs no path to import it.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def torch_profile(_: Any = None, stop: bool = False) -> str:
    """Start (or stop and summarise) torch.profiler in this process: on stop, the ops by
    self CPU time (CUDA runtime calls such as kernel launches and syncs among them) and, on a
    GPU, by self device time."""
    import torch

    if not stop:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
        torch._perf_profiler = prof  # type: ignore[attr-defined]
        return "started"
    prof = torch._perf_profiler  # type: ignore[attr-defined]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    table = prof.key_averages()
    lines = [table.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60)]
    if torch.cuda.is_available():
        for device_key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                lines.append(
                    table.table(sort_by=device_key, row_limit=25, max_name_column_width=60)
                )
                break
            except Exception as error:  # the key's name differs between torch versions
                lines.append(f"(sort by {device_key}: {error})")
    return "\n".join(lines)


def python_profile(_: Any = None, stop: bool = False, dump: str = "") -> str:
    """Start (or stop and summarise) cProfile on the calling thread. collective_rpc runs on
    the engine core's main thread, which on a one-GPU engine does everything of a step
    (scheduling, launching the forward, the connectors, outputs): the tables say where that
    thread's time goes, function by function (cProfile inflates Python-heavy code)."""
    import cProfile
    import io
    import pstats

    if not stop:
        prof = cProfile.Profile()
        prof.enable()
        cProfile._perf_profile = prof  # type: ignore[attr-defined]
        return "started"
    prof = cProfile._perf_profile  # type: ignore[attr-defined]
    prof.disable()
    if dump:  # the whole profile, for pstats or snakeviz
        prof.dump_stats(dump)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    for key in ("tottime", "cumulative"):
        out.write(f"== sorted by {key}\n")
        stats.sort_stats(key).print_stats(60)
    return out.getvalue()


#: a timed call with this much CPU or more counts as heavy (``step_timers``)
HEAVY_CALL_S = 0.001


def timed_calls(entry: list[float], original: Any) -> Any:
    """``original``, adding to ``entry`` (``[calls, CPU s, wall s, heavy calls, their CPU s]``)
    at each call; CPU by the calling thread's clock."""
    import functools

    clock, wall = time.thread_time, time.perf_counter

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started, started_wall = clock(), wall()
        try:
            return original(*args, **kwargs)
        finally:
            cpu = clock() - started
            entry[0] += 1
            entry[1] += cpu
            entry[2] += wall() - started_wall
            if cpu >= HEAVY_CALL_S:
                entry[3] += 1
                entry[4] += cpu

    return wrapper


def step_timers(worker: Any, read: bool = False) -> dict[str, list[float]]:
    """CPU time of the engine core's main thread in the step's parts, by thread CPU clocks
    around them (installed on first call; ``read`` returns and resets the totals): the
    scheduler's ``schedule`` and ``update_from_output`` (every configuration; the R3
    connector's per-request ``take_output`` runs inside the latter), the R3 connectors'
    per-step methods on both sides and vLLM's per-layer capture (R3 configurations; eager
    steps only, a CUDA graph replays it without Python). A few microseconds a step.
    Name -> [calls, CPU seconds, wall seconds, heavy calls, their CPU seconds]: wall less
    CPU is the time the calls waited (for the GIL, for the connector's lock while another
    thread holds it, for the tracker process); heavy calls took ``HEAVY_CALL_S`` of CPU or
    more (a part's cost in a few steps, as prefill or block-completing steps, or in every
    step). Runs where collective_rpc runs: on a one-GPU engine the engine core's process,
    where the scheduler lives too."""

    import vllm.v1.core.sched.scheduler as scheduler_module

    totals: dict[str, list[float]] | None = getattr(scheduler_module, "_perf_step_timers", None)
    if totals is not None:
        if read:
            found = {name: list(entry) for name, entry in totals.items()}
            for entry in totals.values():
                entry[:] = [0, 0.0, 0.0, 0, 0.0]
            return found
        return {}
    totals = {}
    scheduler_module._perf_step_timers = totals  # type: ignore[attr-defined]

    def timed(name: str, original: Any) -> Any:
        return timed_calls(totals.setdefault(name, [0, 0.0, 0.0, 0, 0.0]), original)

    def wrap_class(cls: type, names: tuple[str, ...], prefix: str) -> None:
        for name in names:
            if callable(getattr(cls, name, None)):
                setattr(cls, name, timed(f"{prefix}.{name}", getattr(cls, name)))

    # The scheduler and its R3 connector: the engine core running this call holds them (a
    # caller's frame; vLLM freezes its start-up objects out of gc.get_objects()).
    from vllm.v1.core.sched.scheduler import Scheduler

    frame: Any = sys._getframe()
    scheduler = None
    while frame is not None and scheduler is None:
        found = getattr(frame.f_locals.get("self"), "scheduler", None)
        scheduler = found if isinstance(found, Scheduler) else None
        frame = frame.f_back
    if scheduler is not None:
        wrap_class(type(scheduler), ("schedule", "update_from_output"), "scheduler")
        connector = getattr(scheduler, "aux_output_connector", None)
        if connector is not None:
            wrap_class(
                type(connector),
                # per step only: take_output (per request) runs inside update_from_output,
                # ours' eviction observer (per evicted block) inside schedule
                ("build_connector_meta",),
                "scheduler_connector",
            )
    connector = getattr(worker.model_runner, "aux_output_connector", None)
    if connector is not None:
        wrap_class(
            type(connector), ("begin_step", "prepare_output", "process_output"), "worker_connector"
        )
        module = sys.modules[type(connector).__module__]
        for value in vars(module).values():
            if isinstance(value, type) and "enqueue_cpu_copy" in vars(value):
                wrap_class(value, ("enqueue_cpu_copy",), "worker_connector")
        for module_ in worker.get_model().modules():
            for owner in (module_, getattr(module_, "router", None)):
                if owner is not None and getattr(owner, "capture_fn", None) is not None:
                    owner.capture_fn = timed("capture", owner.capture_fn)
    return {}


def unbind_capture(worker: Any) -> int:
    """Unbind vLLM's routed-experts capture from every MoE router of the worker's model (the
    CUDA graphs captured at start-up keep theirs); returns how many were unbound."""
    count = 0
    for module in worker.get_model().modules():
        for owner in (module, getattr(module, "router", None)):
            if owner is not None and getattr(owner, "capture_fn", None) is not None:
                owner.capture_fn = None
                count += 1
    return count


def skip_copy(_: Any = None) -> str:
    """Replace ours' per-step device-to-host copy of the captured rows by a zero array of the
    same shape (an experiment: what the copy into pinned memory costs; R3 is wrong by design)."""
    import numpy

    from vllm_artifact.integration.worker_connector import PendingArtifactStep

    zeros: dict[tuple[int, ...], Any] = {}

    def enqueue_cpu_copy(self: Any, num_sampled: Any, num_rejected: Any) -> None:
        self.num_sampled, self.num_rejected = num_sampled, num_rejected
        shape = tuple(self.snapshot.shape)
        if shape not in zeros:
            dtype = str(self.snapshot.dtype).removeprefix("torch.")  # uint8 or uint16
            zeros[shape] = numpy.zeros(shape, dtype=dtype)
        self.rows = zeros[shape]

    PendingArtifactStep.enqueue_cpu_copy = enqueue_cpu_copy  # type: ignore[method-assign]
    return "copy skipped"


def pinned_views(_: Any = None) -> str:
    """Hand the step's rows on as views of the pinned host copy, without ``take_rows``'
    copy-out (an experiment: what releasing that buffer on other threads costs; R3 stays
    right)."""
    from vllm_artifact.integration.worker_connector import PendingArtifactStep

    def take_rows(self: Any, arrays: Any = None) -> Any:
        rows, self.rows = self.rows, None
        return rows

    PendingArtifactStep.take_rows = take_rows  # type: ignore[method-assign]
    return "pinned views"


def per_layer_capture(worker: Any) -> str:
    """Turn off ours' batched capture of eager steps: vLLM's per-layer copies instead (an
    experiment: what batching saves; R3 stays right)."""
    worker.model_runner.aux_output_connector._capturer._moe_layers = 0
    return "per-layer capture"


def fresh_arrays(worker: Any) -> str:
    """Turn off the reuse of the step's row arrays' memory (core/recycled_arrays.py): every
    array in fresh memory (an experiment: what reuse saves; R3 stays right)."""
    tracker = worker.model_runner.aux_output_connector._tracker
    if tracker is None:
        return "no tracker on this rank"
    tracker.arrays.min_bytes = sys.maxsize  # every array a plain np.empty, buffers kept or not
    return "fresh arrays"


def background_publisher(worker: Any) -> str:
    """Publish on a background thread, as for a network store, instead of inline on the step
    thread (an experiment: what the engine main thread loses to another thread taking the GIL
    while the main thread is inside a torch or CUDA call; R3 stays right)."""
    from vllm_artifact.core.publisher import Publisher

    connector = worker.model_runner.aux_output_connector
    tracker = getattr(connector, "_tracker", None)
    if tracker is None:
        return "no publisher on this rank"
    connector._publisher.close()
    connector._publisher = tracker._publication._publisher = Publisher(connector._store)
    return "background publisher"


def all_inline(worker: Any) -> str:
    """Write every batch of blocks inline, a decode step's few too, not only batches of
    ``MEMORY_STORE_INLINE_FROM_BLOCKS`` (an experiment; R3 stays right)."""
    connector = worker.model_runner.aux_output_connector
    publisher = getattr(connector, "_publisher", None)
    if publisher is None:
        return "no publisher on this rank"
    publisher.inline_from_blocks = 1
    return "every batch of blocks inline"


def copied_frames(_: Any = None) -> str:
    """Make the engine's ZMQ sockets copy every frame instead of sending large ones zero-copy
    (an experiment: zero-copy frames are released by pyzmq's garbage-collector thread, which
    takes the GIL once per frame; R3 stays right)."""
    import gc as gc_module

    import zmq

    zmq.COPY_THRESHOLD = 1 << 30
    sockets = [s for s in gc_module.get_objects() if isinstance(s, zmq.Socket)]
    for socket in sockets:
        socket.copy_threshold = 1 << 30
    return f"{len(sockets)} sockets copy frames"


#: ``+switch``: the engine core's GIL switch interval (s); CPython's default is 5 ms
SHORT_SWITCH_INTERVAL_S = 0.0005


def short_switch_interval(_: Any = None) -> str:
    """Shorten the engine core process's GIL switch interval (an experiment; R3 stays right).
    A thread that wants the GIL waits up to the interval for a thread running Python to drop
    it: the main thread, back from a wait on the GPU, can be held that long by the connector's
    output-thread work (``process_output``) before it queues the next step."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SHORT_SWITCH_INTERVAL_S)
    return f"switch interval {before * 1e3:g} ms -> {SHORT_SWITCH_INTERVAL_S * 1e3:g} ms"


def early_facts(worker: Any) -> str:
    """Apply each step's scheduler facts in ``begin_step``, before the step's forward is
    queued, as the connector did before it moved them to ``prepare_output`` (an experiment;
    R3 stays right): every step is marked as one without a forward, which applies them at
    once. ``begin_step`` stays the class's (timed) method."""
    connector = worker.model_runner.aux_output_connector
    if connector is None or getattr(connector, "_tracker", None) is None:
        return "no in-engine tracker on this rank"
    begin = type(connector).begin_step

    def begin_step(metadata: Any) -> Any:
        if metadata is not None and hasattr(metadata, "runs_forward"):
            metadata.runs_forward = False
        return begin(connector, metadata)

    connector.begin_step = begin_step
    return "a step's facts applied in begin_step, before its forward is queued"
