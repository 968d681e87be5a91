"""The machine's floor beside the perf figures: a plain numpy copy of one decode round's R3.

The decode workload returns 256 requests x 512 rows x 58 layers x 8 experts as uint8 (about
61 MB); this copies that many bytes into a preallocated array and prints the median GB/s and
seconds of 20 copies, so absolute tokens/s can be read against the machine's memory speed.
"""

import statistics
import time

import numpy as np


def main() -> None:
    data = np.random.default_rng(0).integers(0, 256, size=(256 * 512, 58, 8), dtype=np.uint8)
    out = np.empty_like(data)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        np.copyto(out, data)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(
        f"floor: numpy copy of {data.nbytes / 1e6:.1f} MB (one decode round's R3) "
        f"median {median * 1e3:.2f} ms, {data.nbytes / median / 1e9:.2f} GB/s (n=20)"
    )


if __name__ == "__main__":
    main()
