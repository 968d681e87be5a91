"""Mooncake Store faults under a running engine (``--artifact-backend mooncake``), against real
``mooncake_master`` and ``mooncake_client`` processes on loopback. This module's masters are
its own, so killing one touches no other module.

* The master is SIGKILLed: a prefix hit, whose R3 must come from Mooncake, fails closed
  (``unavailable``) within seconds; a fresh prompt still gets its R3 from capture (its
  publication fails in the background); the engine lives on. After a restart the client
  mounts its segment again, new prompts are published and hit again, and prompts published
  before the crash fail closed as ``missing`` (a restarted master has lost every object).
* The store node that holds the objects of an engine adding no memory
  (``--artifact-mooncake-segment 0``) dies: hits on its objects fail closed (``missing``),
  fresh prompts are answered from capture but cannot be published (no segment is left:
  ``capacity``), and a new store node makes the engine publish again.
* The engine's 16 MiB segment fills with hard-pinned objects: prompts still answer from
  capture, publications that find no room fail (``capacity``), later hits on those blocks
  fail closed (``missing``) while hits on blocks published before keep working.

Every completion that returns R3 is checked against the transformers oracle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import assert_matches_oracle
from vllm_artifact_testing.mooncake_master import (
    MooncakeMaster,
    mooncake_master,
    mooncake_store_node,
)

from vllm_artifact.client import r3_failure
from vllm_artifact.core.envelope import HEADER_NBYTES
from vllm_artifact.core.failure import R3Failure

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK = 32  # ENGINE_KWARGS' block size
#: A request may take this long while the store is down (a dead master's RPCs fail after
#: ~4.3 s); anything longer is a hang.
BOUND_S = 60.0
#: How long the engine's Mooncake client may take to mount its segment again.
RECOVERY_S = 30.0
MiB = 1 << 20


def prompt(tag: str, sentences: int = 12) -> str:
    """A prompt that shares no KV block with the others: the tag leads."""
    body = " ".join(f"{tag} sentence {i} routes to expert {i * 7 % 8}." for i in range(sentences))
    return f"{tag}: {body}"


def engine_settings(master: MooncakeMaster, root: Path, **overrides: Any) -> dict[str, Any]:
    """A Mooncake-backed engine; ``root`` holds its store's local files (its metrics), never
    the user's default root."""
    return {
        "artifact_root": str(root),
        "artifact_backend": "mooncake",
        "artifact_mooncake_master": master.master_address,
        "artifact_mooncake_metadata": master.metadata_url,
        "artifact_mooncake_host": "127.0.0.1",
        **overrides,
    }


def capture_publisher_log(llm: Any) -> None:
    """Keep the worker's publisher warnings and errors (on the worker, for
    :func:`publisher_probe`): what the engine logs when a publication fails."""

    def install(worker: Any) -> None:
        import logging

        records: list[str] = []
        handler = logging.Handler(level=logging.WARNING)
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("vllm.artifact.publisher").addHandler(handler)
        worker.fault_test_log = records

    llm.collective_rpc(install)


def publisher_probe(llm: Any) -> dict[str, Any]:
    """The rank-zero worker's publisher after its queue drained: failed batches, published
    objects, the store's value size and the publisher log kept so far."""

    def probe(worker: Any) -> dict[str, Any]:
        connector = worker.model_runner.aux_output_connector
        if connector is None or connector.store is None:
            return {}
        connector.flush_publications()
        publisher = connector._publisher
        stats = connector.store.stats()
        return {
            "objects": stats.objects,  # stored by this engine and not removed
            "pinned": stats.pinned_objects,
            "failures": publisher.failures,
            "published": publisher.published_objects,
            "inline": publisher.inline_from_blocks,  # a network store: None (publisher.py)
            "stride": connector.store.value_stride,
            "log": list(getattr(worker, "fault_test_log", [])),
        }

    return next(s for s in llm.collective_rpc(probe) if s)


def engine_alive(llm: Any) -> bool:
    processes = llm.llm_engine.engine_core.resources.engine_manager.processes
    for process in processes:
        try:
            if psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
    return bool(processes)


