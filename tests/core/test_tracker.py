"""RequestTracker: rank zero's capture -> buffer -> publish -> emit rules, without an engine."""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Iterator

import numpy as np
import pytest

from vllm_artifact.contract import EmittedRows, StepResult, TailBlock
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.keys import full_block_keys, tail_block_key
from vllm_artifact.core.publisher import BlockRun, PinChange, Publisher
from vllm_artifact.core.row_file import file_transport
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch, StepRows
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.tracker import RequestTracker

from .conftest import gil_releases, rows_for

BS = 16  # block size of the SMALL layout


Parts = tuple[RequestTracker, ShmStore, Publisher]


@pytest.fixture(params=[None, 1], ids=["thread", "inline"])
def tracker(shm_root: str, layout: R3Layout, request: pytest.FixtureRequest) -> Iterator[Parts]:
    """Each tracker test runs with every batch published on the thread, and with every batch
    of blocks written inline on the step thread (the engine writes a prefill step's so)."""
    store = ShmStore.create_or_open_writer(
        shm_root, "s", layout=layout, capacity_bytes=256 * layout.block_nbytes * 2
    )
    publisher = Publisher(store, inline_from_blocks=request.param)
    yield (
        RequestTracker(
            layout, "model", store, publisher, buffer_max_bytes=1 << 20, block_id=block_id
        ),
        store,
        publisher,
    )
    publisher.close()
    store.close()


TAIL_HASH = b"tail-hash".ljust(32, b".")


def block_id(block_hash: bytes) -> int:
    """The id evictions name a KV block by (the integration's is vLLM's; any will do here)."""
    return int.from_bytes(block_hash[:8], "little")


def batch_of(entries: list[StepRows]) -> StepBatch:
    """A step from per-request entries (the worker connector builds it column-wise)."""
    lengths = np.array([len(entry.rows) for entry in entries], dtype=np.int64)
    ends = np.cumsum(lengths)
    return StepBatch(
        [entry.request_id for entry in entries],
        np.array([entry.token_start for entry in entries], dtype=np.int64),
        np.array([entry.num_scheduled for entry in entries], dtype=np.int64),
        ends - lengths,
        ends,
        np.array([entry.sampled for entry in entries], dtype=bool),
        np.concatenate([entry.rows for entry in entries]),
    )


def entry_of(result: StepResult, request_id: str) -> EmittedRows | R3Failure | None:
    """The request's rows or failure in a step result, as the scheduler finds them."""
    entry = result.entries.get(request_id)
    if entry is not None:
        return entry
    found = result.rows_by_id().get(request_id)
    return None if found is None else EmittedRows(*found)


def tracked(t: RequestTracker, request_id: str) -> bool:
    """The tracker still holds state for the request (not torn down yet)."""
    return request_id in t._requests


def hashes(tag: str, n: int) -> list[bytes]:
    """Block-hash-like bytes (vLLM's are sha256 digests)."""
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def step(
    t: RequestTracker, request_id: str, start: int, rows: np.ndarray, *, sampled: bool = True
) -> EmittedRows | R3Failure | None:
    t.step_started([request_id])
    out = t.step_finished(batch_of([StepRows(request_id, start, len(rows), rows, sampled)]))
    return entry_of(out, request_id)


def serve(
    t: RequestTracker,
    request_id: str,
    block_hashes: list[bytes],
    rows: np.ndarray,
    tail: TailBlock | None = None,
) -> None:
    """A request computed in one step and finished: its keyed full blocks get published."""
    t.admit(request_id, 0)
    t.add_block_hashes({request_id: block_hashes})
    step(t, request_id, 0, rows)
    t.finish(request_id, tail=tail)


def hit(
    t: RequestTracker, request_id: str, block_hashes: list[bytes], cached: int, rows: np.ndarray
) -> EmittedRows | R3Failure | None:
    """A request whose first ``cached`` tokens the KV cache serves; it computes ``rows``."""
    t.admit(request_id, 0)
    t.add_block_hashes({request_id: block_hashes})
    return step(t, request_id, cached, rows)


