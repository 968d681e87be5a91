"""What copying a GPU step's rows out of pinned memory costs the step thread.

The worker connector copies each GPU step's rows out of torch's pinned host buffer
(``PendingArtifactStep.take_rows`` with ``core.buffer.copy_rows``) so that the buffer is freed
on the step thread. This times that copy for a 256-request decode step and an 8,192-token
prefill step of DeepSeek-V3's R3 shape (58 layers, top-8), beside the machine's floor (a plain
numpy copy of the same size into a new array, ``copy_floor.py``). Medians of ``--repeat``
single copies; the source stays in cache here, where on a GPU it was just written by DMA, so
take these as lower bounds.

    python benchmarks/bench_copy_rows.py [--repeat 200]
"""

from __future__ import annotations

import argparse

import numpy as np
from copy_floor import copy_floor_seconds, median_seconds

from vllm_artifact.core.buffer import copy_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    for name, tokens in (("decode step, 256 requests", 256), ("prefill step", 8192)):
        shape = (tokens, 58, 8)
        rows = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        ours = median_seconds(lambda: copy_rows(rows), args.repeat) * 1e3  # noqa: B023
        floor = copy_floor_seconds(shape, args.repeat) * 1e3
        print(
            f"{name} ({tokens} rows, {rows.nbytes / 1e6:.2f} MB): copy_rows {ours:.3f} ms, "
            f"floor {floor:.3f} ms ({rows.nbytes / floor / 1e6:.1f} GB/s); "
            f"copy_rows/floor {ours / floor:.2f}"
        )


if __name__ == "__main__":
    main()
