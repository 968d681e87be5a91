"""SlotTable keeps its occupancy and pin counts by increments: they must always equal a recount."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_artifact.core.store.shm_slots import SlotTable

SLOTS = 12
_slot_lists = st.lists(st.integers(0, SLOTS - 1), max_size=6)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 4)),
        st.tuples(st.sampled_from(["pin", "unpin", "release", "touch"]), _slot_lists),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(present=st.lists(st.booleans(), min_size=SLOTS, max_size=SLOTS), ops=_ops)
def test_counts_match_a_recount(present: list[bool], ops: list[tuple[str, object]]) -> None:
    table = SlotTable(SLOTS)
    table.adopt(np.array(present))
    for op, arg in ops:
        if op == "allocate":
            got = table.allocate(int(arg), np.empty(0, dtype=np.int64))  # type: ignore[call-overload]
            if got is not None:
                table.fill(got[0])
        else:
            slots = np.array(arg, dtype=np.int64)
            if op in ("pin", "unpin"):  # the store pins and unpins only stored objects
                slots = slots[table.occupied[slots]]
            if op == "pin":  # the fast path wherever the slots are distinct
                table.pin(slots, distinct=len(np.unique(slots)) == len(slots))
            else:
                getattr(table, op)(slots)
        assert table.objects == int(np.count_nonzero(table.occupied))
        assert table.pinned == int(np.count_nonzero(table.pins))
        assert (table.pins >= 0).all()