def generate_bounded(llm: Any, text: str, limit: float = BOUND_S) -> tuple[Any, float]:
    """One greedy completion, failing the test if ``generate`` has not returned within
    ``limit`` seconds (the thread is left behind: the engine is hung anyway)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["outputs"] = llm.generate([text], GREEDY, use_tqdm=False)
        except BaseException as error:  # handed to the test thread
            result["error"] = error

    thread = threading.Thread(target=run, name="bounded-generate", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(limit)
    elapsed = time.monotonic() - started
    assert not thread.is_alive(), f"generate did not return within {limit:.0f} s (a hang)"
    if "error" in result:
        raise result["error"]
    (output,) = result["outputs"]
    return output, elapsed


def generate(llm: Any, text: str) -> Any:
    return generate_bounded(llm, text)[0]


def assert_served(model: Path, output: Any) -> np.ndarray:
    completion = output.outputs[0]
    assert completion.finish_reason == "length", completion.stop_reason
    return assert_matches_oracle(model, output)


def assert_failed_closed(output: Any, *reasons: str) -> R3Failure:
    """The request failed as a whole, with an R3 failure of one of ``reasons``."""
    completion = output.outputs[0]
    assert completion.finish_reason == "error", (completion.finish_reason, completion.stop_reason)
    assert completion.routed_experts is None
    failure = r3_failure(completion.stop_reason)
    assert failure is not None and failure.reason in reasons, completion.stop_reason
    return failure


def logged_since(before: dict[str, Any], after: dict[str, Any]) -> str:
    return "\n".join(after["log"][len(before["log"]) :])


def wait_until_published(llm: Any, model: Path, tag: str) -> tuple[str, Any]:
    """Fresh prompts (each answered from capture, oracle-equal) until one is published
    without a failed publication: the engine's client writes to the store again. Returns
    that prompt and its completion."""
    deadline = time.monotonic() + RECOVERY_S
    for attempt in range(1000):
        before = publisher_probe(llm)
        text = prompt(f"{tag} {attempt}")
        output = generate(llm, text)
        assert_served(model, output)
        after = publisher_probe(llm)
        if after["failures"] == before["failures"] and after["published"] > before["published"]:
            return text, output
        assert time.monotonic() < deadline, (
            f"no publication succeeded within {RECOVERY_S:.0f} s:\n{logged_since(before, after)}"
        )
        time.sleep(0.5)
    raise AssertionError("unreachable")


def assert_hit_reads_back(llm: Any, model: Path, text: str, first: Any) -> None:
    """A repeat of ``text`` is a prefix hit whose R3 comes from Mooncake, equal to the first
    completion's and the oracle's."""
    again = generate(llm, text)
    assert again.num_cached_tokens >= BLOCK
    experts = assert_served(model, again)
    np.testing.assert_array_equal(experts, first.outputs[0].routed_experts)


# ----------------------------------------------------------------- engine on its own segment


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module")
def llm(model_a: Path, master: MooncakeMaster, store_root: Path, llm_factory: Any) -> Any:
    """An engine whose objects sit in its own segment, Mooncake's smallest (16 MiB)."""
    settings = engine_settings(master, store_root / "own-segment", artifact_capacity="16MiB")
    engine = llm_factory(model_a, **settings)
    capture_publisher_log(engine)
    return engine


@pytest.fixture
def serving_master(master: MooncakeMaster) -> MooncakeMaster:
    """The module's master, started again if an earlier test left it dead."""
    if not master.alive:
        master.start()
    return master


