"""The decode engine of a prefill/decode pair: R3 of a 32K-token prompt the producer computed.

In a PD pair on one node the decode (consumer) engine gets the prompt's KV from the prefill
(producer) engine through a KV connector; the R3 of those tokens is in the producer's /dev/shm
store. The consumer's rank zero reads it through ``NodeStores`` (its own store first, then the
other stores of its family under the same root, key by key) and adopts it: the blocks are
published into its own store by its background publisher and pinned for its KV blocks.

Timed side by side, interleaved per repetition (own, producer, floor, own, producer, ...), on a
DeepSeek-V3-sized prompt (58 layers x top-8, uint8, 16-token blocks): the consumer's
``RequestTracker`` path of one request, ``admit`` + ``add_block_hashes`` + ``step_started`` +
``step_finished`` of its first step (the 32K-token hit plus a few computed prompt tokens):

* ``own``: the hit's blocks are already in the consumer's store (it computed the prompt
  itself earlier, so its key cache also knows their keys);
* ``producer``: the blocks are only in the producer's store (fresh block hashes every
  repetition, so every repetition reads from the producer): the read, with the adoption's
  submit to the publisher; ``+ flush`` adds waiting until the publisher has written and pinned
  the adopted blocks (off the step thread in an engine, but it competes for the GIL);
* ``floor``: a numpy copy of the hit's bytes into a new array.

Before each timed call a scratch buffer larger than the CPU's last-level cache is written
(``--evict-mib``), so none starts with the bytes it reads in a cache: the producer's prefill
writes, just before, the very blocks ``producer`` reads (on this 32 MiB-L3 machine that made
its store read some 15% faster than with the caches evicted).

Every repetition checks the emitted rows against the truth (and, for the producer's hit, that
every block was adopted and pinned). Ratios are taken per repetition (both sides met the same
seconds of the machine), with quartiles and the geometric mean's 95% interval.

Run: ``.venv/bin/python benchmarks/bench_pd_read.py [--reps N] [--tokens T] [--json FILE]``
(``--evict-mib 0``: no cache eviction).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from e2e_stats import quartiles, ratio_table

from vllm_artifact.contract import EmittedRows
from vllm_artifact.core import R3Layout, full_block_keys
from vllm_artifact.core.keys import DEFAULT_WEIGHT_VERSION
from vllm_artifact.core.publisher import Publisher
from vllm_artifact.core.step_batch import StepBatch
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.node_stores import NodeStores
from vllm_artifact.core.store.shm_arena import ArenaGeometry
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.integration.kv_events import eviction_id

MODEL = "deepseek-ai/DeepSeek-V3"
#: The stores of one model and layout share this prefix: the producer writes ``…-dp0``, the
#: consumer (the second engine of that model and DP rank on the root) ``…-dp0-2``.
FAMILY = "r3-bench0pdread-dp"
#: Prompt tokens after the hit that the consumer computes in the step (fewer than a block, so
#: the step completes no block of its own: only the adoption is published).
COMPUTED = 5
#: Timings per repetition, in seconds.
SERIES = ("own_keys", "own", "producer_keys", "producer", "producer_flush", "floor")


class Engine:
    """One engine's rank zero as the worker connector builds it: its store (the arena sized in
    slots), publisher, and tracker reading the node's stores."""

    def __init__(self, root: str, name: str, layout: R3Layout, slots: int, rows: int) -> None:
        capacity = ArenaGeometry(layout, slots).file_nbytes
        self.store = ShmStore.create_or_open_writer(
            root, name, layout=layout, capacity_bytes=capacity
        )
        self.store.record_weight_version(DEFAULT_WEIGHT_VERSION)
        self.publisher = Publisher(self.store)
        self.node = NodeStores(self.store, FAMILY)
        self.tracker = RequestTracker(
            layout,
            MODEL,
            self.store,
            self.publisher,
            buffer_max_bytes=2 * rows * layout.row_nbytes,
            block_id=eviction_id,
            node_stores=self.node,
        )

    def close(self) -> None:
        self.publisher.close()
        self.node.close()
        self.store.close()


