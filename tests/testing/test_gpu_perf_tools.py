"""Tests for the GPU throughput harness's pure parts (``tools/gpu/perf``).

The GPU figures in ``docs/benchmarks.md`` rest on them: which prompts a round runs, how the
frontend's step trace splits into eager and decode steps, how ``--repeat`` is read, and how
many rounds a resolution needs. They run without a GPU.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

PERF = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "perf"
sys.path.insert(0, str(PERF))

import analyze  # noqa: E402  (beside the scripts, as they import each other)
import engine_setup  # noqa: E402
import gpu_timeline  # noqa: E402
import hw_counters  # noqa: E402
import pinning  # noqa: E402
import pool  # noqa: E402
import report  # noqa: E402
import worker  # noqa: E402


def test_repeat_keeps_the_first_workload_and_adds_new_ones_of_its_shape() -> None:
    single, tokens = worker.workload_prompts("prefill", 7, 1.0)
    repeated, repeated_tokens = worker.workload_prompts("prefill", 7, 1.0, repeat=3)
    assert repeated_tokens == tokens == 16
    assert len(single) == 128 and len(repeated) == 3 * 128
    assert repeated[:128] == single  # a round of repeat 1 is the first part
    # each part: 4 shared 1536-token prefixes, its own ids
    for part in (1, 2):
        prompts = repeated[128 * part : 128 * (part + 1)]
        assert {len(p) for p in prompts} == {2048}
        assert len({tuple(p[:1536]) for p in prompts}) == 4
        assert prompts[0][:1536] != single[0][:1536]
    assert repeated[128][:1536] != repeated[256][:1536]
    # the same round for every configuration
    assert worker.workload_prompts("prefill", 7, 1.0, repeat=3)[0] == repeated


def test_repeat_is_read_for_every_workload_or_per_workload() -> None:
    workloads = ["decode", "prefill"]
    assert engine_setup.parse_repeat("4", workloads) == {"decode": 4, "prefill": 4}
    assert engine_setup.parse_repeat("prefill=4", workloads) == {"decode": 1, "prefill": 4}
    assert engine_setup.parse_repeat("decode=2,prefill=3", workloads) == {"decode": 2, "prefill": 3}
    for text in ("0", "prefill=0", "chat=2", "x"):
        with pytest.raises(ValueError):
            engine_setup.parse_repeat(text, workloads)


def _run(gaps_ms: list[float], repeat: int = 1) -> dict[str, object]:
    times, at = [], 0.0
    for gap in gaps_ms:
        at += gap / 1000
        times.append([at, 0])
    return {"steps": times, "repeat": repeat}


def test_long_steps_are_the_eager_ones_in_rounds_of_one_or_several_workloads() -> None:
    # one workload: 9 eager steps among 16 decode steps (a prefill round's shape)
    eager = [450, 250, 290, 350, 350, 350, 330, 260, 230]
    decode = [60, 40, 35, 64, 62, 66, 55, 28, 26, 25, 20, 15, 13, 10, 8, 4]
    short, long = analyze.step_gaps(_run(eager + decode))
    assert sorted(long) == pytest.approx(sorted(g / 1000 for g in eager))
    assert len(short) == len(decode)
    # four workloads: most steps eager, as the frontend traced them (tools of 468d2df)
    eager4 = [446, 188, 221, 235, 236, 239, 238, 232, 241, 220, 234, 243, 236, 238, 242, 243]
    eager4 += [247, 211, 206, 234, 236, 231, 240, 243, 236, 243, 227, 230, 235, 245, 235, 236]
    eager4 += [239, 244, 238, 211, 196]
    decode4 = [0, 18, 32, 76, 74, 66, 76, 74, 54, 57, 53, 52, 64, 62, 62, 64, 33]
    short, long = analyze.step_gaps(_run(eager4 + decode4, repeat=4))
    assert len(long) == len(eager4) and len(short) == len(decode4)
    # read as one workload, the same trace would have one long step: the rule differs
    assert len(analyze.step_gaps(_run(eager4 + decode4))[1]) == 1


def test_scatter_names_the_rounds_an_interval_needs() -> None:
    ratios = [1.01, 0.99, 1.02, 0.98, 1.0, 1.005, 0.995]
    sd = statistics.stdev(math.log(r) for r in ratios)
    text = pool.scatter(ratios)
    assert f"{sd:.4f}" in text
    need_1 = math.ceil((1.96 * sd / math.log(1.01)) ** 2)
    need_half = math.ceil((1.96 * sd / math.log(1.005)) ** 2)
    assert f"+-1%: {need_1}," in text and text.endswith(f"+-0.5%: {need_half}")
    assert need_half > need_1 > 1


def test_step_timer_share_counts_r3_parts_and_the_schedulers_excess_once() -> None:
    def run(seconds: float, **parts: float) -> dict[str, object]:
        timers = {name.replace("__", "."): [10, value] for name, value in parts.items()}
        return {"seconds": seconds, "step_timers": timers}

    # Figures of a GPU round (ms): build_connector_meta runs inside schedule, so it counts once.
    off = [run(11.5, scheduler__schedule=0.300, scheduler__update_from_output=0.177)]
    ours = [
        run(
            12.0,
            scheduler__schedule=0.338,
            scheduler__update_from_output=0.221,
            scheduler_connector__build_connector_meta=0.010,
            worker_connector__process_output=0.473,
            worker_connector__begin_step=0.127,
            capture=0.032,
        )
    ]
    got = analyze.step_timer_share(ours, off)
    assert got.own == pytest.approx(0.010 + 0.473 + 0.127 + 0.032)
    assert got.scheduler_excess == pytest.approx((0.338 - 0.300) + (0.221 - 0.177) - 0.010)
    assert got.share == pytest.approx((0.642 + 0.072) / 12.0)
    assert got.excess_known
    # Without a base run with timers, or against one that runs R3 itself (vLLM's own), only
    # R3's own parts count.
    without_timers = [{"seconds": 11.5}]
    for base in ([], without_timers, ours):
        alone = analyze.step_timer_share(ours, base)
        assert not alone.excess_known and alone.scheduler_excess == 0.0
        assert alone.share == pytest.approx(0.642 / 12.0)


def test_the_engine_main_threads_cpu_and_busy_share_are_read_per_round() -> None:
    def run(seconds: float, main: float) -> dict[str, object]:
        threads = {"MainThread:11": main, "MainThread-2:12": 9.0, "Thread-1 (x):13": 0.4}
        return {
            "seconds": seconds,
            "threads_cpu_s": {"frontend": {"MainThread:1": 2.0}, "engine1": threads},
        }

    assert pool.main_thread_cpu(run(10.0, 9.3)) == pytest.approx(9.3)
    assert math.isnan(pool.main_thread_cpu({"seconds": 1.0}))  # not recorded
    rounds = [run(10.0, 9.3), run(8.0, 7.6), run(12.0, 10.8), {"seconds": 9.0}]
    assert pool.main_thread_busy(rounds) == pytest.approx(0.93)  # of 0.93, 0.95, 0.90
    # vLLM's schedule without the R3 connector part timed inside it: a CPU-speed reference
    schedule = {"scheduler.schedule": [54, 0.300], "scheduler.update_from_output": [54, 0.2]}
    assert pool.schedule_cpu({"step_timers": schedule}) == pytest.approx(0.300)
    ours = {**schedule, "scheduler_connector.build_connector_meta": [54, 0.010]}
    assert pool.schedule_cpu({"step_timers": ours}) == pytest.approx(0.290)
    assert math.isnan(pool.schedule_cpu({"seconds": 1.0}))


def test_main_thread_instructions_pair_by_round_and_unavailable_counters_are_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(config: str, seed: int, instructions: int, cycles: int) -> dict[str, object]:
        counted = {"instructions": instructions, "cycles": cycles}
        return {
            "workload": "prefill",
            "config": config,
            "seed": seed,
            "out_tok_s": 100.0,
            "steps": [[0.1, 1], [0.2, 1]],
            "main_thread_counters": counted if instructions else {"unavailable": "ENOENT"},
        }

    rounds = [
        run("off", 0, 1000, 500),
        run("ours", 0, 1010, 600),
        run("off", 1, 2000, 1000),
        run("ours", 1, 2040, 1122),
        run("off", 2, 0, 0),  # a machine without counters: no ratio from this round
        run("ours", 2, 0, 0),
    ]
    results = tmp_path / "results.json"
    results.write_text(__import__("json").dumps({"results": rounds}))
    monkeypatch.setattr(sys, "argv", ["pool.py", str(results)])
    pool.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "main " in line]
    instr = next(line for line in lines if "main instr" in line)
    # off/ours: 1000/1010 and 2000/2040, seeds 0 and 1 only
    assert "median 0.9852" in instr and "n=2" in instr
    cpi = next(line for line in lines if "main CPI" in line)
    assert "ours 0.572 (0.550-0.594)" in cpi and "off 0.500 (0.500-0.500)" in cpi
    assert math.isnan(pool.main_thread_counter({"main_thread_counters": {}}, "cycles"))


def test_prefill_graphs_double_from_the_decode_sizes_up_to_the_batch_limit() -> None:
    args = engine_setup.with_prefill_graphs(engine_setup.GPU_ENGINE_ARGS)
    sizes = args["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert args["compilation_config"]["cudagraph_mode"] == "FULL"
    odd = {**engine_setup.GPU_ENGINE_ARGS, "max_num_batched_tokens": 3000}
    assert engine_setup.with_prefill_graphs(odd)["compilation_config"]["cudagraph_capture_sizes"][
        -3:
    ] == [1024, 2048, 3000]
    assert engine_setup.GPU_ENGINE_ARGS["compilation_config"]["cudagraph_capture_sizes"][-1] == 256


def test_the_driver_offers_prefill_graphs_on_its_command_line() -> None:
    """The driver imports what it needs from its sibling modules and documents the option."""
    shown = subprocess.run(
        [sys.executable, str(PERF / "driver.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--prefill-graphs" in shown and "--split-cpus" in shown


def timed_round(config: str, r3: str) -> dict[str, Any]:
    """A prefill round's record as the driver keeps it, one second long."""
    return {
        "workload": "prefill",
        "config": config,
        "seed": 0,
        "out_tok_s": 1.0,
        "seconds": 1.0,
        "steps": [[0.1, 1]],
        "tokens_digest": "t",
        "r3_digest": r3,
        "r3_missing": 0,
    }