def test_killed_master_fails_hits_closed_serves_fresh_prompts_and_recovers(
    llm: Any, serving_master: MooncakeMaster, model_a: Path
) -> None:
    master = serving_master
    published = prompt("Before the crash")
    first = generate(llm, published)
    assert_served(model_a, first)
    before = publisher_probe(llm)  # its objects are in Mooncake now
    assert before["published"] > 0
    assert before["inline"] is None  # a dead master must not stall the step thread
    # A hit while the master serves (the engine's read staging buffer is registered by
    # then: what a serving engine's reads find when the master dies).
    assert_hit_reads_back(llm, model_a, published, first)

    master.kill()
    try:
        # The prompt's KV is cached, its R3 must be read from the dead master.
        hit, elapsed = generate_bounded(llm, published)
        failure = assert_failed_closed(hit, "unavailable")
        assert "master is unreachable" in failure.message
        assert elapsed < 20, f"the failed hit took {elapsed:.1f} s"
        # A fresh prompt's rows come from capture: it is answered in full while its
        # publication fails in the background (logged, later hits on it fail closed).
        fresh, elapsed = generate_bounded(llm, prompt("During the outage"))
        assert_served(model_a, fresh)
        assert elapsed < 20, f"a fresh prompt took {elapsed:.1f} s with the master down"
        during = publisher_probe(llm)
        assert during["failures"] > before["failures"]
        assert "R3 objects failed (unavailable)" in logged_since(before, during)
        assert engine_alive(llm)
    finally:
        master.restart()

    # The engine's client mounts its segment again by itself: new prompts are published
    # and their prefix hits read them back from the new master.
    text, output = wait_until_published(llm, model_a, "After the restart")
    assert_hit_reads_back(llm, model_a, text, output)
    # What was published before the crash is gone with the old master, although the KV
    # cache still holds the prompt: its hit fails closed, never partial.
    lost = generate(llm, published)
    failure = assert_failed_closed(lost, "missing")
    assert "not in store" in failure.message
    assert engine_alive(llm)


class Filler:
    """Another writer of the store, on Mooncake's own client (not the code under test), that
    adds no segment: its hard-pinned values land in the only segment, the engine's."""

    PREFIX = "fault-test-filler"

    def __init__(self, master: MooncakeMaster) -> None:
        from mooncake import store

        self._client = store.MooncakeDistributedStore()
        code = self._client.setup(
            "127.0.0.1", master.metadata_url, 0, 4 * MiB, "tcp", "", master.master_address
        )
        assert code == 0, f"filler client setup failed ({code})"
        self._config = store.ReplicateConfig()
        self._config.with_hard_pin = True
        self.names: list[str] = []

    def fill(self, value_bytes: int) -> None:
        """Put hard-pinned ``value_bytes`` values until not one more fits (batches that
        find no room may be stored in part, so the batches shrink down to one value)."""
        for batch in (2000, 100, 1):
            for _ in range(200):
                names = [f"{self.PREFIX}/{len(self.names) + i}" for i in range(batch)]
                self.names += names
                code = self._client.put_batch(names, [b"f" * value_bytes] * batch, self._config)
                if code != 0:
                    assert code == -200, f"filler put failed ({code}), not for lack of room"
                    break
            else:
                raise AssertionError(f"{len(self.names)} values did not fill the segment")

    def remove(self, names: list[str]) -> None:
        codes = self._client.batch_remove(names, True)
        assert all(code in (0, -704) for code in codes), set(codes)

    def close(self) -> None:
        self.remove(self.names)
        self._client.close()


