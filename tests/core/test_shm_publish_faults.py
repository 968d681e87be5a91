"""An exception at any step of a publish (a bug, MemoryError, KeyboardInterrupt) leaves the
store as if the put had not happened, apart from the victims it evicted: no slot left odd
(being written), no index entry or slot-table count for the failed objects, and the next
publish of the same keys into the same slots is read back exactly by every reader.

Before the fix, a fault between "make odd" and "make even" left the slots odd, and the next
publish into such a slot made it even *while being written* (``seq + 1`` assumed an even
seq): readers saw sound objects as corrupt and the writer's stored and pinned objects as
missing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import vllm_artifact.core.store.shm_write as shm_write
from vllm_artifact.core import Namespace, R3Layout
from vllm_artifact.core.envelope import HeaderWords
from vllm_artifact.core.keys import keys_to_words
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_index import HashIndex
from vllm_artifact.core.store.shm_slots import SlotTable
from vllm_artifact.errors import ObjectMissingError

from .conftest import assert_store_consistent, key_for, open_writer, rows_for


class Fault(Exception):
    """The injected failure."""


#: Steps of a publish that are calls: (owner, attribute).
CALLS: dict[str, tuple[Any, str]] = {
    "allocate slots": (SlotTable, "allocate"),
    "unindex victims": (HashIndex, "remove"),
    "build envelopes": (HeaderWords, "build"),
    "seeds": (HeaderWords, "seeds_for"),
    "checksums": (shm_write, "checksum"),
    "copy payloads": (shm_write, "write_payloads"),
    "index insert": (HashIndex, "insert"),
    "fill slot table": (SlotTable, "fill"),
    "pin": (SlotTable, "pin"),
}
#: Steps that are stores into the arena: (arena attribute, which store into it).
STORES: dict[str, tuple[str, int]] = {
    "make odd": ("seq", 1),
    "write envelopes": ("words", 1),
    "make even": ("seq", 2),
}

PINNED = range(8)
UNPINNED = range(100, 116)
BATCH = range(200, 212)  # 12 new objects; 8 slots free: 4 victims are evicted
OTHERS = range(300, 304)


class _Tripwire(np.ndarray):
    """A view of an arena array whose ``at``-th item assignment raises (before or after it
    is done)."""

    def __setitem__(self, index: Any, value: Any) -> None:
        trip = self.__dict__.get("trip")
        if trip is None:
            super().__setitem__(index, value)
            return
        trip(lambda: super(_Tripwire, self).__setitem__(index, value))


def _arm_store(arena: Any, attr: str, at: int, fire: Callable[[Callable[[], None]], None]) -> None:
    view = getattr(arena, attr).view(_Tripwire)
    count = [0]

    def trip(assign: Callable[[], None]) -> None:
        count[0] += 1
        if count[0] == at:
            fire(assign)
        else:
            assign()

    view.trip = trip
    setattr(arena, attr, view)


@pytest.mark.parametrize("exc", [Fault, KeyboardInterrupt])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", [*CALLS, *STORES])
def test_a_fault_at_any_publish_step_leaves_the_store_consistent(
    shm_root: str,
    layout: R3Layout,
    namespace: Namespace,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
    when: str,
    exc: type[BaseException],
) -> None:
    bs = layout.block_size
    with open_writer(shm_root, layout, slots=32) as store:
        assert store.geometry.slot_count == 32
        keys = {i: key_for(namespace, i) for i in (*PINNED, *UNPINNED, *BATCH, *OTHERS)}
        rows = {i: rows_for(layout, i) for i in keys}
        store.put([(keys[i], rows[i], 0) for i in PINNED], pin=True)
        store.put([(keys[i], rows[i], 0) for i in UNPINNED], pin=False)
        stored = [*PINNED, *UNPINNED]
        located = store._reads.locate(keys_to_words([keys[i] for i in stored])).slots
        slot_of = dict(zip(stored, located.tolist(), strict=True))
        reader = ShmStore.open_reader(shm_root, "s")

        allocated: list[tuple[np.ndarray, np.ndarray]] = []
        allocate = SlotTable.allocate

        def spy(self: SlotTable, *args: Any, **kwargs: Any) -> Any:
            got = allocate(self, *args, **kwargs)
            if got is not None:
                allocated.append(got)
            return got

        monkeypatch.setattr(SlotTable, "allocate", spy)
        fired: list[str] = []

        def fire(done: Callable[[], object]) -> None:
            fired.append(step)
            if when == "after":
                done()
            raise exc(f"injected at {step!r} ({when})")

        if step in CALLS:
            owner, name = CALLS[step]
            original = getattr(owner, name)

            def faulty(*args: Any, **kwargs: Any) -> Any:
                if fired:
                    return original(*args, **kwargs)
                result: list[Any] = []
                fire(lambda: result.append(original(*args, **kwargs)))
                return None  # not reached: fire raises

            monkeypatch.setattr(owner, name, faulty)
        else:
            attr, at = STORES[step]
            _arm_store(store._live(), attr, at, fire)

        batch_rows = np.concatenate([rows[i] for i in BATCH])
        batch_keys = [keys[i] for i in BATCH]
        with pytest.raises(exc, match="injected"):
            store.put_blocks(batch_keys, batch_rows, 0, pin=True)
        assert fired == [step]

        # Victims: objects in slots the faulted publish took from the CLOCK (evicted).
        victims = {
            i
            for slots, evicted in allocated
            for s in slots[evicted].tolist()
            for i, at in slot_of.items()
            if at == s
        }
        assert not victims & set(PINNED)
        for handle in (store, reader):
            for i in (*PINNED, *UNPINNED):
                try:
                    (got,) = handle.get([keys[i]])
                except ObjectMissingError:
                    assert i in victims, f"object {i} lost, not a victim ({handle.writable=})"
                else:
                    np.testing.assert_array_equal(got, rows[i])
            for key in batch_keys:  # missing, not corrupt
                with pytest.raises(ObjectMissingError):
                    handle.get([key])
            assert handle.exists(batch_keys) == [False] * len(batch_keys)
        assert_store_consistent(store)
        assert store.stats().pinned_objects == len(PINNED)

        # The same keys (into the same slots) and others publish and read back exactly.
        store.put_blocks(batch_keys, batch_rows, 0, pin=True)
        store.put([(keys[i], rows[i], bs) for i in OTHERS], pin=False)
        for handle in (store, reader):
            out = layout.empty(len(batch_rows))
            handle.read_into(batch_keys, out)
            np.testing.assert_array_equal(out, batch_rows)
            for i in (*PINNED, *OTHERS):
                np.testing.assert_array_equal(handle.get([keys[i]])[0], rows[i])
        assert_store_consistent(store)
        assert store.stats().pinned_objects == len(PINNED) + len(BATCH)
        reader.close()


def test_a_slot_left_odd_is_published_into_correctly(
    shm_root: str, layout: R3Layout, namespace: Namespace
) -> None:
    """A free slot whose seq is odd (a retirement interrupted in its middle) gets an odd seq
    while being written and an even one once published; before the fix (``seq + 1``) the
    object was even while being written and odd, i.e. invisible, once published."""
    with open_writer(shm_root, layout, slots=8) as store:
        seq = store._live().seq
        seq[:] = 7  # every slot free, every seq odd
        key, rows = key_for(namespace, 1), rows_for(layout, 1)
        store.put([(key, rows, 0)])
        with ShmStore.open_reader(shm_root, "s") as reader:
            np.testing.assert_array_equal(reader.get([key])[0], rows)
        assert int(seq[0]) == 8