def test_chunked_prefill_then_decode_emits_every_row_once_and_publishes_keyed_blocks(
    tracker: Parts, layout: R3Layout
) -> None:
    t, store, publisher = tracker
    rows = rows_for(layout, 1, 40)
    t.admit("a", 0)
    t.add_block_hashes({"a": hashes("a", 2)})  # the prompt's full blocks are known up front
    assert step(t, "a", 0, rows[:20], sampled=False) is None  # prefill chunk: nothing emitted
    first = step(t, "a", 20, rows[20:36])  # last chunk samples: rows 0..35
    assert isinstance(first, EmittedRows) and first.token_start == 0
    np.testing.assert_array_equal(first.rows, rows[:36])
    for i in range(36, 40):  # decode: one row per step
        out = step(t, "a", i, rows[i : i + 1])
        assert isinstance(out, EmittedRows) and out.token_start == i
        np.testing.assert_array_equal(out.rows, rows[i : i + 1])
    keys = full_block_keys(t.namespace, hashes("a", 2))
    publisher.flush()
    out_rows = layout.empty(2 * BS)
    store.read_into(keys, out_rows)
    np.testing.assert_array_equal(out_rows, rows[: 2 * BS])


def test_prefix_hit_rows_come_from_the_store(tracker: Parts, layout: R3Layout) -> None:
    t, _, _ = tracker
    rows = rows_for(layout, 2, 2 * BS + 5)
    serve(t, "a", hashes("p", 2), rows)
    # Request b has the same prompt: the KV cache serves 2 blocks, b computes only the rest.
    out = hit(t, "b", hashes("p", 2), 2 * BS, rows[2 * BS :])
    assert isinstance(out, EmittedRows) and out.token_start == 0
    np.testing.assert_array_equal(out.rows, rows)
    assert t.reads == 2


@pytest.mark.parametrize("room", [None, 9, 10], ids=["no-room-asked", "room", "too-much-room"])
def test_a_prefix_hits_first_rows_are_a_file_with_room_where_the_scheduler_asks(
    tracker: Parts, layout: R3Layout, room: int | None
) -> None:
    """The hit rows and the computed ones go into one new array anyway: where the scheduler
    asks for room (a request it holds) and the room is small beside the rows (here 37 rows, so
    at most 9), that array is the data part of a file the frontend can adopt."""
    t, _, _ = tracker
    rows = rows_for(layout, 2, 2 * BS + 5)
    serve(t, "a", hashes("p", 2), rows)
    t.admit("b", 0, first_rows_room=room)
    t.add_block_hashes({"b": hashes("p", 2)})
    t.step_started(["b"])
    entries = [StepRows("b", 2 * BS, 5, rows[2 * BS :], True)]
    result = t.step_finished(batch_of(entries))
    out = entry_of(result, "b")
    assert isinstance(out, EmittedRows) and out.token_start == 0
    np.testing.assert_array_equal(out.rows, rows)
    file = result.files.get("b")
    assert (file is not None) == (room == 9)
    if file is not None:  # the rows lie in it, after the header's space, before the room
        sent = file_transport(file, out.rows)
        assert sent is not None and sent.nbytes == file.nbytes
        assert file.nbytes - out.rows.nbytes - 9 * layout.row_nbytes == 128
        # to another process (the worker's): the file once, the rows still its data part
        moved = pickle.loads(pickle.dumps(result))
        moved_rows = entry_of(moved, "b").rows  # type: ignore[union-attr]
        np.testing.assert_array_equal(moved_rows, rows)
        assert file_transport(moved.files["b"], moved_rows) is not None
        assert len(pickle.dumps(result)) < file.nbytes + 1024
    # only the first rows: the next step's are rows of their own
    t.step_started(["b"])
    later = t.step_finished(batch_of([StepRows("b", 2 * BS + 5, 1, rows[:1], True)]))
    assert not later.files


def test_requests_of_one_step_with_the_same_prefix_hit_read_it_once(
    tracker: Parts, layout: R3Layout
) -> None:
    """A group of samples of one prompt (or requests sharing a system prompt) arriving in
    one step: the first reads the store, the others copy its verified rows."""
    t, _, _ = tracker
    rows = rows_for(layout, 40, 3 * BS + 5)
    serve(t, "a", hashes("g", 3), rows)
    for rid in ("b", "c", "d"):
        t.admit(rid, 0)
        t.add_block_hashes({rid: hashes("g", 3)})
    t.step_started(["b", "c", "d"])
    out = t.step_finished(
        batch_of(
            [
                StepRows("b", 2 * BS, BS + 5, rows[2 * BS :], True),
                StepRows("c", 2 * BS, BS + 5, rows[2 * BS :], True),
                StepRows("d", 3 * BS, 5, rows[3 * BS :], True),  # a longer hit: its own read
            ]
        )
    )
    for rid in ("b", "c", "d"):
        emitted = entry_of(out, rid)
        assert isinstance(emitted, EmittedRows) and emitted.token_start == 0
        np.testing.assert_array_equal(emitted.rows, rows)
    assert t.reads == 2 + 3  # b's two blocks, d's three; c copied b's


