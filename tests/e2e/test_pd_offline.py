"""Prefill/decode disaggregation on one node, offline: R3 follows the KV between engines.

Two real engines of the tiny model share one store root and vLLM's shared-storage
``ExampleConnector`` (a producer saves a prompt's KV to disk, a consumer loads it). The flow
is a PD proxy's: the prompt with ``max_tokens=1`` on the producer, then the same prompt on the
consumer, whose KV connector serves the prompt's full blocks. The consumer's R3 is complete
(prompt rows read from the producer's store and adopted into its own, generated rows captured
locally) and equal to the transformers oracle row for row; faults of the producer's store and
mismatched weight versions fail that one request closed while both engines serve on.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_env import ENGINE_KWARGS
from vllm_artifact_testing.engine_probe import (
    assert_matches_oracle,
    connector_stats,
    read_handle_elsewhere,
)

from vllm_artifact.core.store import ShmStore

pytestmark = pytest.mark.engine

BLOCK = ENGINE_KWARGS["block_size"]  # the test engines' KV block size
PREFILL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
DECODE = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
KEYS = SamplingParams(
    max_tokens=8, temperature=0, ignore_eos=True, extra_args={"routed_experts_format": "keys"}
)


def prompt(tag: str) -> str:
    return " ".join(
        f"Disaggregated {tag} sentence {i} routes to expert {i * 5 % 8}." for i in range(12)
    )


def kv_transfer(role: str, path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


@pytest.fixture(scope="module")
def pd_root(store_root: Path) -> Path:
    return store_root / "pd"


@pytest.fixture(scope="module")
def pair(model_a: Path, pd_root: Path, tmp_path_factory: Any, llm_factory: Any) -> tuple[Any, Any]:
    """A producer (prefill) and a consumer (decode) engine on one root and one KV storage
    (the store-deleting test runs last: the producer's R3 is gone after it). The consumer
    tracks in a tracker process (``--artifact-tracker process``): the producer's objects are
    read and adopted there."""
    storage = tmp_path_factory.mktemp("pd-kv")
    producer = llm_factory(
        model_a, artifact_root=str(pd_root), kv_transfer_config=kv_transfer("kv_producer", storage)
    )
    consumer = llm_factory(
        model_a,
        artifact_root=str(pd_root),
        artifact_tracker="process",
        kv_transfer_config=kv_transfer("kv_consumer", storage),
    )
    return producer, consumer


def disaggregated(pair: tuple[Any, Any], text: str, params: SamplingParams = DECODE) -> Any:
    """A PD proxy's flow: prefill with max_tokens=1 on the producer, then decode."""
    producer, consumer = pair
    (prefilled,) = producer.generate([text], PREFILL)
    assert prefilled.outputs[0].finish_reason == "length"
    (decoded,) = consumer.generate([text], params)
    return decoded


def test_decode_side_r3_is_complete_and_equals_the_oracle(
    pair: tuple[Any, Any], model_a: Path
) -> None:
    _, consumer = pair
    before = connector_stats(consumer)
    assert "tracker_pid" in before, "the consumer tracks in a tracker process"
    output = disaggregated(pair, prompt("first"))
    assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
    experts = assert_matches_oracle(model_a, output)
    prompt_tokens = len(output.prompt_token_ids)
    assert experts.shape[0] == prompt_tokens + 7  # every prompt token and all but the last
    # The prompt's full blocks came from the KV connector, their R3 from the producer's store.
    assert output.num_cached_tokens >= (prompt_tokens - 1) // BLOCK * BLOCK > 0
    after = connector_stats(consumer)
    adopted = after["adopted"] - before["adopted"]
    assert adopted == output.num_cached_tokens // BLOCK, (before, after)


def test_keys_path_on_the_decode_side_is_read_by_a_third_process(
    pair: tuple[Any, Any], model_a: Path
) -> None:
    text = prompt("keys")
    arrays = disaggregated(pair, text)
    handle = pair[1].generate([text], KEYS)[0].outputs[0].routed_experts
    read = read_handle_elsewhere(handle.to_json())
    np.testing.assert_array_equal(read, arrays.outputs[0].routed_experts)
    assert_matches_oracle(model_a, arrays)


def producer_store(pd_root: Path) -> Path:
    """The producer's store directory (it started first: the family's first name)."""
    (name,) = [p.name for p in pd_root.iterdir() if p.name.endswith("-dp0")]
    return pd_root / name


def published_slots(store_dir: Path) -> set[int]:
    reader = ShmStore.open_reader(str(store_dir.parent), store_dir.name)
    try:
        return set(np.flatnonzero(reader._reads.live().published()).tolist())
    finally:
        reader.close()


def test_a_corrupted_producer_store_fails_that_request_and_both_engines_serve_on(
    pair: tuple[Any, Any], pd_root: Path, model_a: Path
) -> None:
    producer, consumer = pair
    store_dir = producer_store(pd_root)
    text = prompt("corrupt")
    before = published_slots(store_dir)
    producer.generate([text], PREFILL)
    connector_stats(producer)  # its publications are out
    new = sorted(published_slots(store_dir) - before)
    assert new, "the prefill published nothing"
    reader = ShmStore.open_reader(str(pd_root), store_dir.name)
    geometry = reader.geometry
    reader.close()
    with open(store_dir / "arena", "r+b") as arena:
        for slot in new:  # one flipped byte in each object of this prompt
            arena.seek(geometry.payload_offset + slot * geometry.slot_nbytes)
            byte = arena.read(1)[0]
            arena.seek(geometry.payload_offset + slot * geometry.slot_nbytes)
            arena.write(bytes([byte ^ 0xFF]))
    (failed,) = consumer.generate([text], DECODE)
    assert failed.outputs[0].finish_reason == "error"
    assert "vllm-artifact[corrupt]" in str(failed.outputs[0].stop_reason)
    assert_both_serve(pair, model_a, "after-corrupt")


def test_mismatched_weight_versions_fail_naming_both(pair: tuple[Any, Any], model_a: Path) -> None:
    producer, consumer = pair
    producer.llm_engine.set_weight_version("step-2")
    consumer.llm_engine.set_weight_version("step-1")
    try:
        (failed,) = [disaggregated(pair, prompt("weights"))]
        assert failed.outputs[0].finish_reason == "error"
        reason = str(failed.outputs[0].stop_reason)
        assert "vllm-artifact[weight_mismatch]" in reason
        assert "'step-2'" in reason and "'step-1'" in reason
        consumer.llm_engine.set_weight_version("step-2")
        output = disaggregated(pair, prompt("weights-same"))
        assert_matches_oracle(model_a, output)
    finally:
        for engine in pair:
            engine.llm_engine.set_weight_version("default")


def test_a_deleted_producer_store_fails_that_request_and_both_engines_serve_on(
    pair: tuple[Any, Any], pd_root: Path, model_a: Path
) -> None:
    producer, consumer = pair
    text = prompt("deleted")
    producer.generate([text], PREFILL)
    connector_stats(producer)
    shutil.rmtree(producer_store(pd_root))  # e.g. a cleanup of the root between the two
    (failed,) = consumer.generate([text], DECODE)
    assert failed.outputs[0].finish_reason == "error"
    reason = str(failed.outputs[0].stop_reason)
    assert "vllm-artifact[missing]" in reason and "in no R3 store of this model" in reason
    assert_both_serve(pair, model_a, "after-delete", through_pair=False)


def assert_both_serve(
    pair: tuple[Any, Any], model_a: Path, tag: str, *, through_pair: bool = True
) -> None:
    """Both engines still answer with oracle-equal R3 (a PD request when ``through_pair``)."""
    producer, consumer = pair
    for role, engine in zip(("producer", "consumer"), pair, strict=True):
        # A prompt of its own each: the producer saves every prompt's KV for the consumer.
        (output,) = engine.generate([prompt(f"{tag}-{role}")], DECODE)
        assert_matches_oracle(model_a, output)
    if through_pair:
        assert_matches_oracle(model_a, disaggregated((producer, consumer), prompt(f"{tag}-pd")))