def test_r3_is_called_identical_only_where_two_configurations_have_it() -> None:
    run = timed_round

    alone = report.summary([run("off", ""), run("ours", "a")], ["off", "ours"], ["prefill"])
    assert "R3 of ['ours'] not compared (one configuration with R3)" in alone
    both = [run("off", ""), run("ours", "a"), run("native", "a")]
    assert "R3 of ['native', 'ours'] identical" in report.summary(
        both, ["off", "ours", "native"], ["prefill"]
    )
    both[2]["r3_digest"] = "b"
    assert "R3 of ['native', 'ours'] DIFFER in requests (against ours: native 0 of 0)" in (
        report.summary(both, ["off", "ours", "native"], ["prefill"])
    )
    # any pair of configurations with R3 is counted request by request, not only vLLM's own
    three = [run("off", ""), run("ours", "a"), run("ours+process", "b"), run("native", "c")]
    three[1]["r3_request_digests"] = ["x", "y", "z"]
    three[2]["r3_request_digests"] = ["x", "q", "z"]
    three[3]["r3_request_digests"] = ["p", "q", "r"]
    shown = report.summary(three, ["off", "ours", "ours+process", "native"], ["prefill"])
    assert "DIFFER in requests (against ours: native 3 of 3, ours+process 1 of 3)" in shown


