"""Publish and materialize one 32K-token DeepSeek-V3-sized R3 sample.

Compares the /dev/shm ShmStore (checksums written on publish and verified on
every read) with (a) a plain numpy copy of the same 14.5 MiB and (b) vLLM
0.32's own in-process store (``BlockObjectStore`` with its
``publish_routed_experts`` / ``materialize_routed_experts`` helpers), on the
same data in the same run, for 16- and 64-token blocks.

Targets (docs/store.md): materialize <= 4x the plain copy, publish <= 8x, and
both <= 2x vLLM's in-process store.

The scale line compares put + get of one request in a small store with the
same in a full 1.5 GiB store (~200k objects; ``--scale-gib``) and times the
full store's reopen (crash recovery).

Run: ``.venv/bin/python benchmarks/bench_store.py [--reps N] [--tokens T] [--scale-gib G]``
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

from vllm_artifact.core import Namespace, R3Layout, full_block_keys
from vllm_artifact.core.store import ShmStore


class Rounds:
    """Time several operations round-robin: each round runs every operation
    once, so load from other processes hits all of them alike (a loaded
    2-core machine otherwise skews whichever ran during a busy second)."""

    def __init__(self) -> None:
        self.ops: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {}
        self.times: dict[str, list[float]] = {}

    def add(
        self, name: str, fn: Callable[[], object], setup: Callable[[], object] | None = None
    ) -> None:
        self.ops[name] = (fn, setup)
        self.times[name] = []

    def run(self, reps: int) -> None:
        for _ in range(reps):
            for name, (fn, setup) in self.ops.items():
                if setup is not None:
                    setup()
                t0 = time.perf_counter()
                fn()
                self.times[name].append(time.perf_counter() - t0)

    def __getitem__(self, name: str) -> tuple[float, float]:
        """(min, median) wall time in seconds."""
        t = self.times[name]
        return min(t), statistics.median(t)


def read_rows(store: ShmStore, keys: list, num_rows: int) -> np.ndarray:
    """A request's rows into a new array, every object verified (what a reader does)."""
    out = store.layout.empty(num_rows)
    store.read_into(keys, out, token_start=0)
    return out


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

    rounds = Rounds()
    # (a) plain numpy copies of the same bytes.
    out = np.empty_like(data)
    rounds.add("copy_into", lambda: np.copyto(out, data))
    rounds.add("copy_new", lambda: data.copy())

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

    v_setup()
    v_publish()
    v_read_keys = list(vkeys)

    def v_mat() -> np.ndarray:
        return materialize_routed_experts(
            vstore, v_read_keys, shape_per_token=(58, 8), dtype=np.dtype(np.uint8)
        )

    assert np.array_equal(v_mat(), data)
    rounds.add("v_pub", v_publish, v_setup)
    rounds.add("v_get", v_mat)

    # Ours: /dev/shm arena, xxh3 checksums, seqlock publish, validated reads.
    store = ShmStore.create_or_open_writer(
        root,
        f"bench-{block_size}",
        layout=layout,
        capacity_bytes=(reps + 3) * (nbytes + (4 << 20)),
        collect_expired=False,
    )
    keys_box: list = []

    def s_setup() -> None:
        r = next(counter)
        keys_box[:] = full_block_keys(ns, [f"{r}/{i}".encode() for i in range(n_blocks)])

    s_setup()
    store.put_blocks(keys_box, data, 0, pin=False)
    keys = list(keys_box)
    assert np.array_equal(read_rows(store, keys, tokens), data)
    reader = ShmStore.open_reader(root, f"bench-{block_size}")
    assert np.array_equal(read_rows(reader, keys, tokens), data)
    rounds.add("s_pub", lambda: store.put_blocks(keys_box, data, 0, pin=False), s_setup)
    rounds.add("s_into", lambda: store.read_into(keys, out, token_start=0))
    rounds.add("s_new", lambda: read_rows(store, keys, tokens))
    rounds.add("r_new", lambda: read_rows(reader, keys, tokens))
    rounds.run(reps)
    reader.close()
    store.close()
    vstore.close()

    copy_into, copy_new = rounds["copy_into"], rounds["copy_new"]
    v_pub, v_get = rounds["v_pub"], rounds["v_get"]
    s_pub, s_into, s_new, r_new = (
        rounds["s_pub"],
        rounds["s_into"],
        rounds["s_new"],
        rounds["r_new"],
    )
    copy = copy_into[0]
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


