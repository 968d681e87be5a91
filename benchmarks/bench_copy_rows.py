"""What copying a GPU step's rows out of pinned memory costs the step thread.

The worker connector copies each GPU step's rows out of torch's pinned host buffer
(``PendingArtifactStep.take_rows`` with ``core.buffer.copy_rows``) so that the buffer is freed
on the step thread. This times that copy for a 256-request decode step and an 8,192-token
prefill step of DeepSeek-V3's R3 shape (58 layers, top-8), beside ``np.array`` and the
machine's floor (``np.copyto`` into a reused array). Best of 5 runs of ``--repeat`` copies;
the source stays in cache here, where on a GPU it was just written by DMA, so take these as
lower bounds.

    python benchmarks/bench_copy_rows.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from vllm_artifact.core.buffer import copy_rows


def best_ms(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            run()
        times.append((time.perf_counter() - started) / repeat)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    for name, tokens in (("decode step, 256 requests", 256), ("prefill step", 8192)):
        rows = np.random.default_rng(0).integers(0, 256, (tokens, 58, 8), dtype=np.uint8)
        out = np.empty_like(rows)
        floor = best_ms(lambda: np.copyto(out, rows), args.repeat)  # noqa: B023
        ours = best_ms(lambda: copy_rows(rows), args.repeat)  # noqa: B023
        plain = best_ms(lambda: np.array(rows), args.repeat)  # noqa: B023
        print(
            f"{name} ({tokens} rows, {rows.nbytes / 1e6:.2f} MB): copy_rows {ours:.3f} ms, "
            f"np.array {plain:.3f} ms, floor {floor:.3f} ms ({rows.nbytes / floor / 1e6:.1f} "
            f"GB/s); copy_rows/floor {ours / floor:.2f}"
        )


if __name__ == "__main__":
    main()