def test_differing_requests_are_located_by_their_span_digests() -> None:
    rows = np.arange(150 * 58 * 8, dtype=np.uint8).reshape(150, 58, 8)
    flipped = rows.copy()
    flipped[130, 40, 3] += 1  # one expert id of token 130, in the third span of 64 tokens
    shorter = rows[:120]
    ours = {"r3_request_digests": ["a", "b", "c"]}
    ours["r3_span_digests"] = [report.span_digests(r) for r in (rows, rows, rows)]
    other = {"r3_request_digests": ["a", "x", "y"]}
    other["r3_span_digests"] = [report.span_digests(r) for r in (rows, flipped, shorter)]
    shown = report.differing_requests(
        {"ours": ours, "ours+process": other}, ["ours", "ours+process"]
    )
    assert shown == (
        " in requests (against ours: ours+process 2 of 3 [request 1: from token 128, 1 of 3 "
        "spans of 64 tokens; request 2: 3 against 2 spans (row counts differ)])"
    )


def test_the_timed_parts_waits_are_their_wall_time_less_their_cpu() -> None:
    rounds = [
        {"worker_connector.begin_step": [55, 0.090, 0.130], "scheduler.schedule": [55, 0.2, 0.2]},
        {"worker_connector.begin_step": [55, 0.100, 0.160], "scheduler.schedule": [55, 0.2, 0.21]},
        {"worker_connector.begin_step": [55, 0.110, 0.160], "scheduler.schedule": [55, 0.2, 0.2]},
    ]
    assert report.timed_waits(rounds) == (
        "waiting inside the timed parts per round, ms (median, wall less CPU): "
        "scheduler.schedule 0.0, worker_connector.begin_step 50.0"
    )
    assert report.timed_waits([{"scheduler.schedule": [55, 0.2]}]) is None  # CPU only: older


