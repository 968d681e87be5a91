"""Publish and materialize one 32K-token DeepSeek-V3-sized R3 sample on Mooncake Store.

Side by side in one run, interleaved per repetition (each repetition runs every measurement
once, the sides in rotating order, so drift and the load of other jobs hit all of them alike),
on 32K tokens x 58 layers x top-8 uint8 (14.5 MiB) in 2048 objects of 16 tokens:

* ``shm``: the /dev/shm ``ShmStore``;
* ``local``: ``MooncakeStore`` whose objects sit in the writer's own segment (its own master);
* ``remote``: ``MooncakeStore`` with no segment of its own (``segment_bytes=0``): its objects
  go to a store node, Mooncake's standalone ``mooncake_client`` process (another master),
  over loopback TCP.

For each side: ``publish`` (``put_runs`` of 2048 new keys, pinned), ``materialize``
(``read_into`` of those keys: fetch + envelope checks + xxh3 + copy into a preallocated
array) and a ``reader process`` (a subprocess with its own reader client, started before the
repetitions: ``ShmStore.open_reader``, or ``MooncakeStore.connect(segment_bytes=0,
writable=False)``, timing ``read_into`` of the same keys). For the Mooncake sides also
``raw get``: the client's own ``batch_get_into`` of the same names into a registered buffer
of 2048 value-sized slots, no envelope checks (the bytes Mooncake moves for us). The floor
is a numpy copy of the same 14.5 MiB into a preallocated array.

Every repetition publishes fresh keys with other bytes (the sample XOR the repetition) and
checks what every read returned against them (raw gets: value sizes and payload bytes);
afterwards the keys are unpinned (Mooncake: removed), untimed. Before each timed call a
scratch buffer larger than the last-level cache is written (``--evict-mib``), in the reader
processes too.

Target (the Mooncake issue): remote materialize within 2x of Mooncake's raw batch get of the
same bytes. Ratios are taken per repetition, with quartiles and the geometric mean's 95%
interval (``e2e_stats.paired_ratio``).

Everything runs on loopback: the benchmark starts its masters and the store node on free
ports and stops them, and removes the private /dev/shm directory it creates (the shm store,
the sample the readers check against, the Mooncake logs). Mooncake logs warnings and errors
only (``GLOG_minloglevel=1`` unless set).

Run: ``.venv/bin/python benchmarks/bench_mooncake.py [--reps N] [--json FILE]``
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from e2e_stats import quartiles, ratio_table, ratios
from vllm_artifact_testing.mooncake_master import client_env, mooncake_master, mooncake_store_node

from vllm_artifact.core import Namespace, R3Layout, full_block_keys
from vllm_artifact.core.envelope import HEADER_NBYTES
from vllm_artifact.core.keys import ObjectKey, keys_from_joined
from vllm_artifact.core.store import ObjectStore, ShmStore
from vllm_artifact.core.store.mooncake import MooncakeStore

MODEL = "deepseek-ai/DeepSeek-V3"
MiB = 1 << 20
HOST = "127.0.0.1"
SIDES = ("shm", "local", "remote")
#: Series of one side (``raw`` only for the Mooncake sides).
OPS = ("publish", "read", "raw", "child")


def layout_for(block_size: int) -> R3Layout:
    return R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=block_size)


def check(what: str, ok: bool) -> None:
    """Fail the run loudly (not an ``assert``: it must hold under ``python -O`` too)."""
    if not ok:
        raise RuntimeError(f"check failed: {what}")


class Scratch:
    """A buffer larger than the last-level cache: writing it evicts what a timed call reads."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)

    def evict(self) -> None:
        if self.buffer.size:
            np.add(self.buffer, 1, out=self.buffer)


# --------------------------------------------------------------------- reader process


