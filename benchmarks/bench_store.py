"""Publish and materialize one 32K-token DeepSeek-V3-sized R3 sample.

Compares the /dev/shm ShmStore (checksums written on publish and verified on
every read) with (a) a plain numpy copy of the same 14.5 MiB and (b) vLLM
0.32's own in-process store (``BlockObjectStore`` with its
``publish_routed_experts`` / ``materialize_routed_experts`` helpers), on the
same data in the same run, for 16- and 64-token blocks.

Targets (docs/store.md): materialize <= 4x the plain copy, publish <= 8x, and
both <= 2x vLLM's in-process store.

Run: ``.venv/bin/python benchmarks/bench_store.py [--reps N] [--tokens T]``
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import time
from collections.abc import Callable

import numpy as np

from vllm_artifact.core import Namespace, R3Layout, RequestCoverage, full_block_keys, materialize
from vllm_artifact.core.store import ShmStore


def timed(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> tuple[float, float]:
    """(min, median) wall time in seconds over ``reps`` runs (setup untimed)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def row(name: str, t: tuple[float, float], nbytes: int, copy: float, vllm: float | None) -> str:
    lo, med = t
    rel_v = f"{lo / vllm:5.2f}x" if vllm else "    - "
    return (
        f"  {name:<34} {lo * 1e3:7.2f} ms (median {med * 1e3:7.2f})  "
        f"{nbytes / lo / 1e9:6.2f} GB/s  {lo / copy:5.2f}x copy  {rel_v} vLLM"
    )


def bench(block_size: int, tokens: int, reps: int, root: str) -> None:
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=block_size)
    ns = Namespace("deepseek-ai/DeepSeek-V3", layout, "bench")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(tokens, 58, 8), dtype=np.uint8)
    nbytes = data.nbytes
    n_blocks = tokens // block_size
    print(
        f"\n{tokens} tokens x 58 layers x top-8 uint8 = {nbytes / 2**20:.1f} MiB, "
        f"block {block_size} -> {n_blocks} objects"
    )

    # (a) plain numpy copies of the same bytes.
    out = np.empty_like(data)
    copy_into = timed(lambda: np.copyto(out, data), reps)
    copy_new = timed(lambda: data.copy(), reps)
    copy = copy_into[0]

    # (b) vLLM 0.32's in-process store, through its own publish/materialize helpers.
    from vllm.distributed.aux_output_connector.routed_experts import (
        materialize_routed_experts,
        publish_routed_experts,
    )
    from vllm.distributed.aux_output_connector.store import BlockObjectStore

    vstore = BlockObjectStore(max_bytes=(reps + 3) * nbytes, object_nbytes=layout.block_nbytes)
    counter = iter(range(10**9))
    vkeys: list[str] = []

    def v_setup() -> None:
        r = next(counter)
        vkeys[:] = [f"r{r}-b{i}" for i in range(n_blocks)]

    def v_publish() -> None:
        blocks = [
            (i * block_size, data[i * block_size : (i + 1) * block_size]) for i in range(n_blocks)
        ]
        publish_routed_experts(vstore, batches=[(vkeys, blocks)], block_size=block_size)

    v_pub = timed(v_publish, reps, v_setup)

    def v_mat() -> np.ndarray:
        return materialize_routed_experts(
            vstore, vkeys, shape_per_token=(58, 8), dtype=np.dtype(np.uint8)
        )

    assert np.array_equal(v_mat(), data)
    v_get = timed(v_mat, reps)
    vstore.close()

    # Ours: /dev/shm arena, xxh3 checksums, seqlock publish, validated reads.
    store = ShmStore.create_or_open_writer(
        root,
        f"bench-{block_size}",
        layout=layout,
        capacity_bytes=(reps + 3) * (nbytes + (4 << 20)),
        collect_expired=False,
    )
    hashes: list[list[bytes]] = []
    keys_box: list = []

    def s_setup() -> None:
        r = next(counter)
        keys_box[:] = full_block_keys(ns, [f"{r}/{i}".encode() for i in range(n_blocks)])
        hashes.append([])

    s_pub = timed(lambda: store.put_blocks(keys_box, data, 0, pin=False), reps, s_setup)
    keys = list(keys_box)
    cov = RequestCoverage.plan(
        num_rows=tokens, block_size=block_size, full_block_keys=keys, tail_key=None
    )
    assert np.array_equal(materialize(store, cov), data)
    s_into = timed(lambda: materialize(store, cov, out=out), reps)
    s_new = timed(lambda: materialize(store, cov), reps)
    reader = ShmStore.open_reader(root, f"bench-{block_size}")
    assert np.array_equal(materialize(reader, cov), data)
    r_new = timed(lambda: materialize(reader, cov), reps)
    reader.close()
    store.close()

    vp, vg = v_pub[0], v_get[0]
    print(row("numpy copy into preallocated", copy_into, nbytes, copy, None))
    print(row("numpy copy (new array)", copy_new, nbytes, copy, None))
    print(row("vLLM BlockObjectStore publish", v_pub, nbytes, copy, vp))
    print(row("vLLM BlockObjectStore materialize", v_get, nbytes, copy, vg))
    print(row("ShmStore publish (put_blocks)", s_pub, nbytes, copy, vp))
    print(row("ShmStore materialize (into out)", s_into, nbytes, copy, vg))
    print(row("ShmStore materialize (new array)", s_new, nbytes, copy, vg))
    print(row("ShmStore materialize (reader)", r_new, nbytes, copy, vg))
    ok_mat = s_new[0] <= 4 * copy_new[0] and s_new[0] <= 2 * vg
    ok_pub = s_pub[0] <= 8 * copy and s_pub[0] <= 2 * vp
    print(
        f"  targets: materialize <= 4x copy and <= 2x vLLM: {'PASS' if ok_mat else 'MISS'}; "
        f"publish <= 8x copy and <= 2x vLLM: {'PASS' if ok_pub else 'MISS'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=32768)
    args = ap.parse_args()
    root = f"/dev/shm/vllm-artifact-bench-{os.getpid()}-{secrets.token_hex(3)}"
    print(
        f"min of {args.reps} runs (median in parentheses); load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    try:
        for bs in (16, 64):
            bench(bs, args.tokens, args.reps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
