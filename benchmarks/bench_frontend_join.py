"""A batch's end in the frontend: R3 chunks concatenated when each request finishes (vLLM's way,
into a ``.npy`` file: ``concatenate_into_npy``) against chunks copied as they arrive
(``ArrivingRows``) and only the last one at the end, side by side.

A prefill-heavy round like the H200 benchmark's: 128 requests of 2,048 prompt rows, their
prompts arriving 16 per step (each step's rows in one fresh buffer, as the frontend receives
them), then each request's 15 held decode rows at its end; DeepSeek-V3's R3 shape (58 layers x
top-8, uint8). The results of the last two rounds are kept alive (a user holds them), so fresh
memory is faulted in as in a real frontend. Prints medians over rounds of the arrival phase and
the end phase (the end phase is the one the engine waits for), the page faults of the end
phase, the ratio of the end phases, and a numpy copy of the round's R3 as the machine's floor.

Run: ``.venv/bin/python benchmarks/bench_frontend_join.py [--rounds R] [--requests N]`` (~10 s)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import numpy as np
from copy_floor import copy_floor_seconds

from vllm_artifact.core.npy import concatenate_into_npy
from vllm_artifact.core.row_assembly import ArrivingRows

LAYERS, TOP_K, PROMPT, DECODE, PER_STEP = 58, 8, 2048, 15, 16


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _round(arriving: bool, requests: int, kept: list[Any]) -> tuple[float, float, int, int]:
    rng = np.random.default_rng(0)
    chunk_lists: list[Any] = [
        ArrivingRows(PROMPT + DECODE + 1) if arriving else [] for _ in range(requests)
    ]
    arrival_faults = _faults()
    started = time.perf_counter()
    for first in range(0, requests, PER_STEP):  # a prefill step's rows, one fresh buffer
        count = min(PER_STEP, requests - first)
        step = np.frombuffer(bytearray(count * PROMPT * LAYERS * TOP_K), np.uint8)
        step = step.reshape(count, PROMPT, LAYERS, TOP_K)
        for i in range(count):
            chunk_lists[first + i].append(step[i])
    arrival = time.perf_counter() - started
    arrival_faults = _faults() - arrival_faults
    held = rng.integers(0, 256, (requests, DECODE, LAYERS, TOP_K), np.uint8)
    faults = _faults()
    started = time.perf_counter()
    results: list[np.ndarray | None] = []
    for i, chunks in enumerate(chunk_lists):
        chunks.append(held[i])
        joined = chunks.joined() if arriving else None
        results.append(joined if joined is not None else concatenate_into_npy(chunks))
    end = time.perf_counter() - started
    faults = _faults() - faults
    if any(r is None or len(r) != PROMPT + DECODE for r in results):
        raise SystemExit("wrong row count")
    kept.append(results)
    del kept[:-2]
    return arrival, end, arrival_faults, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=128)
    args = parser.parse_args()
    samples: dict[str, list[tuple[float, float, int, int]]] = {"at the end": [], "on arrival": []}
    kept: dict[str, list[Any]] = {name: [] for name in samples}
    for _ in range(args.rounds):  # alternating: drift hits both alike
        for name in samples:
            samples[name].append(_round(name == "on arrival", args.requests, kept[name]))
    rows = args.requests * (PROMPT + DECODE)
    print(
        f"{args.requests} requests x ({PROMPT} prompt rows, {PER_STEP} per step, + {DECODE} "
        f"held rows at the end), {LAYERS}x{TOP_K} uint8; medians over {args.rounds} rounds"
    )
    medians = {}
    for name, runs in samples.items():
        arrival, end, arrival_faults, faults = (
            statistics.median(run[i] for run in runs) for i in range(4)
        )
        medians[name] = end
        print(
            f"  joined {name:10}  arrival phase {arrival * 1e3:6.1f} ms ({arrival_faults:6.0f} "
            f"page faults)   end phase {end * 1e3:6.1f} ms ({faults:6.0f} page faults)"
        )
    print(
        f"  end phase, on arrival / at the end: {medians['on arrival'] / medians['at the end']:.3f}"
    )
    floor = copy_floor_seconds((rows, LAYERS, TOP_K), repetitions=5)
    print(
        f"  floor: numpy copy of the round's R3 ({rows * LAYERS * TOP_K / 1e6:.1f} MB): "
        f"{floor * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
