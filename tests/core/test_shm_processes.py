"""ShmStore across processes: readers, racing writers, SIGKILL mid-publish, TTL."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vllm_artifact.core.store.shm_write as shm_write
from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.store import ShmStore, collect_expired_stores
from vllm_artifact.errors import KeyCollisionError, ObjectMissingError, WriterConflictError

from .conftest import SMALL, key_for, rows_for

CTX = mp.get_context("fork")  # fast to start; children only touch the store
NS = Namespace("test-model", SMALL, "v1")


def _writer(root: str, name: str = "s", slots_bytes: int = 1 << 20) -> ShmStore:
    return ShmStore.create_or_open_writer(
        root, name, layout=SMALL, capacity_bytes=slots_bytes, collect_expired=False
    )


def test_reader_in_a_fresh_process(shm_root: str, layout: R3Layout) -> None:
    with _writer(shm_root) as store:
        keys = [key_for(NS, i) for i in range(8)]
        store.put_blocks(keys, np.concatenate([rows_for(layout, i) for i in range(8)]), 0)
        code = (
            "import sys, hashlib\n"
            "from vllm_artifact.core.store import ShmStore\n"
            "from vllm_artifact.core import ObjectKey\n"
            "keys = [ObjectKey(bytes.fromhex(h)) for h in sys.argv[2:]]\n"
            "r = ShmStore.open_reader(sys.argv[1], 's')\n"
            "out = r.layout.empty(16 * len(keys))\n"
            "r.read_into(keys, out)\n"
            "print(hashlib.sha256(out.tobytes()).hexdigest())\n"
        )
        res = subprocess.run(
            [sys.executable, "-c", code, shm_root, *(k.hex() for k in keys)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        want = np.concatenate([rows_for(layout, i) for i in range(8)])
        import hashlib

        assert res.stdout.strip() == hashlib.sha256(want.tobytes()).hexdigest()


def _race(root: str, who: int, barrier: Barrier, done: Event, results: mp.SimpleQueue) -> None:
    try:
        barrier.wait(10)
        store = _writer(root)
    except WriterConflictError:
        results.put((who, "conflict"))
        os._exit(0)
    except BaseException as err:
        results.put((who, repr(err)))
        os._exit(1)
    store.put([(key_for(NS, 7), rows_for(SMALL, 100 + who), 0)])
    results.put((who, "owner"))
    done.wait(30)
    store.close()
    os._exit(0)


def test_two_writers_race_for_one_store_and_key(shm_root: str) -> None:
    barrier, done, results = CTX.Barrier(2), CTX.Event(), CTX.SimpleQueue()
    procs = [
        CTX.Process(target=_race, args=(shm_root, who, barrier, done, results)) for who in (0, 1)
    ]
    for p in procs:
        p.start()
    outcome = dict(results.get() for _ in procs)
    assert sorted(outcome.values()) == ["conflict", "owner"]
    winner = next(w for w, v in outcome.items() if v == "owner")
    reader = ShmStore.open_reader(shm_root, "s")
    np.testing.assert_array_equal(reader.get([key_for(NS, 7)])[0], rows_for(SMALL, 100 + winner))
    with pytest.raises(WriterConflictError, match="another live writer"):
        _writer(shm_root)
    done.set()
    for p in procs:
        p.join(30)
    with _writer(shm_root) as store:  # the owner is gone: the store is ours now
        with pytest.raises(KeyCollisionError):
            store.put([(key_for(NS, 7), rows_for(SMALL, 100 + (1 - winner)), 0)])
        store.put([(key_for(NS, 7), rows_for(SMALL, 100 + winner), 0)])
    reader.close()


UNIVERSE = 300


def _publish_forever(
    root: str, seed: int, ready: Event, reports: mp.SimpleQueue, die_in_put: int | None
) -> None:
    """Publish random batches until killed; with ``die_in_put``, that put's payload
    copy stops half-way and the writer SIGKILLs itself (seqlock odd, payload torn)."""
    if die_in_put is not None:  # this forked child only
        copy_payloads = shm_write.write_payloads
        puts = itertools.count()

        def tear_then_die(
            payload: memoryview, stride: int, batch: Any, new: np.ndarray, slots: np.ndarray
        ) -> None:
            if next(puts) == die_in_put:
                half = len(new) // 2
                copy_payloads(payload, stride, batch, new[:half], slots[:half])
                os.kill(os.getpid(), signal.SIGKILL)
            copy_payloads(payload, stride, batch, new, slots)

        shm_write.write_payloads = tear_then_die
    store = _writer(root, slots_bytes=64 * 1024)  # ~100 slots: constant eviction
    assert store.recovery is not None
    reports.put(store.recovery.dropped_partial)
    rng = random.Random(seed)
    ready.set()
    while True:
        ids = rng.sample(range(UNIVERSE), 8)
        store.put([(key_for(NS, i), rows_for(SMALL, i), 16 * i) for i in ids], pin=False)


def test_sigkill_inside_publish_loop_never_exposes_partial_objects(shm_root: str) -> None:
    want = {i: rows_for(SMALL, i) for i in range(UNIVERSE)}
    keys = {i: key_for(NS, i) for i in range(UNIVERSE)}
    reports: mp.SimpleQueue = CTX.SimpleQueue()
    reader: ShmStore | None = None
    rng = random.Random(1234)
    hits = misses = 0
    rounds = 50
    # Every fifth writer dies inside a publish for sure; the others die wherever
    # the parent's SIGKILL finds them (a publish is a small share of the loop).
    torn = {r: rng.randrange(50) for r in range(4, rounds, 5)}
    for r in range(rounds):
        ready = CTX.Event()
        proc = CTX.Process(target=_publish_forever, args=(shm_root, r, ready, reports, torn.get(r)))
        proc.start()
        assert ready.wait(20), "writer did not start"
        if reader is None:
            reader = ShmStore.open_reader(shm_root, "s")
        deadline = time.monotonic() + rng.uniform(0.005, 0.03)
        give_up = time.monotonic() + 20
        # Read until the deadline; a tearing writer is read until it has killed itself.
        while time.monotonic() < deadline or (r in torn and proc.is_alive()):
            assert time.monotonic() < give_up, "the tearing writer did not die"
            for i in rng.sample(range(UNIVERSE), 16):
                try:
                    got = reader.get([keys[i]])[0]
                except ObjectMissingError:
                    misses += 1
                    continue
                np.testing.assert_array_equal(got, want[i])  # never partial or foreign
                hits += 1
        if r not in torn:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    assert reader is not None
    # After the last crash: a new writer recovers, everything left is intact.
    with _writer(shm_root, slots_bytes=64 * 1024) as store:
        assert store.recovery is not None and not store.recovery.recreated
        partial = [reports.get() for _ in range(rounds)]
        partial.append(store.recovery.dropped_partial)
        present = [i for i in range(UNIVERSE) if store.exists([keys[i]])[0]]
        assert present
        for i, got in zip(present, store.get([keys[i] for i in present]), strict=True):
            np.testing.assert_array_equal(got, want[i])
    reader.close()
    assert hits > 0 and misses > 0
    # The next writer found each torn publish (odd seqlock) and dropped it;
    # partial[r + 1] is what the writer after round r dropped at open.
    assert all(partial[r + 1] >= 1 for r in torn), (torn, partial)


def _die_with_store(root: str, name: str, ready: Event) -> None:
    store = _writer(root, name)
    store.put([(key_for(NS, 1), rows_for(SMALL, 1), 0)])
    ready.set()
    time.sleep(60)


def test_ttl_collects_dead_writers_only(shm_root: str) -> None:
    def crashed(name: str) -> None:
        ready = CTX.Event()
        p = CTX.Process(target=_die_with_store, args=(shm_root, name, ready))
        p.start()
        assert ready.wait(20)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)

    crashed("dead")
    crashed("young")
    live = _writer(shm_root, "live")
    live.put([(key_for(NS, 2), rows_for(SMALL, 2), 0)])
    old = time.time() - 7200
    for name in ("dead", "live"):
        os.utime(f"{shm_root}/{name}/writer.lock", (old, old))
    os.mkdir(f"{shm_root}/alien", 0o700)  # not ours: never touched
    os.chown(f"{shm_root}/alien", 54321, 54321)
    os.utime(f"{shm_root}/alien", (old, old))
    with open(f"{shm_root}/notes.txt", "w") as f:
        f.write("x")
    dead_reader = ShmStore.open_reader(shm_root, "dead")

    assert collect_expired_stores(shm_root, 3600) == ["dead"]
    assert sorted(os.listdir(shm_root)) == ["alien", "live", "notes.txt", "young"]
    # The live writer's store (old heartbeat, but locked) is untouched and works.
    live.put([(key_for(NS, 3), rows_for(SMALL, 3), 16)])
    assert live.exists([key_for(NS, 2), key_for(NS, 3)]) == [True, True]
    # A reader that mapped the collected store keeps a consistent view.
    np.testing.assert_array_equal(dead_reader.get([key_for(NS, 1)])[0], rows_for(SMALL, 1))
    dead_reader.close()
    # Later, the younger dead store expires too; the live one never does.
    assert collect_expired_stores(shm_root, 3600, now=time.time() + 7200) == ["young"]
    assert os.path.isdir(f"{shm_root}/live")
    live.close()
    assert collect_expired_stores(shm_root, 3600, now=time.time() + 7200) == ["live"]


_FORKING_WRITER = """
import fcntl, os, sys, time
from tests.core.conftest import SMALL, key_for, rows_for
from vllm_artifact.core import Namespace
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import StoreReadOnlyError