def block_hashes(tag: str, n: int) -> list[bytes]:
    """KV-block-hash-like bytes (vLLM's are sha256 digests), distinct per tag."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def one_step(request_id: str, token_start: int, rows: np.ndarray) -> StepBatch:
    """A step of one request that computes ``rows`` from ``token_start`` and samples."""
    n = len(rows)
    return StepBatch(
        [request_id],
        np.array([token_start], dtype=np.int64),
        np.array([n], dtype=np.int64),
        np.array([0], dtype=np.int64),
        np.array([n], dtype=np.int64),
        np.array([True]),
        rows,
    )


def first_step(
    engine: Engine, request_id: str, hashes: list[bytes], cached: int, rows: np.ndarray
) -> tuple[EmittedRows, float, float]:
    """A request's first step as the worker drives it: the KV cache served ``cached`` tokens,
    the step computes ``rows``. Returns its rows and the seconds to the end of keying
    (``admit`` + ``add_block_hashes``) and of the step."""
    tracker = engine.tracker
    batch = one_step(request_id, cached, rows)
    t0 = time.perf_counter()
    tracker.admit(request_id, 0)
    tracker.add_block_hashes({request_id: hashes})
    t1 = time.perf_counter()
    tracker.step_started([request_id])
    result = tracker.step_finished(batch)
    t2 = time.perf_counter()
    entry = result.entries.get(request_id)
    if not isinstance(entry, EmittedRows):
        raise RuntimeError(f"request {request_id}: no rows but {entry!r}")
    return entry, t1 - t0, t2 - t0


def check(what: str, ok: bool) -> None:
    """Fail the run loudly (not an ``assert``: it must hold under ``python -O`` too)."""
    if not ok:
        raise RuntimeError(f"check failed: {what}")


class PdPair:
    """A producer and a consumer engine of one model on a private root, and the measurements.

    The consumer's store holds its own copy of one prompt (pinned, as its KV cache holds it)
    plus room for one adopted prompt: every adoption evicts the previous one, as in a full
    store. The producer's holds one prompt and evicts it for the next."""

    def __init__(
        self,
        root: str,
        layout: R3Layout,
        tokens: int,
        evict_bytes: int,
        stack: contextlib.ExitStack,
    ) -> None:
        self.layout = layout
        self.scratch = np.zeros(evict_bytes, dtype=np.uint8)
        self.hit = tokens
        self.n_blocks = tokens // layout.block_size
        prompt = tokens + COMPUTED
        self.base = np.random.default_rng(0).integers(
            0, layout.num_experts, size=(prompt, layout.num_layers, layout.top_k), dtype=np.uint8
        )
        slack = 16
        self.producer = Engine(root, f"{FAMILY}0", layout, self.n_blocks + slack, prompt)
        stack.callback(self.producer.close)
        self.consumer = Engine(root, f"{FAMILY}0-2", layout, 2 * self.n_blocks + slack, prompt)
        stack.callback(self.consumer.close)
        # The consumer computed the "own" prompt itself: its blocks are in its store, pinned.
        self.own_hashes = block_hashes("own", self.n_blocks)
        self.serve(self.consumer, "own-prefill", self.own_hashes, self.base)
        self.own_computed = np.ascontiguousarray(self.base[tokens:])
        self.floor_source = np.ascontiguousarray(self.base[:tokens])
        self.times: dict[str, list[float]] = {name: [] for name in SERIES}

    def evict_caches(self) -> None:
        """Write the scratch buffer: what a timed call reads is then in no CPU cache."""
        np.add(self.scratch, 1, out=self.scratch)

    def serve(self, engine: Engine, request_id: str, hashes: list[bytes], rows: np.ndarray) -> None:
        """Prefill a whole prompt in one step and finish it; wait until it is published."""
        tracker = engine.tracker
        tracker.admit(request_id, 0)
        tracker.add_block_hashes({request_id: hashes})
        tracker.step_started([request_id])
        tracker.step_finished(one_step(request_id, 0, rows))
        tracker.finish(request_id)
        engine.publisher.flush()
        check(f"{request_id} published", engine.publisher.failures == 0)

    def repetition(self, index: int, record: bool) -> None:
        """Own hit, producer hit (after the producer's prefill), floor: each checked."""
        consumer, producer, hit = self.consumer, self.producer, self.hit
        tracker = consumer.tracker
        # The producer's prefill of a fresh prompt (other rows, other block hashes).
        truth = self.base ^ np.uint8(index % 255 + 1)
        hashes = block_hashes(f"pd-{index}", self.n_blocks)
        self.serve(producer, f"prefill-{index}", hashes, truth)
        computed = np.ascontiguousarray(truth[hit:])

        # (a) own: the consumer's store serves the hit.
        reads, adopted = tracker.reads, tracker.adopted
        self.evict_caches()
        own, own_keys, own_step = first_step(
            consumer, f"own-{index}", self.own_hashes, hit, self.own_computed
        )
        check(f"own {index}: rows", own.token_start == 0 and np.array_equal(own.rows, self.base))
        check(
            f"own {index}: read from its own store",
            tracker.reads == reads + self.n_blocks and tracker.adopted == adopted,
        )
        tracker.finish(f"own-{index}")

        # (b) producer: read from the producer's store and adopted.
        reads, adopted = tracker.reads, tracker.adopted
        self.evict_caches()
        pd, pd_keys, pd_step = first_step(consumer, f"decode-{index}", hashes, hit, computed)
        t0 = time.perf_counter()
        consumer.publisher.flush()  # the adoption's writes, begun on the publisher's thread
        pd_flush = pd_step + time.perf_counter() - t0
        check(f"producer {index}: rows", pd.token_start == 0 and np.array_equal(pd.rows, truth))
        check(
            f"producer {index}: every block read from the producer and adopted",
            tracker.reads == reads + self.n_blocks and tracker.adopted == adopted + self.n_blocks,
        )
        keys = full_block_keys(tracker.namespace, hashes)
        stats = consumer.store.stats()
        check(
            f"producer {index}: adopted blocks in the consumer's store and pinned",
            consumer.publisher.failures == 0
            and all(consumer.store.exists(keys))
            and stats.pinned_objects == 2 * self.n_blocks,
        )
        tracker.finish(f"decode-{index}")
        # Both KV caches drop the prompt's blocks: their objects may be evicted for the next.
        ids = [eviction_id(h) for h in hashes]
        for engine in (consumer, producer):
            engine.tracker.kv_evicted(ids)
            engine.publisher.flush()

        # The floor: a new array with the hit's bytes.
        self.evict_caches()
        t0 = time.perf_counter()
        copy = self.floor_source.copy()
        floor = time.perf_counter() - t0
        check("floor copy", copy.nbytes == hit * self.layout.row_nbytes)

        if record:
            for name, value in zip(
                SERIES, (own_keys, own_step, pd_keys, pd_step, pd_flush, floor), strict=True
            ):
                self.times[name].append(value)