def scale(tokens: int, reps: int, root: str, gib: float) -> None:
    """Put + get of one request in a small store vs a full big one, and the big one's reopen
    (crash recovery) time: neither may grow with the objects stored (docs/store.md, "Scale")."""
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
    ns = Namespace("deepseek-ai/DeepSeek-V3", layout, "bench-scale")
    data = np.random.default_rng(1).integers(0, 256, size=(tokens, 58, 8), dtype=np.uint8)
    n_blocks = tokens // layout.block_size
    out = np.empty_like(data)
    small = ShmStore.create_or_open_writer(
        root, "scale-small", layout=layout, capacity_bytes=3 * data.nbytes, collect_expired=False
    )
    big = ShmStore.create_or_open_writer(
        root, "scale-big", layout=layout, capacity_bytes=int(gib * 2**30), collect_expired=False
    )
    counter = iter(range(10**9))

    def new_keys() -> list:
        r = next(counter)
        return full_block_keys(ns, [f"s{r}/{i}".encode() for i in range(n_blocks)])

    t0 = time.perf_counter()
    slots = big.stats().capacity_objects
    while big.stats().objects < slots:  # fill (pin=False: later puts evict, CLOCK)
        big.put_blocks(new_keys(), data, 0, pin=False)
    fill = time.perf_counter() - t0
    for _ in range(3):  # steady state: the small store evicts too
        small.put_blocks(new_keys(), data, 0, pin=False)
    rounds = Rounds()
    for name, st in (("small", small), ("big", big)):
        box: list = []

        def keys(box: list = box) -> None:
            box[:] = new_keys()

        def put(st: ShmStore = st, box: list = box) -> None:
            st.put_blocks(box, data, 0, pin=False)

        def get(st: ShmStore = st, box: list = box) -> None:
            st.read_into(box, out)

        rounds.add(f"{name} put", put, keys)
        rounds.add(f"{name} get", get)
    rounds.run(reps)
    n_small, n_big = small.stats().objects, big.stats().objects
    small.close()
    big.close()
    reopen = []
    for _ in range(3):
        t0 = time.perf_counter()
        again = ShmStore.create_or_open_writer(
            root, "scale-big", layout=layout, capacity_bytes=int(gib * 2**30), collect_expired=False
        )
        reopen.append(time.perf_counter() - t0)
        assert again.recovery is not None and again.recovery.objects == n_big
        again.close()
    print(
        f"\nscale: one {tokens}-token request (block 16, {n_blocks} objects) put_blocks + "
        f"read_into; small store {n_small} objects vs full {gib:g} GiB store {n_big} objects "
        f"(filled in {fill:.1f} s); puts evict (CLOCK) in both"
    )
    for op in ("put", "get"):
        a, b = rounds[f"small {op}"], rounds[f"big {op}"]
        print(
            f"  {op:<4} small {a[0] * 1e3:7.2f} ms (median {a[1] * 1e3:7.2f})   "
            f"full {b[0] * 1e3:7.2f} ms (median {b[1] * 1e3:7.2f})   full/small {b[0] / a[0]:5.2f}x"
        )
    print(
        f"  reopen (recovery: scan envelopes, rebuild index) of the full store: "
        f"min {min(reopen) * 1e3:.0f} ms, median {statistics.median(reopen) * 1e3:.0f} ms "
        f"({n_big} objects)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--scale-gib", type=float, default=1.5, help="big store for the scale line")
    args = ap.parse_args()
    root = f"/dev/shm/vllm-artifact-bench-{os.getpid()}-{secrets.token_hex(3)}"
    print(
        f"min of {args.reps} runs (median in parentheses); load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    try:
        for bs in (16, 64):
            bench(bs, args.tokens, args.reps, root)
        if args.scale_gib > 0:
            scale(args.tokens, args.reps, root, args.scale_gib)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