@pytest.mark.parametrize(("emit_start", "cached"), [(5, 2 * BS), (0, 2 * BS - 3), (20, 2 * BS)])
def test_prefix_hit_rows_from_mid_block_positions(
    tracker: Parts, layout: R3Layout, emit_start: int, cached: int
) -> None:
    """Rows asked from inside a block (routed_experts_prompt_start) or a hit that ends inside
    a block (a partial external hit): the store's blocks are cut to the span."""
    t, _, _ = tracker
    rows = rows_for(layout, 3, 2 * BS + 5)
    serve(t, "a", hashes("p", 2), rows)
    t.admit("b", emit_start)
    t.add_block_hashes({"b": hashes("p", 2)})
    out = step(t, "b", cached, rows[cached:])
    assert isinstance(out, EmittedRows) and out.token_start == emit_start
    np.testing.assert_array_equal(out.rows, rows[emit_start:])


def test_missing_object_fails_only_that_request(tracker: Parts, layout: R3Layout) -> None:
    t, _, _ = tracker
    t.admit("hit", 0, first_rows_room=0)  # its rows would have been a file
    t.add_block_hashes({"hit": hashes("never-published", 1)})
    t.admit("ok", 0)
    t.step_started(["hit", "ok"])
    results = t.step_finished(
        batch_of(
            [
                StepRows("hit", BS, 3, rows_for(layout, 3, 3), True),
                StepRows("ok", 0, 3, rows_for(layout, 4, 3), True),
            ]
        )
    )
    failure = entry_of(results, "hit")
    assert isinstance(failure, R3Failure) and failure.reason == "missing"
    assert "Increase --artifact-capacity" in failure.message
    assert "hit" not in results.files
    assert isinstance(entry_of(results, "ok"), EmittedRows)
    # The failure is reported once; later steps of the failed request return nothing.
    assert step(t, "hit", BS + 3, rows_for(layout, 5, 1)) is None


def test_missing_after_weight_update_says_to_reset_the_prefix_cache(
    tracker: Parts, layout: R3Layout
) -> None:
    t, _, _ = tracker
    rows = rows_for(layout, 6, BS + 2)
    serve(t, "a", hashes("w", 1), rows)
    assert t.set_weight_version("v2")
    failure = hit(t, "b", hashes("w", 1), BS, rows[BS:])  # same tokens, keys of the new version
    assert isinstance(failure, R3Failure) and failure.reason == "missing"
    assert "reset the prefix cache" in failure.message


def test_optimistic_step_after_rejected_drafts_reattaches(tracker: Parts, layout: R3Layout) -> None:
    t, _, _ = tracker
    rows = rows_for(layout, 7, 12)
    t.admit("a", 0)
    step(t, "a", 0, rows[:8])
    # Step scheduled 1 token + 3 drafts at 8; 2 drafts were rejected (caller cut them).
    t.step_started(["a"])
    out = entry_of(t.step_finished(batch_of([StepRows("a", 8, 4, rows[8:10], True)])), "a")
    assert isinstance(out, EmittedRows) and out.token_start == 8
    # Async scheduling planned the next step from 12 (all drafts accepted), the model ran it
    # from 10: rows continue right after the last captured one.
    out = step(t, "a", 12, rows[10:12])
    assert isinstance(out, EmittedRows) and out.token_start == 10
    np.testing.assert_array_equal(out.rows, rows[10:12])


def test_a_real_gap_fails_the_request(tracker: Parts, layout: R3Layout) -> None:
    t, _, _ = tracker
    t.admit("a", 0)
    step(t, "a", 0, rows_for(layout, 8, 4))
    failure = step(t, "a", 9, rows_for(layout, 9, 1))
    assert isinstance(failure, R3Failure) and "never captured" in failure.message


def test_malformed_rows_fail_the_request_instead_of_raising(
    tracker: Parts, layout: R3Layout
) -> None:
    t, _, _ = tracker
    t.admit("a", 0)
    failure = step(t, "a", 0, np.zeros((3, 2, 2), dtype=np.uint8))
    assert isinstance(failure, R3Failure)