def reader_child() -> None:
    """The reader process: one JSON config line on stdin, then one line per read
    (``{"keys": hex, "xor": n}``) answered with ``{"ms": ..., "ok": ...}``; ``quit`` ends it.
    Only ``read_into`` is timed (startup and the check are not)."""
    config = json.loads(sys.stdin.readline())
    layout = layout_for(config["block_size"])
    base = np.load(config["truth"])
    tokens = len(base)
    scratch = Scratch(config["evict_mib"] * MiB)
    store: ObjectStore
    if config["backend"] == "shm":
        store = ShmStore.open_reader(config["root"], config["name"])
    else:
        store = MooncakeStore.connect(
            master_address=config["master"],
            metadata_url=config["metadata"],
            local_hostname=HOST,
            layout=layout,
            key_prefix=config["prefix"],
            segment_bytes=0,
            writable=False,
        )
    out = layout.empty(tokens)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        request = json.loads(line)
        keys = keys_from_joined(bytes.fromhex(request["keys"]))
        scratch.evict()
        t0 = time.perf_counter()
        store.read_into(keys, out, token_start=0)
        elapsed = time.perf_counter() - t0
        ok = bool(np.array_equal(out, base ^ np.uint8(request["xor"])))
        print(json.dumps({"ms": elapsed * 1e3, "ok": ok}), flush=True)
    store.close()


class ReaderProcess:
    """The parent's end of :func:`reader_child`."""

    def __init__(self, label: str, config: dict[str, Any], log_dir: Path) -> None:
        self.label = label
        self.log = log_dir / f"reader-{label}.log"
        with self.log.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--reader-child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=client_env(),
            )
        self._send(json.dumps(config))
        check(f"reader process {label} started", self._receive() == "ready")

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        stdin, stdout = self.process.stdin, self.process.stdout
        if stdin is None or stdout is None:
            raise RuntimeError("reader process without pipes")
        return stdin, stdout

    def _send(self, line: str) -> None:
        self._pipes()[0].write(line + "\n")
        self._pipes()[0].flush()

    def _receive(self) -> str:
        line = self._pipes()[1].readline()
        if not line:
            self.process.wait(timeout=10)
            raise RuntimeError(
                f"reader process {self.label} exited ({self.process.returncode}): "
                + self.log.read_text(errors="replace")[-3000:]
            )
        return line.strip()

    def read(self, keys: list[ObjectKey], xor: int) -> float:
        """Seconds of the reader's ``read_into`` of ``keys``, checked against the sample."""
        self._send(json.dumps({"keys": b"".join(keys).hex(), "xor": xor}))
        answer = json.loads(self._receive())
        check(f"reader process {self.label}: rows read equal rows written", answer["ok"])
        return float(answer["ms"]) / 1e3

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self._send("quit")
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


# ------------------------------------------------------------------------ raw get


class RawGet:
    """Mooncake's own ``batch_get_into`` of whole values into a registered buffer, as our
    reads stage them, but with no checks and no copy out."""

    def __init__(self, store: MooncakeStore, count: int) -> None:
        self.client = store.live()
        self.stride = store.value_stride
        self.buffer = np.empty((count, self.stride), dtype=np.uint8)
        base = self.buffer.ctypes.data
        check(
            "raw buffer registered",
            self.client.register_buffer(base, self.buffer.nbytes) == 0,
        )
        self.ptrs = [base + i * self.stride for i in range(count)]
        self.sizes = [self.stride] * count

    def get(self, names: list[str]) -> list[int]:
        return list(self.client.batch_get_into(names, self.ptrs, self.sizes))

    def payload(self) -> np.ndarray:
        return self.buffer[:, HEADER_NBYTES:]

    def close(self) -> None:
        self.client.unregister_buffer(self.buffer.ctypes.data)


# -------------------------------------------------------------------------- sides


@dataclass
class Side:
    """One store: its writer, the reader process, and (Mooncake) the raw get."""

    label: str
    store: ObjectStore
    reader: ReaderProcess
    raw: RawGet | None = None
    times: dict[str, list[float]] = field(default_factory=dict)