def test_the_keys_variants_reading_is_shown_beside_its_rounds() -> None:
    def run(config: str, keys_read: dict[str, Any] | None) -> dict[str, Any]:
        found = timed_round(config, "a")
        if keys_read is not None:
            found["keys_read"] = keys_read
        return found

    runs = [
        run("off", None),
        run("ours", None),
        run("ours+keys", {"seconds": 0.5, "bytes": 10**9, "read": 512}),
        run(
            "ours+keys",
            {
                "seconds": 0.3,
                "bytes": 10**9,
                "read": 511,
                "failed": 1,
                "first_error": "StoreError: gone",
            },
        ),
    ]
    runs[3]["seed"] = 1
    shown = report.summary(runs, ["off", "ours", "ours+keys"], ["prefill"])
    assert (
        "  ours+keys R3 read through the keys after each round (median): 0.400 s, 2.50 GB/s; "
        "handles not read 1 (first: StoreError: gone)"
    ) in shown
    assert "ours R3 read" not in shown  # only where the keys were read
    assert "R3 of ['ours', 'ours+keys'] identical" in shown  # its R3 is compared with ours'


def test_a_counter_is_asked_for_in_user_space_only() -> None:
    """``perf_event_attr`` as the kernel reads it: hardware type, its size, the event, and
    the exclude_kernel and exclude_hv flag bits (a VM's counters often refuse the kernel)."""
    attr = hw_counters._attr(hw_counters.EVENTS["instructions"])
    assert len(attr) == 64
    kind, size, config, _, _, _, flags = __import__("struct").unpack_from("IIQQQQQ", attr)
    assert (kind, size, config) == (0, 64, 1)
    assert flags == 0b110_0000  # bits 5 and 6 alone: counting starts enabled


def test_a_counter_reaches_the_kernel_and_counts_its_thread() -> None:
    """The syscall and the read, with the task clock (a software event every kernel has: this
    machine, like the GPU VM, exposes no hardware counters)."""
    kind, config = hw_counters.SOFTWARE_TASK_CLOCK
    fd = hw_counters._open(threading.get_native_id(), config, kind)
    try:
        before = int.from_bytes(os.read(fd, 8), "little")
        sum(i * i for i in range(300_000))
        after = int.from_bytes(os.read(fd, 8), "little")
        started = time.thread_time_ns()
        sum(i * i for i in range(300_000))
        loop_ns = time.thread_time_ns() - started
    finally:
        os.close(fd)
    assert 0.3 * loop_ns < after - before < 3 * loop_ns  # the same loop, counted on this thread


class _Connector:
    def __init__(self, tracker_pid: int | None, answered: int = 0) -> None:
        self.tracker_pid, self.steps_answered_here, self.store = tracker_pid, answered, None


class _Engine:
    """``collective_rpc`` over workers of these connectors (rank zero first)."""

    def __init__(self, *connectors: _Connector | None) -> None:
        self.workers = [
            type("W", (), {"model_runner": type("R", (), {"aux_output_connector": c})})
            for c in connectors
        ]

    def collective_rpc(self, fn: object) -> list[object]:
        return [fn(w) for w in self.workers]  # type: ignore[operator]


def test_a_tracker_process_rounds_count_the_steps_the_engine_answered_itself() -> None:
    # rank zero holds the tracker process; rank one's connector has neither it nor a store
    engine = _Engine(_Connector(tracker_pid=123, answered=251), _Connector(tracker_pid=None))
    assert worker.store_counts(engine) == {"steps_answered_here": 251}
    assert worker.store_counts(_Engine(None, _Connector(tracker_pid=None))) == {}
    rounds = [
        {"store": {"steps_answered_here": n}, "steps": [[0.1, 1]] * 267} for n in (240, 251, 250)
    ]
    assert analyze.answered_here(rounds) == (
        "steps answered by the engine itself (median over 3 rounds): 250 of 267 a round"
    )