def test_finish_waits_for_steps_in_flight(tracker: Parts, layout: R3Layout) -> None:
    t, _, _ = tracker
    t.admit("a", 0)
    t.step_started(["a"])
    t.finish("a")  # aborted while its step runs
    assert tracked(t, "a")
    out = t.step_finished(batch_of([StepRows("a", 0, 2, rows_for(layout, 10, 2), True)]))
    assert isinstance(entry_of(out, "a"), EmittedRows)
    assert not tracked(t, "a")


def test_finish_waits_for_every_step_in_flight(tracker: Parts, layout: R3Layout) -> None:
    """Async scheduling: two steps of a request run when it is aborted; it stays until the
    last of them ends (whatever id lists the steps carry)."""
    t, _, _ = tracker
    t.admit("a", 0)
    t.admit("b", 0)
    first, second = ["a", "b"], ["b", "a"]
    t.step_started(first)
    t.step_started(second)
    t.finish("a")
    rows = rows_for(layout, 10, 3)
    out = t.step_finished(
        batch_of([StepRows("a", 0, 2, rows[:2], True), StepRows("b", 0, 2, rows[:2], True)])
    )
    assert isinstance(entry_of(out, "a"), EmittedRows) and tracked(t, "a")
    out = t.step_finished(
        batch_of([StepRows("b", 2, 1, rows[2:], True), StepRows("a", 2, 1, rows[2:], True)])
    )
    assert entry_of(out, "a").token_start == 2 and not tracked(t, "a") and tracked(t, "b")


def test_normal_finish_publishes_the_terminal_partial_block(
    tracker: Parts, layout: R3Layout
) -> None:
    t, store, publisher = tracker
    rows = rows_for(layout, 11, BS + 5)
    serve(t, "a", hashes("t", 1), rows, tail=TailBlock(TAIL_HASH, BS, 5))
    assert t.tails_published == 1
    hit(t, "b", hashes("t", 1), BS, rows[BS:])  # its read waits only for the block it reads
    publisher.flush()
    key = tail_block_key(t.namespace, TAIL_HASH, 5)
    (tail,) = store.get([key])
    np.testing.assert_array_equal(tail, rows[BS:])


def submissions_of(publisher: Publisher, monkeypatch: pytest.MonkeyPatch) -> list[list]:
    """What ``publisher.submit`` is given from now on (it still publishes)."""
    seen: list[list] = []
    submit = publisher.submit

    def recording(runs: list) -> None:
        seen.append(list(runs))
        submit(runs)

    monkeypatch.setattr(publisher, "submit", recording)
    return seen


