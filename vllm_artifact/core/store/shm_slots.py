"""Writer-side slot bookkeeping: occupancy, pin counts and CLOCK eviction.

This state lives only in the writer process (readers never evict), as plain
numpy arrays of one entry per slot, so a 1M-slot store costs ~6 MB here and
no per-object Python objects.

Eviction is CLOCK (second chance), an LRU approximation that needs no list
reordering on reads: a read or put sets the slot's reference bit; the hand
sweeps slots in order, clearing reference bits, and takes free slots or
unpinned, unreferenced ones. Sweeps are vectorized over windows, so
allocating ``k`` slots costs O(k) amortized, not O(objects). Pinned slots (the
KV cache can still hit them) are never taken; if two full sweeps do not find
``k`` slots, pinned data alone fills the store and the caller raises
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
        self.evictions = 0

    @property
    def objects(self) -> int:
        return int(np.count_nonzero(self.occupied))

    @property
    def pinned(self) -> int:
        return int(np.count_nonzero(self.pins))

    def allocate(self, k: int, protect: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Pick ``k`` slots; returns ``(slots, evicted_mask)`` or None if impossible.

        ``protect`` lists slots that must not be taken (objects the current
        batch re-publishes). Evicted slots are those in the result that held
        an object; the caller must unindex them before reuse.
        """
        if k == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
        n = self.slot_count
        if k > n:
            return None
        shield = np.zeros(n, dtype=bool) if len(protect) else None
        if shield is not None:
            shield[protect] = True
        chosen: list[np.ndarray] = []
        found = 0
        hand = self.hand
        swept = 0
        window = max(4 * k, 1024)
        refs = self.referenced.copy()
        while found < k and swept < 2 * n + window:
            lo = hand
            hi = min(n, lo + window)
            idx = np.arange(lo, hi)
            free = ~self.occupied[lo:hi]
            evictable = self.occupied[lo:hi] & (self.pins[lo:hi] == 0) & ~refs[lo:hi]
            ok = free | evictable
            if shield is not None:
                ok &= ~shield[lo:hi]
            picks = idx[ok][: k - found]
            if len(picks):
                chosen.append(picks)
                found += len(picks)
            stop = hi if found < k else int(picks[-1]) + 1
            # Second chance: slots passed over lose their reference bit.
            passed = idx[: stop - lo]
            refs[passed] = False
            swept += stop - lo
            hand = stop % n
        if found < k:
            return None
        slots = np.concatenate(chosen)
        self.referenced = refs
        self.hand = hand
        evicted = self.occupied[slots].copy()
        self.evictions += int(np.count_nonzero(evicted))
        return slots, evicted

    def fill(self, slots: np.ndarray) -> None:
        """Mark freshly written slots as holding objects."""
        self.occupied[slots] = True
        self.pins[slots] = 0
        self.referenced[slots] = True

    def release(self, slots: np.ndarray) -> None:
        """Mark slots empty (rolled back or dropped objects)."""
        self.occupied[slots] = False
        self.pins[slots] = 0
        self.referenced[slots] = False

    def touch(self, slots: np.ndarray) -> None:
        self.referenced[slots] = True

    def pin(self, slots: np.ndarray) -> None:
        np.add.at(self.pins, slots, 1)

    def unpin(self, slots: np.ndarray) -> np.ndarray:
        """Drop one pin per slot occurrence; returns which entries were pinned."""
        if len(np.unique(slots)) == len(slots):
            was = self.pins[slots] > 0
            self.pins[slots[was]] -= 1
            return was
        was = np.zeros(len(slots), dtype=bool)
        for i, s in enumerate(slots.tolist()):
            if self.pins[s] > 0:
                self.pins[s] -= 1
                was[i] = True
        return was
