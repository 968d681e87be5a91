"""One step's scheduler facts as rank zero's tracker applies them, in plain picklable types.

The worker connector turns vLLM's step metadata into :class:`StepFacts` and either applies
them to its own :class:`~vllm_artifact.core.tracker.RequestTracker` or sends them to the
tracker process (``integration/tracker_process.py``), which applies them the same way: one
function, :func:`apply_step_facts`, for both, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from vllm_artifact.contract import TailBlock
from vllm_artifact.core.tracker import RequestTracker

__all__ = ["HashRun", "StepFacts", "apply_step_facts"]


class HashRun:
    """A request's new KV block hashes, packed end to end (as vLLM sends them to workers)."""

    __slots__ = ("data", "item_size")

    def __init__(self, data: bytes, item_size: int) -> None:
        self.data = data
        self.item_size = item_size

    def __iter__(self) -> Iterator[bytes]:
        data, size = self.data, self.item_size
        return (data[at : at + size] for at in range(0, len(data), size))

    def __reduce__(self) -> tuple[type[HashRun], tuple[bytes, int]]:
        return HashRun, (self.data, self.item_size)


@dataclass
class StepFacts:
    """What rank zero learns from the scheduler at a step's start (``begin_step``)."""

    weight_version: str
    #: vLLM's prefix-cache generation: a new one means every request was forgotten.
    generation: int
    #: Newly scheduled requests and the first token whose rows each gets.
    admitted: Mapping[str, int] = field(default_factory=dict)
    block_hashes: Mapping[str, Iterable[bytes]] = field(default_factory=dict)
    kv_cleared: bool = False
    kv_evicted: list[int] = field(default_factory=list)
    finished: tuple[str, ...] = ()
    tails: Mapping[str, TailBlock] = field(default_factory=dict)
    leases: frozenset[str] = frozenset()
    #: Admitted requests whose first rows may be a file with room for this many more.
    first_rows_room: Mapping[str, int] = field(default_factory=dict)


def apply_step_facts(tracker: RequestTracker, facts: StepFacts, generation: int) -> bool:
    """Apply ``facts`` (``generation``: the last one applied; a change resets the tracker);
    True if the weight version changed. The caller serializes calls on ``tracker``."""
    with tracker.one_submission():
        changed = tracker.set_weight_version(facts.weight_version)
        if facts.generation != generation:
            tracker.reset()  # vLLM resets the prefix cache only with no output in flight
        room = facts.first_rows_room
        for request_id, emit_start in facts.admitted.items():
            tracker.admit(request_id, int(emit_start), room.get(request_id))
        tracker.add_block_hashes(facts.block_hashes)
        # After publishing (and pinning) newly keyed blocks: a block may be evicted already.
        if facts.kv_cleared:
            tracker.kv_cleared()
        tracker.kv_evicted(facts.kv_evicted)
        tails = facts.tails
        tracker.finish_all(((rid, tails.get(rid)) for rid in facts.finished), leased=facts.leases)
    return changed