def test_cores_split_whole_and_evenly_with_hyperthreads_kept_together() -> None:
    # 8 logical CPUs on 4 cores, hyperthread siblings n and n + 4 (as Linux numbers them)
    core = {cpu: (0, cpu % 4) for cpu in range(8)}.__getitem__
    halves = pinning.split_cores(range(8), 2, core)
    assert halves == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    # 5 cores three ways: one core each, the other two unused; too few cores is an error
    assert pinning.split_cores(range(5), 3, lambda c: (0, c)) == [{0}, {1}, {2}]
    with pytest.raises(ValueError, match="cannot be split"):
        pinning.split_cores(range(8), 3, lambda c: (0, c % 2))


def test_a_pinned_tree_takes_its_children_and_their_threads_along() -> None:
    import subprocess

    allowed = sorted(os.sched_getaffinity(0))
    grandchild = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start()"
    child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {grandchild!r}])"
    parent = subprocess.Popen([sys.executable, "-c", f"{child}; import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while len(pinning.process_tree([parent.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = pinning.process_tree([parent.pid])
        assert len(tree) == 2 and tree[0] == parent.pid
        child = tree[1]
        while len(os.listdir(f"/proc/{child}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pinning.pin_tree([parent.pid], {allowed[-1]}) >= 3
        for pid in tree:
            for task in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(task)) == {allowed[-1]}
        assert os.sched_getaffinity(0) == set(allowed)  # the caller is not in the tree
    finally:
        for pid in reversed(pinning.process_tree([parent.pid])):
            os.kill(pid, 9)
        parent.wait()


def test_the_gpu_timeline_splits_a_round_into_forwards_and_the_time_outside() -> None:
    # two steps, each a forward inside execute_model (recorded when it ends, before the call
    # around it); the second step's execute_model was queued 5 ms after the first's sampling
    # finished, and its forward 3 ms into it (the main thread's work before the forward)
    figures = gpu_timeline.timeline_figures(
        [
            ("forward", 1.0, 39.0),
            ("execute_model", 0.0, 40.0),
            ("sample_tokens", 40.0, 41.0),
            ("forward", 49.0, 85.5),
            ("execute_model", 46.0, 86.5),
            ("sample_tokens", 86.5, 87.0),
        ]
    )
    assert figures["calls"] == 4 and figures["forwards"] == 2
    assert figures["span_s"] == pytest.approx(0.087)
    assert figures["forward_s"] == pytest.approx(0.0745)
    assert figures["outside_forwards_s"] == pytest.approx(0.0125)
    assert figures["median_forward_ms"] == pytest.approx(37.25)
    assert figures["in_calls_s"] == pytest.approx(0.082)
    assert figures["idle_s"] == pytest.approx(0.005)
    assert figures["in_calls_s"] + figures["idle_s"] == pytest.approx(figures["span_s"])
    assert figures["in_calls_by_name_s"] == {"execute_model": 0.0805, "sample_tokens": 0.0015}
    # the span's ends from the origin, for placing it on the host's clock
    assert (figures["first_start_ms"], figures["last_end_ms"]) == (0.0, 87.0)
    assert figures["between_forwards_ms"] == [10.0]  # the second forward began at 49 ms
    assert figures["gaps_over_1ms"] == 1
    assert figures["longest_gaps_ms"] == [[5.0, "execute_model"]]
    assert gpu_timeline.timeline_figures([]) == {"calls": 0}
    assert gpu_timeline.timeline_figures([("forward", 0.0, 1.0)]) == {"calls": 0}


def test_without_cuda_the_gpu_timeline_says_so_and_installs_nothing() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.fail("this test is for the CPU machines the suite runs on")

    class Runner:
        def execute_model(self) -> str:
            return "stepped"

    class EngineWorker:
        model_runner = Runner()

    engine_worker = EngineWorker()
    assert gpu_timeline.gpu_timeline(engine_worker) == {"unavailable": "no CUDA device"}
    assert engine_worker.model_runner.execute_model() == "stepped"
    assert "execute_model" not in vars(engine_worker.model_runner)


def test_gpu_forwards_and_time_outside_pair_by_round_into_the_rounds_difference() -> None:
    def run(seconds: float, forward: float | None, outside: float, idle: float) -> dict[str, Any]:
        timeline = (
            {
                "calls": 4,
                "span_s": forward + outside,
                "forward_s": forward,
                "outside_forwards_s": outside,
                "idle_s": idle,
            }
            if forward is not None
            else {}
        )
        return {"seconds": seconds, "gpu_timeline": timeline}

    pairs = [  # (ours, off)
        (run(3.0, 2.6, 0.30, 0.10), run(2.9, 2.6, 0.20, 0.05)),
        (run(3.3, 2.8, 0.32, 0.12), run(3.0, 2.7, 0.22, 0.07)),  # 100 ms beyond the span
        (run(3.1, None, 0.0, 0.0), run(3.0, 2.7, 0.2, 0.05)),  # no timeline: left out
    ]
    split = pool.gpu_split(pairs)
    assert split == (
        "mean over rounds of the first less the second, ms: round +200.0, GPU in forwards "
        "+50.0, outside forwards +100.0 (nothing queued +50.0), outside the GPU's span +50.0, "
        "n=2"
    )
    assert pool.gpu_split(pairs[2:]) is None

    # anchored on the host's clock, the time outside the span splits into before and after
    def anchored(run: dict[str, Any], started: float, origin: float, last_ms: float) -> None:
        run["started_host_s"] = started
        run["gpu_timeline"].update(origin_host_s=origin, first_start_ms=0.0, last_end_ms=last_ms)

    anchored(pairs[0][0], 100.0, 100.05, 2900.0)  # 50 ms before, 50 after (3.0 s round)
    anchored(pairs[0][1], 200.0, 200.02, 2800.0)  # 20 before, 80 after (2.9 s)
    anchored(pairs[1][0], 300.0, 300.10, 3120.0)  # 100 before, 80 after (3.3 s)
    anchored(pairs[1][1], 400.0, 400.06, 2920.0)  # 60 before, 20 after (3.0 s)
    assert pool.gpu_split(pairs) == (
        "mean over rounds of the first less the second, ms: round +200.0, GPU in forwards "
        "+50.0, outside forwards +100.0 (nothing queued +50.0), outside the GPU's span +50.0 "
        "(before its first work +35.0, after its last +15.0), n=2"
    )
    assert math.isnan(pool.gpu_seconds(pairs[2][0], "forward_s"))
    assert pool.PARTS["GPU forward"](pairs[0][0]) == 2.6
    # each side's rounds ending after the GPU's last work: the median and the lagging ones
    lagging = run(3.5, 2.6, 0.30, 0.10)
    anchored(lagging, 500.0, 500.05, 3000.0)  # 450 ms after the GPU's last work
    ours = [pairs[0][0], pairs[1][0], lagging, pairs[2][0]]  # the last has no anchors
    assert pool.frontend_lag(ours) == (
        "median +80.0 ms; 1 of 3 rounds 100 ms or more behind, the longest 450 ms"
    )
    assert pool.frontend_lag([pairs[0][1], pairs[1][1]]) == (
        "median +50.0 ms; 0 of 2 rounds 100 ms or more behind"
    )
    assert pool.frontend_lag([pairs[2][0]]) is None
    pairs[2][0]["output_delays"] = [[0.003, 0.001]]  # no anchors: the waits alone
    assert pool.frontend_lag([pairs[2][0]]) == (
        "outputs waited for the frontend up to 3.0 ms a round and it took 0.001 s on them "
        "(medians, n=1)"
    )
    # with the frontend's steps recorded: how long outputs waited for it, and its processing
    pairs[0][1]["output_delays"] = [[0.002, 0.010], [0.030, 0.020], [float("nan"), 0.5]]
    pairs[1][1]["output_delays"] = [[0.001, 0.005], [0.004, 0.015]]
    assert pool.frontend_lag([pairs[0][1], pairs[1][1]]) == (
        "median +50.0 ms; 0 of 2 rounds 100 ms or more behind; outputs waited for the frontend "
        "up to 17.0 ms a round and it took 0.275 s on them (medians, n=2)"
    )
    timeline = {
        "calls": 4,
        "span_s": 1.0,
        "forward_s": 0.9,
        "outside_forwards_s": 0.1,
        "median_forward_ms": 40.0,
        "idle_s": 0.05,
        "gaps_over_1ms": 3,
        "idle_in_gaps_over_1ms_s": 0.04,
    }
    line = analyze.gpu_timeline_line([{"gpu_timeline": timeline}, {"gpu_timeline": {}}])
    assert line == (
        "span 1.000 s, in forwards 0.900 s (a forward 40.00 ms), outside forwards 100.0 ms, "
        "nothing queued 50.0 ms (3 gaps over 1 ms: 40.0 ms); n=1"
    )
    assert analyze.gpu_timeline_line([{"gpu_timeline": {"calls": 0}}]) is None


def test_by_step_pairs_rounds_of_the_common_step_count_and_names_the_largest_steps() -> None:
    def run(times: list[float], seconds: float) -> dict[str, Any]:
        return {"steps": [[t, 0] for t in times], "seconds": seconds}

    pairs = [  # (ours, off): ours' second step 40 ms longer, 1 ms more after the last
        (run([0.10, 0.25, 0.30], 0.311), run([0.10, 0.21, 0.26], 0.27)),
        (run([0.11, 0.26, 0.31], 0.321), run([0.11, 0.22, 0.27], 0.28)),
        (run([0.10, 0.20, 0.30, 0.40], 0.5), run([0.1, 0.2], 0.3)),  # step counts differ
        # equal, but not the common count
        (run([0.1, 0.2, 0.3, 0.4], 0.5), run([0.1, 0.2, 0.3, 0.4], 0.4)),
    ]
    differences = pool.step_differences(pairs)
    *steps, total, count = differences
    assert count == 2
    assert steps == pytest.approx([0.0, 40.0, 0.0, 1.0])
    assert total == pytest.approx(41.0)
    line = pool.by_step(differences, top=2)
    assert line == (
        "medians over 2 rounds of one step count, ms: the round +41.0, its steps' summed "
        "+41.0; largest: step 2 +40.0, after the last +1.0"
    )
    assert pool.step_differences(pairs[:1]) == []


def test_the_switch_variant_shortens_the_gil_switch_interval_and_says_from_what() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        said = worker.short_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert said == "switch interval 5 ms -> 0.5 ms"
    finally:
        sys.setswitchinterval(before)


def test_an_allocator_variant_starts_its_processes_with_the_recommended_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import driver

    # the settings docs/configuration.md recommends, and only for the variants' processes
    assert driver.ALLOCATOR_VARIANTS["thp"] == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert driver.ALLOCATOR_VARIANTS["keep"] == {
        "MALLOC_MMAP_THRESHOLD_": "33554432",
        "MALLOC_TRIM_THRESHOLD_": "1073741824",
    }
    for name in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    thp = driver.engine_env("ours+thp", "none")
    assert thp["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and "VLLM_PLUGINS" not in thp
    keep = driver.engine_env("off+keep", "none")
    assert keep["MALLOC_TRIM_THRESHOLD_"] == "1073741824" and keep["VLLM_PLUGINS"] == "none"
    assert "GLIBC_TUNABLES" not in driver.engine_env("ours", "none")  # others: as started
    assert worker.allocator_setting().startswith("allocator: glibc defaults; glibc ")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    said = worker.allocator_setting()
    assert said.startswith("allocator: GLIBC_TUNABLES=glibc.malloc.hugetlb=1; glibc ")
    assert "transparent huge pages " in said


def test_the_early_facts_variant_marks_each_step_as_one_without_a_forward() -> None:
    from types import SimpleNamespace

    import engine_hooks

    seen: list[bool | None] = []

    class Connector:
        _tracker = object()

        def begin_step(self, metadata: Any) -> None:
            seen.append(None if metadata is None else metadata.runs_forward)

    connector = Connector()
    worker_ = SimpleNamespace(model_runner=SimpleNamespace(aux_output_connector=connector))
    assert engine_hooks.early_facts(worker_).startswith("a step's facts applied in begin_step")
    connector.begin_step(SimpleNamespace(runs_forward=True))
    connector.begin_step(None)  # a step without metadata goes through as it is
    assert seen == [False, None]
    Connector._tracker = None  # type: ignore[assignment]
    assert engine_hooks.early_facts(worker_) == "no in-engine tracker on this rank"


def test_where_the_gpu_waited_more_between_forwards_is_named_by_forward() -> None:
    def run(gaps: list[float]) -> dict[str, Any]:
        return {"seconds": 1.0, "gpu_timeline": {"between_forwards_ms": gaps}}

    pairs = [  # (ours, off): ours waits 3 ms more before the third forward
        (run([1.0, 5.0, 1.0]), run([1.0, 2.0, 1.0])),
        (run([1.5, 4.0, 1.0]), run([1.0, 1.0, 1.0])),
        (run([1.0, 6.0, 2.0]), run([1.0, 3.0, 1.0])),
        (run([1.0, 1.0]), run([1.0, 1.0])),  # another forward count: left out
    ]
    differences = pool.forward_gap_differences(pairs)
    assert differences == [0.0, 3.0, 0.0, 3.5, 3]
    assert pool.gpu_by_step(differences, top=2) == (
        "the GPU's time between forwards, medians over 3 rounds of one forward count, ms: "
        "summed +3.5; largest: before forward 3 +3.00, before forward 2 +0.00"
    )
    assert pool.forward_gap_differences(pairs[:1]) == []  # one round says nothing
    assert pool.forward_gap_differences([({}, {})]) == []  # no timelines


def test_rounds_with_a_full_collection_in_the_frontend_are_counted_and_left_out() -> None:
    def run(tok_s: float, full_gc_s: float | None) -> dict[str, Any]:
        gc = {} if full_gc_s is None else {"frontend": {"gen2_n": 1, "gen2_s": full_gc_s}}
        return {"out_tok_s": tok_s, "gc": gc}

    pairs = [  # (ours, off)
        (run(99.0, None), run(100.0, None)),
        (run(80.0, 0.45), run(100.0, None)),  # ours' frontend ran a full collection
        (run(98.0, None), run(100.0, None)),
        (run(100.0, None), run(90.0, 0.5)),  # off's did
        (run(97.0, None), run(100.0, None)),
    ]
    line = pool.full_gc(pairs)
    assert line is not None
    assert line.startswith(
        "in 2 of 5 rounds: 1 rounds (0.45 s) on the first, 1 rounds (0.50 s) on the second; "
        "the other rounds 0.9800 (95% "
    )
    assert line.endswith("), n=3")
    assert pool.full_gc([pairs[0], pairs[2]]) is None  # none ran one
    assert pool.frontend_full_gc({"seconds": 1.0}) == 0.0  # no GC records


def test_a_runs_results_are_read_from_its_packed_tarball_when_the_folder_keeps_no_copy(
    tmp_path: Path,
) -> None:
    """Results folders keep ``perf.tgz`` alone: pool.py and analyze.py read the file inside."""
    import json
    import tarfile

    packed = tmp_path / "packing"
    packed.mkdir()
    (packed / "results.json").write_text(json.dumps({"results": [{"seed": 7}]}))
    folder = tmp_path / "run"
    folder.mkdir()
    with tarfile.open(folder / "perf.tgz", "w:gz") as tar:
        tar.add(packed / "results.json", arcname="./results.json")
    for given in (folder, folder / "results.json", folder / "perf.tgz"):
        assert analyze.load_results(given) == {"results": [{"seed": 7}]}
    (folder / "results.json").write_text(json.dumps({"results": []}))  # a copy, where kept, wins
    assert analyze.load_results(folder) == {"results": []}


def test_step_timers_count_a_parts_heavy_calls_apart_and_the_report_shows_them() -> None:
    """A part's CPU in calls of 1 ms or more: whether it is spent in a few steps or in all."""
    import engine_hooks

    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    entry: list[float] = [0, 0.0, 0.0, 0, 0.0]
    timed = engine_hooks.timed_calls(entry, busy)
    for seconds in (0.0001, 0.0001, 0.003, 0.0001):
        timed(seconds)
    assert entry[0] == 4 and entry[3] == 1
    assert 0.003 <= entry[4] < entry[1] and entry[1] < 0.0035 + 0.0003 + 0.002
    timers = [{"worker_connector.process_output": [267, 0.236, 0.24, 16, 0.150]}] * 3
    assert report.heavy_calls(timers) == (
        "CPU in calls of 1 ms or more per round, ms (median): "
        "worker_connector.process_output 150.0 in 16 of 267 calls"
    )
    assert report.heavy_calls([{"scheduler.schedule": [1, 0.1, 0.1]}]) is None  # older runs
