"""Keys-only handles: validation, key ranges, transport through vLLM's routed-experts field,
and reading them back from a real /dev/shm store in this and in another process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from vllm_artifact_testing.store_faults import flip_in_every_slot

from vllm_artifact.client import R3Keys, R3Reader, decode_r3
from vllm_artifact.core import Namespace, full_block_keys, tail_block_key
from vllm_artifact.core.handoff import RowsDigest, StoreAddress
from vllm_artifact.core.row_file import is_file_transport
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import (
    KeyCollisionError,
    ObjectCorruptError,
    ObjectMissingError,
    SchemaError,
    UnsafeRootError,
)

from .conftest import SMALL, rows_for

NS = Namespace("test-model", SMALL, "v1")
BS = SMALL.block_size


def _handle(
    root: str,
    keys: list,
    *,
    first_row: int,
    num_rows: int,
    token_start: int = 0,
    last_block_tokens: int = BS,
) -> R3Keys:
    return R3Keys.of(
        store=StoreAddress(root=root, name="r3-s"),
        layout=SMALL.canonical(),
        block_size=BS,
        token_start=token_start,
        first_row=first_row,
        num_rows=num_rows,
        keys=keys,
        last_block_tokens=last_block_tokens,
    )


def _publish(store: ShmStore, n_full: int, tail: int) -> tuple[list, np.ndarray]:
    """A request's objects as rank zero publishes them: full blocks, then a tail."""
    rows = rows_for(SMALL, 7, n_full * BS + tail)
    keys = full_block_keys(NS, [i.to_bytes(32, "little") for i in range(n_full)])
    store.put_blocks(keys, rows[: n_full * BS], 0)
    if tail:
        tail_key = tail_block_key(NS, b"tail-hash", tail)
        store.put_blocks([tail_key], rows[n_full * BS :], n_full * BS)
        keys.append(tail_key)
    return keys, rows


def test_json_round_trip_and_rows_cut(shm_root: str) -> None:
    keys = full_block_keys(NS, [b"a", b"b", b"c"])
    handle = _handle(shm_root, keys, first_row=5, num_rows=40)
    assert R3Keys.from_json(handle.to_json()) == handle
    fields = handle.model_dump(exclude={"format", "keys"})
    fields["store"] = handle.store
    trusted = R3Keys.of(**fields, keys=keys, trusted=True)  # the engine's path
    assert trusted.to_json() == handle.to_json()
    assert json.loads(handle.to_json())["format"] == "vllm-artifact/r3-keys/v1"
    assert handle.object_keys() == (keys, 0, 3 * BS)  # rows 5..45 lie in blocks 0..2
    assert handle.model_copy(update={"num_rows": 10}).object_keys() == (keys[:1], 0, BS)
    assert handle.model_copy(update={"num_rows": 0}).object_keys() == ([], 5, 0)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"format": "other/v1"}, "format"),
        ({"keys": ["zz" * 16]}, "keys.0"),
        ({"keys": ["ab" * 15]}, "keys.0"),
        ({"num_rows": 10**6}, "reach past"),
        ({"first_row": -1}, "first_row"),
        ({"token_start": 3}, "multiple of block_size"),
        ({"store": {"root": "/dev/shm/x", "name": "../../etc"}}, "store.name"),
        ({"unexpected": 1}, "unexpected"),
    ],
)
def test_malformed_handles_are_schema_errors(shm_root: str, change: dict, problem: str) -> None:
    good = json.loads(
        _handle(shm_root, full_block_keys(NS, [b"a"]), first_row=0, num_rows=3).to_json()
    )
    with pytest.raises(SchemaError, match="not a vllm-artifact R3 keys handle") as err:
        R3Keys.from_json(json.dumps({**good, **change}))
    assert problem in str(err.value)
    with pytest.raises(SchemaError):
        R3Keys.from_json("{not json")


def test_transport_through_vllms_routed_experts_field(shm_root: str) -> None:
    handle = _handle(shm_root, full_block_keys(NS, [b"a", b"b"]), first_row=0, num_rows=20)
    moved = handle.to_transport()
    assert R3Keys.is_transport(moved) and R3Keys.from_transport(moved) == handle
    assert not is_file_transport(moved)  # nor taken for rows sent as a file (row_file.py)
    assert not R3Keys.is_transport(rows_for(SMALL, 0))  # R3 rows are 3-D


@pytest.mark.parametrize(
    "first_row, num_rows", [(0, 3 * BS + 5), (BS + 3, 2 * BS), (2 * BS, BS + 5)]
)
def test_reader_returns_exactly_the_rows(store: ShmStore, first_row: int, num_rows: int) -> None:
    keys, rows = _publish(store, 3, 5)
    first_block = first_row // BS
    handle = _handle(
        store.root,
        keys[first_block:],
        first_row=first_row,
        num_rows=num_rows,
        token_start=first_block * BS,
        last_block_tokens=5,
    )
    with R3Reader(timeout=1) as reader:
        got = reader.read(handle.to_json())
    np.testing.assert_array_equal(got.experts, rows[first_row : first_row + num_rows])
    assert got.dense_layers == SMALL.dense_layers


