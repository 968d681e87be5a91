"""Engines on the Mooncake Store backend (``--artifact-backend mooncake``) against a real
``mooncake_master`` and store node on loopback: two engines that share nothing but the master
and a KV storage (each its own store root, as on two nodes), a prefill one and a decode one
(``ExampleConnector`` as producer and consumer), both adding no memory
(``--artifact-mooncake-segment 0``): their objects live on the store node.

R3 is oracle-equal; prefix hits read it back from Mooncake; a keys handle names the Mooncake
store and another process reads it; the decode engine's prompt rows come from Mooncake, where
the prefill engine put them; after the prefill engine is SIGKILLed its R3 is still served.
The decode engine runs ``--artifact-tracker process``: its Mooncake client is the tracker
process's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import (
    assert_matches_oracle,
    connector_stats,
    read_handle_elsewhere,
)
from vllm_artifact_testing.mooncake_master import (
    MooncakeMaster,
    client_env,
    mooncake_master,
    mooncake_store_node,
)

from vllm_artifact.core.store.shm_metrics import StoreMetrics

pytestmark = pytest.mark.engine

BLOCK = 32  # the test engines' KV block size
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
KEYS = SamplingParams(
    max_tokens=6, temperature=0, ignore_eos=True, extra_args={"routed_experts_format": "keys"}
)


def prompt(tag: str) -> str:
    return " ".join(f"Mooncake {tag} sentence {i} routes to expert {i * 7 % 8}." for i in range(16))


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with mooncake_master() as running, mooncake_store_node(running):
        yield running


@pytest.fixture(scope="module")
def pair(
    model_a: Path, master: MooncakeMaster, store_root: Path, tmp_path_factory: Any, llm_factory: Any
) -> tuple[Any, Any]:
    storage = tmp_path_factory.mktemp("mooncake-kv")

    def engine(role: str, node: str, tracker: str) -> Any:
        return llm_factory(
            model_a,
            artifact_tracker=tracker,
            artifact_root=str(store_root / node),  # no /dev/shm store in common
            artifact_backend="mooncake",
            artifact_mooncake_master=master.master_address,
            artifact_mooncake_metadata=master.metadata_url,
            artifact_mooncake_host="127.0.0.1",
            artifact_mooncake_segment=0,
            kv_transfer_config={
                "kv_connector": "ExampleConnector",
                "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(storage)},
            },
        )

    # The decode engine tracks in a tracker process: Mooncake reads and writes from there.
    return (
        engine("kv_producer", "prefill-node", "engine"),
        engine("kv_consumer", "decode-node", "process"),
    )


def test_r3_through_mooncake_equals_the_oracle_and_hits_read_it_back(
    pair: tuple[Any, Any], model_a: Path, store_root: Path
) -> None:
    producer, _ = pair

    def store_kind(worker: Any) -> str:
        return type(worker.model_runner.aux_output_connector.store).__name__

    assert producer.collective_rpc(store_kind) == ["MooncakeStore"]
    (first,) = producer.generate([prompt("hit")], GREEDY)
    assert_matches_oracle(model_a, first)
    before = connector_stats(producer)
    assert before["objects"] > 0
    (again,) = producer.generate([prompt("hit")], GREEDY)
    assert again.num_cached_tokens >= BLOCK
    after = connector_stats(producer)
    assert after["reads"] - before["reads"] == again.num_cached_tokens // BLOCK
    assert_matches_oracle(model_a, again)
    np.testing.assert_array_equal(again.outputs[0].routed_experts, first.outputs[0].routed_experts)
    # The engine's counters are on its node, where /metrics reads every store's.
    (store_dir,) = (store_root / "prefill-node").glob("r3-*")
    snapshot = StoreMetrics.read(store_dir)
    assert snapshot is not None and snapshot.published_objects >= before["objects"]
    assert snapshot.read_objects >= again.num_cached_tokens // BLOCK
    assert snapshot.pinned_objects > 0 and snapshot.publish_seconds.count > 0


def test_keys_handle_names_mooncake_and_another_process_reads_it(
    pair: tuple[Any, Any], model_a: Path
) -> None:
    producer, _ = pair
    (arrays,) = producer.generate([prompt("keys")], GREEDY)
    keys = producer.generate([prompt("keys")], KEYS)[0].outputs[0]
    assert keys.finish_reason == "length", keys.stop_reason  # a failure names itself
    handle = keys.routed_experts
    text = handle.to_json()
    assert handle.store.backend == "mooncake", text
    read = read_handle_elsewhere(text, env=client_env())
    np.testing.assert_array_equal(read, arrays.outputs[0].routed_experts)
    assert_matches_oracle(model_a, arrays)


def test_decode_engine_reads_the_prompts_r3_from_mooncake_even_after_the_prefill_engine_died(
    pair: tuple[Any, Any], model_a: Path, kill_engine: Any
) -> None:
    producer, consumer = pair
    text = prompt("disaggregated")
    (prefilled,) = producer.generate([text], PREFILL)
    assert prefilled.outputs[0].finish_reason == "length"
    connector_stats(producer)  # its publications are out
    stats = connector_stats(consumer)
    assert "tracker_pid" in stats, "the decode engine tracks in a tracker process"
    before = stats["reads"]
    (decoded,) = consumer.generate([text], GREEDY)
    assert decoded.outputs[0].finish_reason == "length", decoded.outputs[0].stop_reason
    assert decoded.num_cached_tokens >= BLOCK, "the prompt's KV must come from the KV connector"
    assert connector_stats(consumer)["reads"] - before == decoded.num_cached_tokens // BLOCK
    assert_matches_oracle(model_a, decoded)
    # The prefill engine dies; its objects live on the store node, not in its memory.
    kill_engine(producer)
    (again,) = consumer.generate([text], GREEDY)  # a prefix hit in the decode engine's cache
    assert again.outputs[0].finish_reason == "length", again.outputs[0].stop_reason
    assert again.num_cached_tokens >= BLOCK
    np.testing.assert_array_equal(
        again.outputs[0].routed_experts, decoded.outputs[0].routed_experts
    )