def test_full_segment_fails_publication_and_later_hits_closed_engine_serves(
    llm: Any, serving_master: MooncakeMaster, model_a: Path
) -> None:
    """A 16 MiB segment holds ~52,000 objects of this model (320 bytes), more than its KV
    cache has blocks (16,384): the engine's own pins cannot fill it here. So another
    writer's hard-pinned values fill it but for the room of 40 objects, as a busier
    engine's pins would."""
    stride = publisher_probe(llm)["stride"]
    filler = Filler(serving_master)
    try:
        filler.fill(stride)
        filler.fill(HEADER_NBYTES + 8)  # room a one-token tail object would fit in, too
        filler.remove(filler.names[:40])  # 40 objects' room: the first full batch
        start = publisher_probe(llm)
        early = prompt("Early while full")  # 6 objects: they fit
        first = generate(llm, early)
        assert_served(model_a, first)
        before = publisher_probe(llm)
        assert before["failures"] == start["failures"], logged_since(start, before)
        # Long prompts (~35 blocks each) outgrow the room left: they are answered from
        # capture, their publications fail.
        late = [prompt(f"Late while full {i}", sentences=60) for i in range(3)]
        for text in late:
            output = generate(llm, text)
            assert len(output.prompt_token_ids) > 25 * BLOCK
            assert_served(model_a, output)
        after = publisher_probe(llm)
        assert after["failures"] > before["failures"]
        assert "R3 objects failed (capacity)" in logged_since(before, after)
        # Some blocks of a batch that found too little room were stored (hard-pinned in
        # Mooncake): each is pinned by the engine too, so the unpin when its KV block goes
        # removes it; none is left unaccounted for, filling the segment for good. Only a
        # request's tail object is stored unpinned (Mooncake may evict it): whether the late
        # ones' tails still found room depends on how the publisher batched their blocks.
        assert after["objects"] > before["objects"], "no late block fitted: nothing tested"
        unpinned = after["objects"] - after["pinned"] - (before["objects"] - before["pinned"])
        assert 0 <= unpinned <= len(late), (before, after)
        # Pinned objects are never evicted: the early prompt's hit reads them back.
        assert_hit_reads_back(llm, model_a, early, first)
        # The last long prompt found no room: its hit fails closed, not partially.
        lost = generate(llm, late[-1])
        assert_failed_closed(lost, "missing")
        assert engine_alive(llm)
    finally:
        filler.close()
    # Room again: publication resumes.
    text, output = wait_until_published(llm, model_a, "Room again")
    assert_hit_reads_back(llm, model_a, text, output)


# ---------------------------------------------------------- engine without a segment, store node


@pytest.fixture(scope="module")
def node_master() -> Iterator[MooncakeMaster]:
    with mooncake_master() as running:
        yield running


def test_dead_store_node_fails_hits_closed_and_fresh_prompts_are_served_unpublished(
    model_a: Path, node_master: MooncakeMaster, store_root: Path, llm_factory: Any
) -> None:
    master = node_master
    with mooncake_store_node(master) as node:
        settings = engine_settings(master, store_root / "store-node", artifact_mooncake_segment=0)
        llm = llm_factory(model_a, **settings)
        capture_publisher_log(llm)
        stored = prompt("On the store node")
        first = generate(llm, stored)
        assert_served(model_a, first)
        start = publisher_probe(llm)
        assert start["failures"] == 0 and start["published"] > 0
        assert_hit_reads_back(llm, model_a, stored, first)

        node.terminate()
        node.wait(timeout=10)
        # The master keeps the dead node's segment until its client_ttl (10 s) passes: the
        # hit's transfer fails at once (unavailable, naming the segment), then the objects
        # read as missing. Every repeat fails closed, none waits.
        lost, elapsed = generate_bounded(llm, stored)
        failure = assert_failed_closed(lost, "unavailable")
        assert "segment holding them did not answer" in failure.message
        assert elapsed < 20, f"the failed hit took {elapsed:.1f} s"
        deadline = time.monotonic() + RECOVERY_S
        while failure.reason != "missing":
            assert time.monotonic() < deadline, f"still {failure} after {RECOVERY_S:.0f} s"
            time.sleep(1)
            lost, elapsed = generate_bounded(llm, stored)
            failure = assert_failed_closed(lost, "unavailable", "missing")
            assert elapsed < 20, f"the failed hit took {elapsed:.1f} s"

        # No segment is left in the store: a fresh prompt is answered from capture, its
        # publication finds no room, and a hit on it fails closed.
        before = publisher_probe(llm)
        fresh_text = prompt("No store node")
        fresh = generate(llm, fresh_text)
        assert_served(model_a, fresh)
        after = publisher_probe(llm)
        assert after["failures"] > before["failures"]
        assert "R3 objects failed (capacity)" in logged_since(before, after)
        unpublished = generate(llm, fresh_text)
        assert_failed_closed(unpublished, "missing")
        assert engine_alive(llm)

        # A new store node: the engine publishes again.
        with mooncake_store_node(master):
            text, output = wait_until_published(llm, model_a, "New store node")
            assert_hit_reads_back(llm, model_a, text, output)