def test_reader_waits_for_late_publication(store: ShmStore) -> None:
    """The engine answers before the background publisher writes the last blocks."""
    rows = rows_for(SMALL, 3, 2 * BS)
    keys = full_block_keys(NS, [b"x", b"y"])
    late = threading.Timer(0.3, store.put_blocks, (keys, rows, 0))
    started = time.monotonic()  # before the timer starts: a slow start cannot shorten it
    late.start()
    got = decode_r3(_handle(store.root, keys, first_row=0, num_rows=2 * BS).to_json())
    assert time.monotonic() - started >= 0.25
    np.testing.assert_array_equal(got.experts, rows)
    late.join()


def test_missing_and_corrupt_objects_fail_closed(store: ShmStore) -> None:
    keys, _ = _publish(store, 2, 0)
    absent = full_block_keys(NS, [b"never published"])
    with (
        R3Reader(timeout=0.05) as reader,
        pytest.raises(ObjectMissingError, match="read handles promptly"),
    ):
        reader.read(_handle(store.root, [*keys, *absent], first_row=0, num_rows=3 * BS))
    flip_in_every_slot(Path(store.root), where="payload")
    with R3Reader(timeout=0.05) as reader, pytest.raises(ObjectCorruptError):
        reader.read(_handle(store.root, keys, first_row=0, num_rows=2 * BS))


def test_handle_for_another_layout_is_refused(store: ShmStore) -> None:
    keys, _ = _publish(store, 1, 0)
    handle = _handle(store.root, keys, first_row=0, num_rows=BS)
    wrong = handle.model_copy(update={"layout": handle.layout.replace("top_k=4", "top_k=8")})
    with R3Reader() as reader, pytest.raises(SchemaError, match="holds layout"):
        reader.read(wrong)


def test_reader_in_another_process(store: ShmStore) -> None:
    keys, rows = _publish(store, 2, 9)
    handle = _handle(store.root, keys, first_row=4, num_rows=2 * BS + 5, last_block_tokens=9)
    code = (
        "import sys, hashlib\n"
        "from vllm_artifact.client import read_r3_keys\n"
        "r3 = read_r3_keys(sys.stdin.read())\n"
        "print(r3.experts.shape, hashlib.sha256(r3.experts.tobytes()).hexdigest())\n"
        "assert 'vllm' not in {m.split('.')[0] for m in sys.modules}, 'client imported vLLM'\n"
        "assert 'torch' not in sys.modules\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        input=handle.to_json(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    want = rows[4 : 4 + 2 * BS + 5]
    import hashlib

    assert res.stdout.split(")")[-1].strip() == hashlib.sha256(want.tobytes()).hexdigest()
    assert res.stdout.startswith(str(want.shape))


@pytest.mark.parametrize(
    "root, name", [("/tmp", "r3-s"), ("/dev/shm/../etc", "r3-s"), (None, ".."), (None, ".hidden")]
)
def test_hostile_store_address_is_refused(store: ShmStore, root: str | None, name: str) -> None:
    """A handle names a store; the store's own root and name checks decide what opens."""
    keys, _ = _publish(store, 1, 0)
    handle = _handle(store.root, keys, first_row=0, num_rows=BS)
    address = StoreAddress(root=root or store.root, name=name)
    with R3Reader() as reader, pytest.raises(UnsafeRootError):
        reader.read(handle.model_copy(update={"store": address}))


def test_a_handle_resolves_to_its_requests_rows_or_not_at_all(store: ShmStore) -> None:
    """The store keeps the first object under a key; a request that computed the same blocks
    with other routing (nondeterministic kernels) must not be handed those rows: its handle's
    digest of its own rows does not match, and the read fails closed."""
    keys, rows = _publish(store, 2, 5)
    fields = {"first_row": 3, "num_rows": 2 * BS + 2}
    own = _handle(store.root, keys, **fields, last_block_tokens=5).model_copy(
        update={"rows_xxh3": RowsDigest.of(rows[3 : 3 + 2 * BS + 2])}
    )
    np.testing.assert_array_equal(decode_r3(own.to_json()).experts, rows[3 : 3 + 2 * BS + 2])
    other = rows.copy()
    other[BS + 1, 0, 0] ^= 1  # another request's routing in the second block
    theirs = own.model_copy(update={"rows_xxh3": RowsDigest.of(other[3 : 3 + 2 * BS + 2])})
    with R3Reader(timeout=0.05) as reader, pytest.raises(KeyCollisionError, match="other routing"):
        reader.read(theirs)
    with pytest.raises(SchemaError, match="rows_xxh3"):
        R3Keys.from_json(own.to_json().replace(own.rows_xxh3 or "", "not hex"))


def test_rows_digest_fed_step_by_step_equals_one_pass() -> None:
    rows = rows_for(SMALL, 9, 37)
    digest = RowsDigest()
    for lo, hi in ((0, 20), (20, 21), (21, 37)):
        digest.add(rows[lo:hi])
    assert digest.rows == 37 and digest.hexdigest() == RowsDigest.of(rows)
    assert RowsDigest.of(rows[:36]) != RowsDigest.of(rows)