class Bench:
    """The three sides, the floor and the repetitions."""

    def __init__(self, args: argparse.Namespace, work: Path, stack: contextlib.ExitStack) -> None:
        self.layout = layout_for(args.block_size)
        self.namespace = Namespace(MODEL, self.layout, "bench-mooncake")
        self.tokens = args.tokens
        self.n_blocks = args.tokens // args.block_size
        self.base = np.random.default_rng(0).integers(
            0, 256, size=(args.tokens, 58, 8), dtype=np.uint8
        )
        self.nbytes = self.base.nbytes
        truth_path = work / "truth.npy"
        np.save(truth_path, self.base)
        self.scratch = Scratch(args.evict_mib * MiB)
        self.out = self.layout.empty(self.tokens)
        self.floor_out = np.empty_like(self.base)
        self.floor: list[float] = []
        self.pid = os.getpid()
        common = {
            "block_size": args.block_size,
            "truth": str(truth_path),
            "evict_mib": args.evict_mib,
        }
        logs = work / "logs"
        for master_logs in ("local", "remote"):  # one directory per master (master.log)
            (logs / master_logs).mkdir(parents=True)

        # /dev/shm: room for a few samples (each repetition unpins what it wrote).
        root = work / "shm"
        root.mkdir(mode=0o700)
        shm = ShmStore.create_or_open_writer(
            root,
            "bench",
            layout=self.layout,
            capacity_bytes=4 * (self.nbytes + 4 * MiB),
            collect_expired=False,
        )
        stack.callback(shm.close)
        reader = ReaderProcess(
            "shm", {**common, "backend": "shm", "root": str(root), "name": "bench"}, logs
        )
        stack.callback(reader.close)
        self.sides = [Side("shm", shm, reader)]

        # Mooncake, objects in the writer's own segment: a master with no other segment.
        local_master = stack.enter_context(mooncake_master(log_dir=logs / "local"))
        self.sides.append(self._mooncake("local", local_master, 128 * MiB, common, logs, stack))
        # Mooncake, objects on a store node: the writer adds no memory.
        remote_master = stack.enter_context(mooncake_master(log_dir=logs / "remote"))
        stack.enter_context(mooncake_store_node(remote_master, "256MB"))
        self.sides.append(self._mooncake("remote", remote_master, 0, common, logs, stack))
        for side in self.sides:
            side.times = {op: [] for op in OPS if op != "raw" or side.raw is not None}

    def _mooncake(
        self,
        label: str,
        master: Any,
        segment_bytes: int,
        common: dict[str, Any],
        logs: Path,
        stack: contextlib.ExitStack,
    ) -> Side:
        prefix = f"bench-mooncake/{self.pid}/{label}"
        store = MooncakeStore.connect(
            master_address=master.master_address,
            metadata_url=master.metadata_url,
            local_hostname=HOST,
            layout=self.layout,
            key_prefix=prefix,
            segment_bytes=segment_bytes,
        )
        stack.callback(store.close)
        raw = RawGet(store, self.n_blocks)
        stack.callback(raw.close)
        config = {
            **common,
            "backend": "mooncake",
            "master": master.master_address,
            "metadata": master.metadata_url,
            "prefix": prefix,
        }
        reader = ReaderProcess(label, config, logs)
        stack.callback(reader.close)
        return Side(label, store, reader, raw)

    def timed(self, fn: Any) -> float:
        """Seconds of ``fn()`` after evicting the caches."""
        self.scratch.evict()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def repetition(self, index: int, record: bool) -> None:
        """Floor, then every side (in rotating order): publish fresh keys, read them back
        (ours, raw, the reader process), check every read, unpin."""
        xor = index % 255 + 1
        truth = self.base ^ np.uint8(xor)
        floor = self.timed(lambda: np.copyto(self.floor_out, truth))
        check("floor copy", np.array_equal(self.floor_out, truth))
        if record:
            self.floor.append(floor)
        shift = index % len(self.sides)
        for side in self.sides[shift:] + self.sides[:shift]:
            self.turn(side, index, xor, truth, record)

    def turn(self, side: Side, index: int, xor: int, truth: np.ndarray, record: bool) -> None:
        """One side's measurements of one repetition, on keys of its own."""
        hashes = [f"{side.label}/{index}/{i}".encode() for i in range(self.n_blocks)]
        keys = full_block_keys(self.namespace, hashes)
        store = side.store
        got: dict[str, float] = {}
        got["publish"] = self.timed(lambda: store.put_runs([(keys, truth, 0)], pin=True))
        self.out[:] = 0
        got["read"] = self.timed(lambda: store.read_into(keys, self.out, token_start=0))
        check(f"{side.label} {index}: read_into", np.array_equal(self.out, truth))
        if side.raw is not None and isinstance(store, MooncakeStore):
            raw = side.raw
            names = store.names(keys)
            raw.buffer[:] = 0
            codes: list[int] = []
            got["raw"] = self.timed(lambda: codes.extend(raw.get(names)))
            check(
                f"{side.label} {index}: raw get value sizes",
                codes == [HEADER_NBYTES + self.layout.block_nbytes] * self.n_blocks,
            )
            check(
                f"{side.label} {index}: raw get payloads",
                np.array_equal(raw.payload().reshape(truth.shape), truth),
            )
        got["child"] = side.reader.read(keys, xor)
        check(f"{side.label} {index}: unpin", all(store.unpin(keys)))
        if record:
            for op, value in got.items():
                side.times[op].append(value)


