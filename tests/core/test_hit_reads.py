"""KV hits on blocks another engine of the node computed (a PD producer): the tracker reads
their R3 from that engine's store, adopts it, and never mixes weight versions."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from vllm_artifact.contract import EmittedRows
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.keys import full_block_keys
from vllm_artifact.core.publisher import Publisher
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.store.node_stores import NodeStores
from vllm_artifact.core.tracker import RequestTracker

from .conftest import rows_for
from .test_node_stores import FAMILY, writer
from .test_tracker import BS, block_id, hashes, hit, serve


class Engine:
    """One engine's rank zero: its store, publisher and tracker (reading the node's stores)."""

    def __init__(self, root: str, name: str, layout: R3Layout) -> None:
        self.store = writer(root, name, layout)
        self.store.record_weight_version("default")
        self.publisher = Publisher(self.store)
        self.node = NodeStores(self.store, FAMILY)
        self.tracker = RequestTracker(
            layout,
            "model",
            self.store,
            self.publisher,
            buffer_max_bytes=1 << 20,
            block_id=block_id,
            node_stores=self.node,
        )

    def set_weight_version(self, version: str) -> None:
        self.tracker.set_weight_version(version)
        self.store.record_weight_version(version)

    def close(self) -> None:
        self.publisher.close()
        self.node.close()
        self.store.close()


@pytest.fixture
def pair(shm_root: str, layout: R3Layout) -> Iterator[tuple[Engine, Engine]]:
    """A prefill (producer) and a decode (consumer) engine of one model on one root."""
    producer = Engine(shm_root, f"{FAMILY}0", layout)
    consumer = Engine(shm_root, f"{FAMILY}0-2", layout)
    yield producer, consumer
    producer.close()
    consumer.close()


def test_prompt_rows_come_from_the_producer_and_are_adopted(
    pair: tuple[Engine, Engine], layout: R3Layout
) -> None:
    producer, consumer = pair
    rows = rows_for(layout, 7, 3 * BS + 5)
    serve(producer.tracker, "prefill", hashes("pd", 3), rows[: 3 * BS + 1])
    producer.publisher.flush()
    # The consumer's KV connector loaded the three full blocks; it computes the rest.
    out = hit(consumer.tracker, "decode", hashes("pd", 3), 3 * BS, rows[3 * BS :])
    assert isinstance(out, EmittedRows) and out.token_start == 0
    np.testing.assert_array_equal(out.rows, rows)
    assert consumer.tracker.reads == 3 and consumer.tracker.adopted == 3
    # Adopted: in the consumer's own store, pinned for its KV blocks until they are evicted.
    consumer.publisher.flush()
    keys = full_block_keys(consumer.tracker.namespace, hashes("pd", 3))
    assert consumer.store.exists(keys) == [True, True, True]
    assert consumer.store.stats().pinned_objects == 3
    consumer.tracker.kv_evicted([block_id(h) for h in hashes("pd", 3)])
    consumer.publisher.flush()
    assert consumer.store.stats().pinned_objects == 0
    # A later hit is served by the consumer's own store, even with the producer's gone.
    producer.close()
    again = hit(consumer.tracker, "again", hashes("pd", 3), 3 * BS, rows[3 * BS :])
    assert isinstance(again, EmittedRows)
    np.testing.assert_array_equal(again.rows, rows)
    assert consumer.tracker.adopted == 3


def test_missing_on_the_node_fails_only_that_request(
    pair: tuple[Engine, Engine], layout: R3Layout
) -> None:
    _, consumer = pair
    rows = rows_for(layout, 8, BS + 2)
    failure = hit(consumer.tracker, "lost", hashes("nowhere", 1), BS, rows[BS:])
    assert isinstance(failure, R3Failure) and failure.reason == "missing"
    assert "in no R3 store of this model" in failure.message
    assert "Increase --artifact-capacity" not in failure.message  # nothing was evicted
    ok = hit(consumer.tracker, "fresh", [], 0, rows)
    assert isinstance(ok, EmittedRows)


def test_producer_on_other_weights_fails_the_request_naming_both_versions(
    pair: tuple[Engine, Engine], layout: R3Layout
) -> None:
    producer, consumer = pair
    producer.set_weight_version("step-8")
    rows = rows_for(layout, 9, 2 * BS + 1)
    serve(producer.tracker, "prefill", hashes("wv", 2), rows)
    producer.publisher.flush()
    consumer.set_weight_version("step-7")
    failure = hit(consumer.tracker, "decode", hashes("wv", 2), 2 * BS, rows[2 * BS :])
    assert isinstance(failure, R3Failure) and failure.reason == "weight_mismatch"
    assert "'step-8'" in failure.message and "'step-7'" in failure.message
    # Once both run the same version, the same prompt works.
    consumer.set_weight_version("step-8")
    out = hit(consumer.tracker, "decode-2", hashes("wv", 2), 2 * BS, rows[2 * BS :])
    assert isinstance(out, EmittedRows)
    np.testing.assert_array_equal(out.rows, rows)