def report(times: dict[str, list[float]]) -> dict[str, Any]:
    """Print the table; return its figures for the JSON."""
    rows = (
        ("own store hit (admit .. step_finished)", "own"),
        ("  of which keying (admit + add_block_hashes)", "own_keys"),
        ("producer's store hit (read + adoption submit)", "producer"),
        ("  of which keying (admit + add_block_hashes)", "producer_keys"),
        ("producer's hit + publisher flush of the adoption", "producer_flush"),
        ("floor: numpy copy of the hit's bytes", "floor"),
    )
    summary: dict[str, Any] = {"ms": {}, "ratios": {}}
    print(f"\n  {'':<50} {'median':>8} {'q1':>8} {'q3':>8}  (ms)")
    for label, name in rows:
        med, q1, q3 = (v * 1e3 for v in quartiles(times[name]))
        summary["ms"][name] = {"median": med, "q1": q1, "q3": q3}
        print(f"  {label:<50} {med:8.2f} {q1:8.2f} {q3:8.2f}")
    pairs = [
        ("producer", "own", "producer / own"),
        ("producer_flush", "own", "(producer + flush) / own"),
        ("own", "floor", "own / floor"),
        ("producer", "floor", "producer / floor"),
    ]
    summary["ratios"] = ratio_table(times, pairs)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of the prefix hit")
    ap.add_argument("--block-size", type=int, default=16, help="KV / R3 block size")
    ap.add_argument(
        "--evict-mib",
        type=int,
        default=64,
        help="MiB written before each timed call to evict the CPU caches (0: none)",
    )
    ap.add_argument("--json", type=Path, help="write the measurements here")
    args = ap.parse_args()
    if args.tokens % args.block_size or args.tokens <= 0:
        ap.error("--tokens must be a positive multiple of --block-size")
    if args.reps < 1 or args.evict_mib < 0:
        ap.error("--reps must be at least 1 and --evict-mib at least 0")
    # SIGTERM unwinds like an error, so the private root is removed then too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=args.block_size)
    load = os.getloadavg()
    print(
        f"R3 of a PD pair's prompt on the decode engine: {args.tokens}-token hit + {COMPUTED} "
        f"computed tokens x 58 layers x top-8 uint8; the hit is "
        f"{args.tokens * layout.row_nbytes / 2**20:.1f} MiB in {args.tokens // args.block_size} "
        f"objects of {args.block_size} tokens\n"
        f"{args.reps} repetitions (+1 warm-up), interleaved; {args.evict_mib} MiB written "
        f"before each timed call; load average {load[0]:.2f} on {os.cpu_count()} CPUs"
    )
    root = tempfile.mkdtemp(prefix="vllm-artifact-bench-pd-read-", dir="/dev/shm")  # 0700
    try:
        with contextlib.ExitStack() as stack:
            pair = PdPair(root, layout, args.tokens, args.evict_mib << 20, stack)
            pair.repetition(-1, record=False)  # opens the producer's store, touches the arenas
            for index in range(args.reps):
                pair.repetition(index, record=True)
            times = pair.times
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = report(times)
    if args.json:
        data = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "tokens": args.tokens,
            "computed_tokens": COMPUTED,
            "block_size": args.block_size,
            "reps": args.reps,
            "evict_mib": args.evict_mib,
            "load": load,
            "times_ms": {name: [v * 1e3 for v in values] for name, values in times.items()},
            **summary,
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"\nmeasurements written to {args.json}")


if __name__ == "__main__":
    main()