# ------------------------------------------------------------------------- report


LABELS = {
    "publish": "publish (put_runs, pinned)",
    "read": "materialize (read_into)",
    "raw": "Mooncake raw batch_get_into",
    "child": "reader process read_into",
}


def report(bench: Bench) -> dict[str, Any]:
    """Print the tables; return their figures for the JSON."""
    series: dict[str, list[float]] = {"floor": bench.floor}
    for side in bench.sides:
        for op, values in side.times.items():
            series[f"{side.label}.{op}"] = values
    mib = bench.nbytes / MiB
    summary: dict[str, Any] = {"ms": {}, "ratios": {}}
    print(
        f"\n  {'ms per operation':<46} {'median':>8} {'q1':>8} {'q3':>8} {'GB/s':>6} {'/floor':>7}"
    )
    for name, values in series.items():
        med, q1, q3 = (v * 1e3 for v in quartiles(values))
        over_floor = quartiles(ratios(values, bench.floor))[0]
        summary["ms"][name] = {"median": med, "q1": q1, "q3": q3, "over_floor": over_floor}
        if name == "floor":
            label = f"floor: numpy copy of {mib:.1f} MiB"
        else:
            where, op = name.split(".")
            label = f"{where:<7}{LABELS[op]}"
        print(
            f"  {label:<46} {med:8.2f} {q1:8.2f} {q3:8.2f} "
            f"{bench.nbytes / (med / 1e3) / 1e9:6.2f} {over_floor:6.2f}x"
        )
    pairs = [
        ("remote.read", "remote.raw", "ours remote materialize / raw remote get"),
        ("local.read", "local.raw", "ours local materialize / raw local get"),
        ("remote.child", "remote.raw", "remote reader process / raw remote get"),
        ("local.child", "local.raw", "local reader process / raw local get"),
        ("local.read", "shm.read", "local materialize / shm materialize"),
        ("remote.read", "shm.read", "remote materialize / shm materialize"),
        ("local.publish", "shm.publish", "local publish / shm publish"),
        ("remote.publish", "shm.publish", "remote publish / shm publish"),
        ("local.child", "shm.child", "local reader process / shm reader process"),
        ("remote.child", "shm.child", "remote reader process / shm reader process"),
        ("remote.read", "local.read", "remote materialize / local materialize"),
        ("remote.raw", "local.raw", "raw remote get / raw local get"),
    ]
    summary["ratios"] = ratio_table(
        series, [(num, den, label) for num, den, label in pairs], width=46
    )
    target = summary["ratios"]["remote.read/remote.raw"]
    met = target["median"] <= 2.0
    resolved = not np.isnan(target["ci95"][1]) and (
        target["ci95"][1] <= 2.0 or target["ci95"][0] > 2.0
    )
    summary["target"] = {"remote_read_over_raw_max": 2.0, "met": met, "resolved": resolved}
    print(
        f"\n  target: remote materialize <= 2x raw remote get (median of per-repetition ratios "
        f"{target['median']:.2f}): {'PASS' if met else 'MISS'}"
        f"{'' if resolved else ' (95% CI contains 2)'}"
    )
    return summary


def mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16, help="R3 block size")
    ap.add_argument(
        "--evict-mib",
        type=int,
        default=64,
        help="MiB written before each timed call to evict the CPU caches (0: none)",
    )
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument("--reader-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader_child:
        reader_child()
        return
    if args.tokens % args.block_size or args.tokens <= 0:
        ap.error("--tokens must be a positive multiple of --block-size")
    if args.reps < 1 or args.evict_mib < 0:
        ap.error("--reps must be at least 1 and --evict-mib at least 0")
    # SIGTERM unwinds like an error, so the servers stop and the private root goes too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", HOST)
    # Mooncake's info logs (every client setup, in every process) only to the log files.
    os.environ.setdefault("GLOG_minloglevel", "1")
    layout = layout_for(args.block_size)
    load = os.getloadavg()
    print(
        f"R3 of one {args.tokens}-token request x 58 layers x top-8 uint8 = "
        f"{args.tokens * layout.row_nbytes / MiB:.1f} MiB in {args.tokens // args.block_size} "
        f"objects of {args.block_size} tokens; {mooncake_version()}, loopback TCP\n"
        f"{args.reps} repetitions (+1 warm-up), interleaved, sides in rotating order; "
        f"{args.evict_mib} MiB written before each timed call; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs"
    )
    started = time.monotonic()
    # Everything this run writes (shm store, the readers' sample, Mooncake logs, the store
    # node's log directory through tempfile's default) lives in one private directory.
    work = Path(tempfile.mkdtemp(prefix="vllm-artifact-bench-mooncake-", dir="/dev/shm"))
    previous_tempdir = tempfile.tempdir
    tempfile.tempdir = str(work)
    try:
        with contextlib.ExitStack() as stack:
            bench = Bench(args, work, stack)
            setup_s = time.monotonic() - started
            bench.repetition(-1, record=False)
            for index in range(args.reps):
                bench.repetition(index, record=True)
            measured_s = time.monotonic() - started - setup_s
    finally:
        tempfile.tempdir = previous_tempdir
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    summary = report(bench)
    total_s = time.monotonic() - started
    print(
        f"\n  load average at the end {load_after[0]:.2f} {load_after[1]:.2f} "
        f"{load_after[2]:.2f}; setup {setup_s:.1f} s, repetitions {measured_s:.1f} s, "
        f"total {total_s:.1f} s"
    )
    if args.json:
        data = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "mooncake": mooncake_version(),
            "tokens": args.tokens,
            "block_size": args.block_size,
            "objects": args.tokens // args.block_size,
            "nbytes": bench.nbytes,
            "reps": args.reps,
            "evict_mib": args.evict_mib,
            "cpus": os.cpu_count(),
            "load": load,
            "load_after": load_after,
            "seconds": {"setup": setup_s, "repetitions": measured_s, "total": total_s},
            "times_ms": {
                "floor": [v * 1e3 for v in bench.floor],
                **{
                    f"{side.label}.{op}": [v * 1e3 for v in values]
                    for side in bench.sides
                    for op, values in side.times.items()
                },
            },
            **summary,
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"\nmeasurements written to {args.json}")


if __name__ == "__main__":
    main()
