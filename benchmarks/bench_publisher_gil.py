"""What our publisher thread costs the thread that launches an engine step, beyond its own CPU.

On a one-GPU engine one thread schedules and launches every kernel of a step; each torch call
releases the GIL and takes it back. Our publisher thread (``core/publisher.py``) writes the
step's completed blocks to the store at the same time, holding the GIL for parts of it. If the
GIL's hand-over amplified that (the launching thread waiting up to the interpreter's switch
interval each time it wants the GIL back), the step would lose more than the publisher's CPU.

The step thread here makes ``--launches`` tiny torch calls (an eager prefill step of the H200
benchmark makes about 7,000 launches), once alone and once while the publisher writes one
prefill step's blocks (``--blocks`` blocks of 16 tokens, DeepSeek-V3's R3 shape, 32 requests),
in alternating order over ``--rounds`` rounds. Prints medians: the step thread's wall time
alone and with publication, its loss, the publisher thread's CPU for the same blocks, their
ratio (about 1: no amplification), and a numpy copy of the blocks' rows as the machine's floor.

Run: ``.venv/bin/python benchmarks/bench_publisher_gil.py [--rounds R]`` (~15 s)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
from copy_floor import copy_floor_seconds

from vllm_artifact.core.keys import Namespace, full_block_keys
from vllm_artifact.core.publisher import BlockRun, Publisher
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store import ShmStore

LAYOUT = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
REQUESTS = 32


class StepBlocks:
    """Fresh blocks for each step (new keys, random rows), made before the step is timed."""

    def __init__(self, blocks: int) -> None:
        self.per_request = max(1, blocks // REQUESTS)
        self.namespace = Namespace("bench-publisher-gil", LAYOUT, "v1")
        self.rng = np.random.default_rng(0)
        self.next_hash = 0

    def runs(self) -> list[BlockRun]:
        runs = []
        bs = LAYOUT.block_size
        for _ in range(REQUESTS):
            first, self.next_hash = self.next_hash, self.next_hash + self.per_request
            hashes = [(first + i).to_bytes(16, "little") for i in range(self.per_request)]
            shape = (self.per_request * bs, LAYOUT.num_layers, LAYOUT.top_k)
            rows = self.rng.integers(0, 256, size=shape, dtype=np.uint8)
            runs.append(BlockRun(full_block_keys(self.namespace, hashes), rows, 0))
        return runs


def launch_step(launches: int, a: torch.Tensor, b: torch.Tensor) -> float:
    """Wall seconds of ``launches`` tiny torch calls (each releases and retakes the GIL)."""
    started = time.perf_counter()
    for _ in range(launches):
        torch.add(a, b)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--launches", type=int, default=7000)
    parser.add_argument("--blocks", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    a, b = torch.ones(4), torch.ones(4)
    root = tempfile.mkdtemp(prefix="bench-publisher-gil-", dir="/dev/shm")
    os.chmod(root, 0o700)
    try:
        store = ShmStore.create_or_open_writer(root, "bench", layout=LAYOUT, capacity_bytes=1 << 30)
        publisher = Publisher(store)
        publisher_clock = time.pthread_getcpuclockid(publisher._thread.ident or 0)
        blocks = StepBlocks(args.blocks)
        alone, shared, publisher_cpu = [], [], []
        launch_step(args.launches, a, b)  # warm
        for rnd in range(args.rounds):
            for with_publication in (rnd % 2 == 0, rnd % 2 == 1):
                if not with_publication:
                    alone.append(launch_step(args.launches, a, b))
                    continue
                runs = blocks.runs()
                cpu_before = time.clock_gettime(publisher_clock)
                publisher.submit(runs)
                shared.append(launch_step(args.launches, a, b))
                publisher.flush()
                publisher_cpu.append(time.clock_gettime(publisher_clock) - cpu_before)
        publisher.close()
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = 1e3
    alone_s, shared_s = statistics.median(alone), statistics.median(shared)
    loss = statistics.median(s - a for s, a in zip(shared, alone, strict=True))
    cpu = statistics.median(publisher_cpu)
    shape = (args.blocks * LAYOUT.block_size, LAYOUT.num_layers, LAYOUT.top_k)
    floor = copy_floor_seconds(shape)
    print(
        f"step thread, {args.launches} launches: alone {alone_s * ms:.1f} ms, while the "
        f"publisher writes {args.blocks} blocks {shared_s * ms:.1f} ms; "
        f"loss {loss * ms:.2f} ms (paired median)"
    )
    print(f"publisher thread CPU for those blocks: {cpu * ms:.2f} ms")
    print(f"loss / publisher CPU: {loss / cpu:.2f} (1 = no amplification by the GIL hand-over)")
    megabytes = int(np.prod(shape)) / 1e6
    print(f"floor: numpy copy of the blocks' rows ({megabytes:.1f} MB): {floor * ms:.2f} ms")


if __name__ == "__main__":
    main()
