"""A decode step's cost to the engine with ``--artifact-tracker process``: waiting for the
tracker process's answer against answering a steady-decode step itself.

Drives a real tracker process (``integration/tracker_process.py``) the way the worker connector
does on a CUDA-graph decode step, whose rows land only when its answer is asked for: the step's
facts, its start, then its rows and its answer at once. 256 requests decode one token a step,
DeepSeek-V3's R3 (58 layers x top-8, uint8). Two configurations in alternate rounds on the same
process: the engine answering steps of steady-decode requests itself (``core/local_decode.py``,
the code as it is) and every step's answer waited for (the same with the engine's answers
turned off). ``--gap-ms`` sleeps after each step as a GPU step leaves the tracker process time
to catch up. Prints, per configuration, the median and p90 of the call's wall time and of the
calling thread's CPU time, and the machine's floor (a numpy copy of 14.5 MiB).

Run: ``.venv/bin/python benchmarks/bench_tracker_decode.py [--steps 200] [--rounds 4]
[--gap-ms 20]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from copy_floor import copy_floor_seconds

from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION
from vllm_artifact.core.local_decode import LocalDecode
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_facts import StepFacts
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.output_side import OutputSetup
from vllm_artifact.integration.tracker_process import TrackerProcess

LAYOUT = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
REQUESTS = 256


class DecodeStep:
    """One decode step of every request, its rows in host memory (as the worker connector's
    ``PendingArtifactStep`` once its copy landed)."""

    def __init__(self, seq: int, request_ids: list[str], token: int, rows: np.ndarray) -> None:
        self.seq, self.request_ids, self.token = seq, request_ids, token
        self.rows: np.ndarray | None = rows
        self.error: Exception | None = None

    def copied(self, wait: bool = False) -> bool:
        return True

    def columns(self, rows: np.ndarray) -> dict[str, Any]:
        n = len(self.request_ids)
        return dict(
            request_ids=self.request_ids,
            token_starts=np.full(n, self.token),
            num_scheduled=np.ones(n, np.int64),
            row_starts=np.arange(n),
            row_ends=np.arange(n) + 1,
            sampled=np.ones(n, bool),
        )


def run_round(
    process: TrackerProcess, ids: list[str], first: int, steps: int, seq: int, gap_s: float
) -> tuple[list[float], list[float]]:
    """``steps`` decode steps from token ``first``: wall and CPU ms of each answer."""
    rng = np.random.default_rng(first)
    walls, cpus = [], []
    for k in range(steps):
        process.begin(StepFacts(weight_version=DEFAULT_WEIGHT_VERSION, generation=0))
        process.step_started(ids)
        rows = rng.integers(0, 256, (len(ids), *LAYOUT.row_shape), dtype=np.uint8)
        step = DecodeStep(seq + k, ids, first + k, rows)
        process.queue_step(step)
        c0, t0 = time.thread_time(), time.perf_counter()
        process.step_result(step)
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.thread_time() - c0) * 1e3)
        if gap_s:
            time.sleep(gap_s)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per configuration")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="sleep after each step")
    args = parser.parse_args()
    root = Path(f"/dev/shm/vllm-artifact-bench-{os.getpid()}")
    root.mkdir(mode=0o700)
    setup = OutputSetup(
        config=ArtifactConfig(enabled=True, root=root, capacity=1 << 30, tracker="process"),
        family="bench-dp",
        dp_rank=0,
        layout=LAYOUT,
        model_id="bench",
        capacity=1 << 30,
        kv_hash_blocks=1 << 14,
        buffer_max_bytes=256 << 20,
    )
    process = TrackerProcess(setup, max_rows=8192)
    own_answer = LocalDecode.answer
    try:
        ids = [f"r{i}" for i in range(REQUESTS)]
        process.begin(
            StepFacts(
                weight_version=DEFAULT_WEIGHT_VERSION,
                generation=0,
                admitted=dict.fromkeys(ids, 0),
            )
        )
        # the first step (every request's first row) is the process's: it has them in steady
        # decode from then on
        token, seq = 0, 0
        results: dict[str, tuple[list[float], list[float]]] = {
            "answered here": ([], []),
            "waited for": ([], []),
        }
        for _ in range(args.rounds):
            for name in results:
                LocalDecode.answer = own_answer if name == "answered here" else _never  # type: ignore[method-assign]
                walls, cpus = run_round(process, ids, token, args.steps, seq, args.gap_ms / 1e3)
                token, seq = token + args.steps, seq + args.steps
                results[name][0].extend(walls[5:])  # the first steps of a round warm it up
                results[name][1].extend(cpus[5:])
        LocalDecode.answer = own_answer  # type: ignore[method-assign]
        floor = copy_floor_seconds((32768, *LAYOUT.row_shape)) * 1e3  # as the other benches
        print(
            f"{REQUESTS} requests decoding, R3 58x8 uint8, {args.rounds} rounds of {args.steps} "
            f"steps each, alternately; {args.gap_ms:g} ms after each step; "
            f"{process.answered_here} steps answered by the engine"
        )
        for name, (walls, cpus) in results.items():
            print(
                f"  {name:13s} wall median {statistics.median(walls):.3f} ms "
                f"(p90 {np.percentile(walls, 90):.3f}), CPU median {statistics.median(cpus):.3f} "
                f"ms (p90 {np.percentile(cpus, 90):.3f})"
            )
        print(f"  floor: numpy copy of 14.5 MiB (a 32K-token request's R3) median {floor:.2f} ms")
    finally:
        LocalDecode.answer = own_answer  # type: ignore[method-assign]
        process.close()
        shutil.rmtree(root, ignore_errors=True)


def _never(self: LocalDecode, step: Any) -> None:
    """The engine's answers turned off: every step waits for the process."""
    return None


if __name__ == "__main__":
    main()
