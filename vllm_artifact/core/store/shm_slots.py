"""Writer-side slot bookkeeping: occupancy, pin counts and CLOCK eviction.

This state lives only in the writer process (readers never evict), as plain
numpy arrays of one entry per slot, so a 1M-slot store costs ~6 MB here and
no per-object Python objects.

Eviction is CLOCK (second chance), an LRU approximation that needs no list
reordering on reads: a read or put sets the slot's reference bit; the hand
sweeps slots in order, clearing reference bits, and takes unpinned,
unreferenced ones; free slots are always used before anything is evicted.
Sweeps are vectorized over windows, so allocating ``count`` slots costs O(count)
amortized, not O(objects). Pinned slots (the KV cache can still hit them) are
never taken; if two full sweeps do not find
``count`` slots, pinned data alone fills the store and the caller raises
:class:`CapacityError`. Allocation changes nothing until it succeeds.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SlotTable"]


class SlotTable:
    """Occupancy, pins and reference bits of every slot (writer only)."""

    def __init__(self, slot_count: int) -> None:
        self.slot_count = slot_count
        self.occupied = np.zeros(slot_count, dtype=bool)
        self.pins = np.zeros(slot_count, dtype=np.int32)
        self.referenced = np.zeros(slot_count, dtype=bool)
        self.hand = 0
        self.free_hand = 0
        self.evictions = 0
        # Kept up to date by every change, so the occupancy gauges, refreshed after every
        # publication, cost O(changed slots), not a count over all slots.
        self._objects = 0  # occupied slots
        self._pinned = 0  # slots with pins > 0

    @property
    def objects(self) -> int:
        return self._objects

    @property
    def pinned(self) -> int:
        return self._pinned

    def adopt(self, present: np.ndarray) -> None:
        """Start from the objects a (recovered) arena holds: none pinned or referenced."""
        self.occupied[:] = present
        self.pins[:] = 0
        self.referenced[:] = False
        self._objects = int(np.count_nonzero(present))
        self._pinned = 0

    def allocate(self, count: int, protect: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Pick ``count`` slots; returns ``(slots, evicted_mask)`` or None if impossible.

        Free slots are used first (a fresh or recovered store never evicts
        while it has room); then the CLOCK hand evicts. ``protect`` lists
        slots that must not be evicted (objects the current batch
        re-publishes). The caller must unindex evicted slots before reuse.
        """
        if count == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
        free_total = self.slot_count - self._objects
        chosen: list[np.ndarray] = []
        if free_total:
            picks = self._sweep_free(min(count, free_total))
            chosen.append(picks)
        need = count - sum(len(picked) for picked in chosen)
        if need:
            victims = self._sweep_clock(need, protect)
            if victims is None:
                return None
            chosen.append(victims)
        slots = np.concatenate(chosen)
        evicted = self.occupied[slots].copy()
        self.evictions += int(np.count_nonzero(evicted))
        return slots, evicted

    def _sweep_free(self, count: int) -> np.ndarray:
        """Next ``count`` unoccupied slots from the free cursor (they exist)."""
        slot_count = self.slot_count
        found: list[np.ndarray] = []
        got = 0
        pos = self.free_hand
        window = max(4 * count, 1024)
        scanned = 0
        while got < count and scanned < slot_count + window:
            hi = min(slot_count, pos + window)
            picks = pos + np.flatnonzero(~self.occupied[pos:hi])[: count - got]
            found.append(picks)
            got += len(picks)
            stop = hi if got < count else int(picks[-1]) + 1
            scanned += stop - pos
            pos = stop % slot_count
        self.free_hand = pos
        return np.concatenate(found)

    def _sweep_clock(self, count: int, protect: np.ndarray) -> np.ndarray | None:
        """CLOCK: take ``count`` occupied, unpinned, unreferenced slots (or None)."""
        slot_count = self.slot_count
        shield = np.zeros(slot_count, dtype=bool) if len(protect) else None
        if shield is not None:
            shield[protect] = True
        chosen: list[np.ndarray] = []
        found = 0
        hand = self.hand
        swept = 0
        window = max(4 * count, 1024)
        refs = self.referenced.copy()  # committed only on success
        while found < count and swept < 2 * slot_count + window:
            lo = hand
            hi = min(slot_count, lo + window)
            ok = self.occupied[lo:hi] & (self.pins[lo:hi] == 0) & ~refs[lo:hi]
            if shield is not None:
                ok &= ~shield[lo:hi]
            picks = lo + np.flatnonzero(ok)[: count - found]
            if len(picks):
                chosen.append(picks)
                found += len(picks)
            stop = hi if found < count else int(picks[-1]) + 1
            refs[lo:stop] = False  # second chance: passed-over slots lose their bit
            swept += stop - lo
            hand = stop % slot_count
            if hand == 0 and found < count and chosen:
                if shield is None:
                    shield = np.zeros(slot_count, dtype=bool)
                shield[np.concatenate(chosen)] = True  # never pick a slot twice
        if found < count:
            return None
        self.referenced = refs
        self.hand = hand
        return np.concatenate(chosen)

    def fill(self, slots: np.ndarray) -> None:
        """Mark freshly written slots (distinct, from :meth:`allocate`) as holding objects."""
        self._objects += len(slots) - int(np.count_nonzero(self.occupied[slots]))
        self._pinned -= int(np.count_nonzero(self.pins[slots]))
        self.occupied[slots] = True
        self.pins[slots] = 0
        self.referenced[slots] = True

    def release(self, slots: np.ndarray) -> None:
        """Mark slots empty (rolled back or dropped objects)."""
        slots = np.unique(slots)
        self._objects -= int(np.count_nonzero(self.occupied[slots]))
        self._pinned -= int(np.count_nonzero(self.pins[slots]))
        self.occupied[slots] = False
        self.pins[slots] = 0
        self.referenced[slots] = False

    def touch(self, slots: np.ndarray) -> None:
        self.referenced[slots] = True

    def pin(self, slots: np.ndarray, *, distinct: bool = False) -> None:
        """Add one pin per slot occurrence (``distinct``: the caller knows no slot repeats,
        which allows a plain, much faster increment)."""
        pins = self.pins
        newly = slots[pins[slots] == 0]
        if distinct:
            self._pinned += len(newly)
            pins[slots] += 1
            return
        self._pinned += len(newly) if len(newly) < 2 else len(np.unique(newly))
        np.add.at(pins, slots, 1)

    def unpin(self, slots: np.ndarray) -> np.ndarray:
        """Drop one pin per slot occurrence; returns which entries were pinned."""
        if len(np.unique(slots)) == len(slots):
            was = self.pins[slots] > 0
            dropped = slots[was]
            self.pins[dropped] -= 1
            self._pinned -= int(np.count_nonzero(self.pins[dropped] == 0))
            return was
        was = np.zeros(len(slots), dtype=bool)
        for i, slot in enumerate(slots.tolist()):
            if self.pins[slot] > 0:
                self.pins[slot] -= 1
                self._pinned -= int(self.pins[slot] == 0)
                was[i] = True
        return was