ns = Namespace("test-model", SMALL, "v1")
store = ShmStore.create_or_open_writer(
    sys.argv[1], "s", layout=SMALL, capacity_bytes=1 << 20, collect_expired=False
)
store.put([(key_for(ns, 1), rows_for(SMALL, 1), 0)])
cloexec = bool(fcntl.fcntl(store._lock._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:  # the child tries to publish with the inherited handle, then lives on
    try:
        store.put([(key_for(ns, 2), rows_for(SMALL, 2), 16)])
        outcome = "published"
    except StoreReadOnlyError as err:
        outcome = f"refused: {err}"
    os.write(write_end, outcome.encode())
    os.close(write_end)
    time.sleep(120)
    os._exit(0)
os.close(write_end)
with os.fdopen(read_end, "rb") as pipe:
    outcome = pipe.read().decode()
print(pid, cloexec, outcome, flush=True)
time.sleep(120)
"""


def test_a_forked_child_does_not_keep_the_store_locked(shm_root: str) -> None:
    """flock locks belong to the open file description, which fork shares: a child of the
    writer (a worker pool, a helper process) used to keep the store locked after the writer
    died, and could publish into it beside the next writer."""
    writer = subprocess.Popen(
        [sys.executable, "-c", _FORKING_WRITER, shm_root],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    child = 0
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        pid, cloexec, outcome = line.split(" ", 2)
        child = int(pid)
        assert cloexec == "True"  # an exec'd child does not inherit the fd at all
        assert outcome.startswith("refused:") and "fork of the store's writer" in outcome
        writer.kill()
        assert writer.wait(10) == -signal.SIGKILL
        os.kill(child, 0)  # the child still lives
        with _writer(shm_root) as store:  # the writer is dead: the store is ours now
            assert store.exists([key_for(NS, 1), key_for(NS, 2)]) == [True, False]
            store.put([(key_for(NS, 2), rows_for(SMALL, 2), 16)])
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        writer.kill()
        writer.wait(10)
        writer.stdout.close()  # type: ignore[union-attr]