def test_tails_of_one_steps_finished_requests_go_in_one_submission(
    tracker: Parts, layout: R3Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill-heavy step finishes many requests: one store batch for their tails, not one
    each (the scheduler's finishes arrive together, and so do the teardowns of requests that
    finished while their step ran)."""
    t, store, publisher = tracker
    rows = {rid: rows_for(layout, 20 + i, BS + 5) for i, rid in enumerate("abcd")}
    tails = {rid: TailBlock(hashlib.sha256(rid.encode()).digest(), BS, 5) for rid in rows}
    for rid in "abcd":
        t.admit(rid, 0)
        t.add_block_hashes({rid: hashes(rid, 1)})
    seen = submissions_of(publisher, monkeypatch)
    t.step_started(["a", "b"])
    t.step_finished(batch_of([StepRows(r, 0, BS + 5, rows[r], True) for r in "ab"]))
    t.step_started(["c", "d"])
    tail_keys = {rid: [tail_block_key(t.namespace, tails[rid].hash, 5)] for rid in rows}

    def tail_submissions() -> list[list[list]]:
        return [
            [run.keys for run in runs]
            for runs in seen
            if any(run.keys in tail_keys.values() for run in runs)
        ]

    t.finish_all((rid, tails[rid]) for rid in "ab")  # not in flight: torn down at once
    t.finish_all((rid, tails[rid]) for rid in "cd")  # in flight: torn down by step_finished
    assert tail_submissions() == [[tail_keys["a"], tail_keys["b"]]]
    t.step_finished(batch_of([StepRows(r, 0, BS + 5, rows[r], True) for r in "cd"]))
    assert tail_submissions()[1:] == [[tail_keys["c"], tail_keys["d"]]]
    assert t.tails_published == 4 and not any(tracked(t, rid) for rid in "abcd")
    publisher.flush()
    for rid in "abcd":
        (tail,) = store.get([tail_block_key(t.namespace, tails[rid].hash, 5)])
        np.testing.assert_array_equal(tail, rows[rid][BS:])


def test_a_prefill_chunks_blocks_are_published_without_a_copy(
    tracker: Parts, layout: R3Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks one step completes lie back to back in the array the buffer hands out: they
    go to the publisher as one view of it; blocks from different steps are joined by a copy."""
    t, store, publisher = tracker
    rows = rows_for(layout, 30, 6 * BS + 1)
    t.admit("a", 0)
    seen = submissions_of(publisher, monkeypatch)
    step(t, "a", 0, rows[: 3 * BS + 2], sampled=False)  # blocks 0-2 complete, unkeyed
    step(t, "a", 3 * BS + 2, rows[3 * BS + 2 :])  # blocks 3-5 complete in another array
    t.add_block_hashes({"a": hashes("chunk", 6)})  # their hashes arrive: one run of six blocks
    (run,) = [run for s in seen for run in s if isinstance(run, BlockRun)]
    assert run.keys == full_block_keys(t.namespace, hashes("chunk", 6))
    np.testing.assert_array_equal(run.rows, rows[: 6 * BS])
    t.finish("a")
    seen.clear()
    t.admit("b", 0)
    step(t, "b", 0, rows, sampled=False)  # six blocks in one array
    t.add_block_hashes({"b": hashes("chunk-b", 6)})
    (run,) = [run for s in seen for run in s if isinstance(run, BlockRun)]
    assert run.rows.base is not None and run.rows.flags.c_contiguous  # a view, no copy
    np.testing.assert_array_equal(run.rows, rows[: 6 * BS])
    publisher.flush()
    out = layout.empty(6 * BS)
    store.read_into(full_block_keys(t.namespace, hashes("chunk-b", 6)), out)
    np.testing.assert_array_equal(out, rows[: 6 * BS])


@pytest.mark.parametrize("extra", [1, 3, BS - 5, BS + 2])
def test_tail_ignores_rows_past_the_schedulers_last_token(
    tracker: Parts, layout: R3Layout, extra: int
) -> None:
    """Speculative decoding can verify drafts past ``max_tokens``; vLLM drops those tokens
    but rank zero captured their rows (possibly completing the tail's block, or more)."""
    t, store, publisher = tracker
    rows = rows_for(layout, 13, BS + 5 + extra)
    serve(t, "a", hashes("s", 1), rows, tail=TailBlock(TAIL_HASH, BS, 5))
    assert t.tails_published == 1 and not tracked(t, "a")
    publisher.flush()
    (tail,) = store.get([tail_block_key(t.namespace, TAIL_HASH, 5)])
    np.testing.assert_array_equal(tail, rows[BS : BS + 5])


def test_tail_after_a_gap_is_not_published(tracker: Parts, layout: R3Layout) -> None:
    """Rows of the tail exist, but an earlier block never got its hash: no tail object."""
    t, _, _ = tracker
    rows = rows_for(layout, 14, 2 * BS + 5)
    serve(t, "a", hashes("g", 1), rows, tail=TailBlock(TAIL_HASH, 2 * BS, 5))
    assert t.tails_published == 0 and not tracked(t, "a")


def test_abort_keeps_published_blocks_and_drops_the_rest(tracker: Parts, layout: R3Layout) -> None:
    t, _, _ = tracker
    rows = rows_for(layout, 12, BS + 5)
    serve(t, "a", hashes("x", 1), rows)  # aborted: no tail
    assert t.tails_published == 0 and not tracked(t, "a")
    out = hit(t, "b", hashes("x", 1), BS, rows[BS:])
    assert isinstance(out, EmittedRows)
    np.testing.assert_array_equal(out.rows, rows)


def test_a_steps_start_hands_blocks_unpins_and_tails_over_as_one_submission(
    tracker: Parts, layout: R3Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a step's start the scheduler's updates (newly keyed blocks, evictions, finished
    requests) reach the publisher as one batch, in that order: one wake-up of its thread."""
    t, store, publisher = tracker
    a_hashes, b_hashes = hashes("join-a", 3), hashes("join-b", 2)
    a_rows, b_rows = rows_for(layout, 31, 3 * BS + 5), rows_for(layout, 32, 2 * BS)
    t.admit("a", 0)
    t.add_block_hashes({"a": a_hashes})
    step(t, "a", 0, a_rows)
    t.admit("b", 0)
    step(t, "b", 0, b_rows)  # its blocks wait for their hashes
    publisher.flush()
    assert store.stats().pinned_objects == 3
    seen = submissions_of(publisher, monkeypatch)
    with t.one_submission():
        t.add_block_hashes({"b": b_hashes})
        t.kv_evicted([block_id(a_hashes[0])])
        t.finish_all([("a", TailBlock(TAIL_HASH, 3 * BS, 5))])
        assert seen == []  # nothing before the end: a read inside would miss these keys
    a_keys, b_keys = (full_block_keys(t.namespace, h) for h in (a_hashes, b_hashes))
    tail_key = tail_block_key(t.namespace, TAIL_HASH, 5)
    ((*runs,),) = seen
    assert [(type(run).__name__, list(run.keys)) for run in runs] == [
        ("BlockRun", b_keys),
        ("PinChange", b_keys),
        ("PinChange", a_keys[:1]),
        ("BlockRun", [tail_key]),
    ]
    assert [run.pin for run in runs if isinstance(run, PinChange)] == [True, False]
    publisher.flush()
    assert store.stats().pinned_objects == 4  # a's last two blocks and b's two
    np.testing.assert_array_equal(np.concatenate(store.get(b_keys)), b_rows)
    (tail,) = store.get([tail_key])
    np.testing.assert_array_equal(tail, a_rows[3 * BS :])


def test_objects_stay_pinned_until_the_kv_cache_evicts_their_block(
    tracker: Parts, layout: R3Layout
) -> None:
    t, store, publisher = tracker
    block_hashes = hashes("pin", 3)
    t.admit("a", 0)
    t.add_block_hashes({"a": block_hashes})
    step(t, "a", 0, rows_for(layout, 13, 3 * BS + 1))
    publisher.flush()
    assert store.stats().pinned_objects == 3
    # Evictions name KV blocks by the id ``block_id`` gives their hash.
    t.kv_evicted([block_id(block_hashes[0]), block_id(block_hashes[1])])
    publisher.flush()
    assert store.stats().pinned_objects == 1
    t.kv_evicted([block_id(b"a block we never saw".ljust(32, b"."))])  # ignored
    publisher.flush()
    assert store.stats().pinned_objects == 1
    t.kv_cleared()
    publisher.flush()
    assert store.stats().pinned_objects == 0
    # Unpinned objects stay readable until space is needed.
    assert store.exists(full_block_keys(t.namespace, block_hashes)) == [True, True, True]


@pytest.mark.parametrize("seed", range(12))
def test_batched_steps_mixing_decode_drafts_chunks_and_hits_equal_the_truth(
    tracker: Parts, layout: R3Layout, seed: int
) -> None:
    """Several requests share each step; most steps are plain decode (the vectorized path),
    others draft tokens with rejections, prefill chunks or start with a prefix hit (the
    general path), switching back and forth. Every request's emitted rows are exactly its
    true rows, each once, and every published block equals the truth."""
    t, store, publisher = tracker
    rng = np.random.default_rng(seed)
    total = 6 * BS + 3
    truth = {f"r{i}": rows_for(layout, 100 * seed + i, total) for i in range(4)}
    truth["hit"] = truth["r0"].copy()  # same prompt as r0: its first blocks come from the store
    block_hashes = {rid: hashes(f"{seed}-{rid}", total // BS) for rid in truth}
    block_hashes["hit"] = block_hashes["r0"]
    position = dict.fromkeys(truth, 0)  # next token to compute
    emitted: dict[str, list[np.ndarray]] = {rid: [] for rid in truth}
    hashed = dict.fromkeys(truth, 0)
    running = ["r0", "r1", "r2", "r3"]
    paths = {"vectorized": 0, "general": 0}  # rows emitted by each path of step_finished
    for rid in running:
        t.admit(rid, 0)
    step_no = 0
    while running:
        step_no += 1
        if step_no == 12:  # r0 published its first blocks by now: "hit" starts on them
            cached = min(hashed["r0"], 3) * BS
            t.admit("hit", 0)
            position["hit"] = cached
            running.append("hit")
        for rid in running:  # hashes of blocks completed in earlier steps arrive now
            full = min(position[rid] // BS, len(block_hashes[rid]))
            if full > hashed[rid]:
                t.add_block_hashes({rid: block_hashes[rid][hashed[rid] : full]})
                hashed[rid] = full
        entries = []
        for rid in running:
            pos = position[rid]
            kind = rng.choice(["decode"] * 6 + ["draft", "chunk"]) if pos else "chunk"
            if kind == "decode":
                scheduled, kept, sampled = 1, 1, True
            elif kind == "draft":  # 1-3 drafts, some rejected: their rows are cut
                scheduled = 1 + int(rng.integers(1, 4))
                kept, sampled = 1 + int(rng.integers(0, scheduled)), True
            else:  # a prefill chunk, the last one samples
                scheduled = kept = int(rng.integers(2, 2 * BS))
                sampled = bool(rng.integers(0, 2))
            kept = min(kept, total - pos)
            scheduled = max(min(scheduled, total - pos), kept)
            sampled = sampled or pos + kept == total
            entries.append(StepRows(rid, pos, scheduled, truth[rid][pos : pos + kept], sampled))
            position[rid] = pos + kept
        t.step_started([entry.request_id for entry in entries])
        result = t.step_finished(batch_of(entries))
        assert not result.failures()
        paths["vectorized"] += len(result.decode_ids)
        paths["general"] += len(result.entries)
        for rid in list(running):
            found = result.rows_by_id().get(rid)
            if found is not None:
                token_start, rows = found
                assert token_start == sum(len(r) for r in emitted[rid])
                emitted[rid].append(rows)
            if position[rid] == total and found is not None:
                t.add_block_hashes({rid: block_hashes[rid][hashed[rid] :]})  # sent with the finish
                t.finish(rid)
                running.remove(rid)
    publisher.flush()
    for rid, rows in truth.items():
        np.testing.assert_array_equal(np.concatenate(emitted[rid]), rows)
        keys = full_block_keys(t.namespace, block_hashes[rid])
        out = layout.empty(len(keys) * BS)
        store.read_into(keys, out)
        np.testing.assert_array_equal(out, rows[: len(keys) * BS])
    assert t.reads > 0  # the hit request's prefix came from the store
    assert paths["vectorized"] > 20 and paths["general"] > 10


class _RecordingPublisher:
    """Takes submissions without a thread: the GIL test below must have no other thread
    wanting the GIL but its spinner."""

    def __init__(self) -> None:
        self.submitted: list[list[object]] = []

    def submit(self, runs: list[object]) -> None:
        self.submitted.append(list(runs))

    def flush(self, keys: object = None, timeout: float = 30.0) -> None:
        pass


def test_steady_decode_steps_keep_the_gil(shm_root: str) -> None:
    """A 256-request decode step of a DeepSeek-V3-sized layout, blocks completing and being
    keyed and published along the way, never releases the GIL: on rank zero a release hands
    it to the publisher thread, and the step thread may then wait up to the switch interval
    (5 ms) to get it back (docs/design.md, "The step path keeps the GIL")."""
    # The spinner sees a release only when it wins the race for the GIL (a few percent of
    # releases): enough steps that one release per step would be seen all but surely.
    steps = 10 * BS
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=BS)
    store = ShmStore.create_or_open_writer(shm_root, "gil", layout=layout, capacity_bytes=64 << 20)
    publisher = _RecordingPublisher()
    t = RequestTracker(
        layout,
        "model",
        store,
        publisher,  # type: ignore[arg-type]
        buffer_max_bytes=64 << 20,
        block_id=block_id,
    )
    n = 256
    ids = [f"r{i}" for i in range(n)]
    rng = np.random.default_rng(0)
    # Prompts of 1..16 tokens, so blocks complete spread over the steps.
    position = np.array([1 + i % BS for i in range(n)], dtype=np.int32)
    hashed = dict.fromkeys(ids, 0)
    for i, rid in enumerate(ids):
        t.admit(rid, 0)
        step(t, rid, 0, rng.integers(0, 256, (int(position[i]), 58, 8), dtype=np.uint8))
    ones = np.ones(n, dtype=np.int32)
    with gil_releases() as count:
        releases = 0
        for _ in range(steps):
            # The scheduler's facts: hashes of blocks whose tokens are all known.
            new = {
                rid: hashes(rid, (int(position[i]) + 1) // BS)[hashed[rid] :]
                for i, rid in enumerate(ids)
                if (int(position[i]) + 1) // BS > hashed[rid]
            }
            for rid, block_hashes in new.items():
                hashed[rid] += len(block_hashes)
            rows = rng.integers(0, 256, (n, 58, 8), dtype=np.uint8)
            batch = StepBatch(
                ids,
                position.copy(),
                ones,
                np.arange(n, dtype=np.int32),
                np.arange(1, n + 1, dtype=np.int32),
                ones > 0,
                rows,
            )
            before = count[0]
            t.add_block_hashes(new)
            t.step_started(ids)
            result = t.step_finished(batch)
            releases += count[0] - before
            assert len(result.decode_ids) == n and not result.entries
            position += 1
    assert releases == 0
    published = sum(
        len(run.keys) for runs in publisher.submitted for run in runs if isinstance(run, BlockRun)
    )
    assert published >= steps // BS * n  # every request completed a block every BS steps
    store.close()


def test_prefill_steps_with_prefix_hits_keep_the_gil(shm_root: str) -> None:
    """8,192-token prefill steps of the GPU harness's shape (16 requests a step, each a
    1,536-token prefix hit read from the store and 513 computed rows, DeepSeek-V3-sized
    layout) never release the GIL: the computed rows are buffered, published and joined
    with the hit's rows in copies of at most 500 items (``copy_rows_into``)."""
    layout = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=BS)
    hit_tokens, computed, per_step, steps = 96 * BS, 513, 16, 8
    store = ShmStore.create_or_open_writer(shm_root, "gil", layout=layout, capacity_bytes=64 << 20)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, (hit_tokens + computed, 58, 8), dtype=np.uint8)
    prefix = hashes("prefix", hit_tokens // BS)
    publisher = Publisher(store)
    first = RequestTracker(
        layout, "model", store, publisher, buffer_max_bytes=64 << 20, block_id=block_id
    )
    serve(first, "first", prefix, prompt[:hit_tokens])
    publisher.flush()
    publisher.close()
    t = RequestTracker(
        layout,
        "model",
        store,
        _RecordingPublisher(),  # type: ignore[arg-type]
        buffer_max_bytes=64 << 20,
        block_id=block_id,
    )
    own = computed // BS
    with gil_releases() as count:
        releases = 0
        for s in range(steps):
            ids = [f"s{s}r{i}" for i in range(per_step)]
            block_hashes = {rid: prefix + hashes(rid, own) for rid in ids}
            batch = batch_of(
                [StepRows(rid, hit_tokens, computed, prompt[hit_tokens:], True) for rid in ids]
            )
            before = count[0]
            for rid in ids:
                t.admit(rid, 0)
            t.add_block_hashes(block_hashes)
            t.step_started(ids)
            result = t.step_finished(batch)
            releases += count[0] - before
            for rid in ids:
                emitted = entry_of(result, rid)
                assert isinstance(emitted, EmittedRows) and emitted.token_start == 0
                np.testing.assert_array_equal(emitted.rows, prompt)
                t.finish(rid)  # its buffer slot goes to a later request (no growth)
    assert releases == 0
    store.close()


def test_a_keys_handles_objects_are_leased_then_released(shm_root: str, layout: R3Layout) -> None:
    """A finished keys-only request (``leased``) keeps its full blocks and its tail pinned for
    the lease, even after the KV cache evicted its blocks; another request's are not leased.
    When the lease ends its objects can be evicted again."""
    store = ShmStore.create_or_open_writer(
        shm_root, "s", layout=layout, capacity_bytes=64 * layout.block_nbytes * 2
    )
    publisher = Publisher(store)
    t = RequestTracker(
        layout,
        "model",
        store,
        publisher,
        buffer_max_bytes=1 << 20,
        block_id=block_id,
        lease_seconds=0.5,
    )
    try:
        for rid in ("keys", "array"):
            t.admit(rid, 0)
            t.add_block_hashes({rid: hashes(rid, 2)})
            step(t, rid, 0, rows_for(layout, 7, 2 * BS + 5))
        tail = TailBlock(TAIL_HASH, 2 * BS, 5)
        t.finish_all([("keys", tail), ("array", tail)], leased={"keys"})
        t.kv_evicted([block_id(h) for rid in ("keys", "array") for h in hashes(rid, 2)])
        publisher.flush()
        leased = [*full_block_keys(t.namespace, hashes("keys", 2))]
        leased.append(tail_block_key(t.namespace, TAIL_HASH, 5))
        assert publisher.leased_objects == 3
        assert store.stats().pinned_objects == 3
        assert store.unpin(leased) == [True] * 3  # exactly the handle's objects were pinned
        store.pin(leased)
    finally:
        publisher.flush()
    deadline = time.monotonic() + 10
    while publisher.leased_objects and time.monotonic() < deadline:
        time.sleep(0.05)
    assert publisher.leased_objects == 0 and store.stats().pinned_objects == 0
    publisher.close()
    store.close()
