"""An engine on the Mooncake Store backend (``--artifact-backend mooncake``) against a real
``mooncake_master`` on loopback: R3 oracle-equal, prefix hits read back from Mooncake, keys
handles that name the Mooncake store read by another process, and a master that does not
answer refused at startup."""

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

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
KEYS = SamplingParams(
    max_tokens=6, temperature=0, ignore_eos=True, extra_args={"routed_experts_format": "keys"}
)
PROMPT = " ".join(f"Mooncake sentence {i} routes to expert {i * 7 % 8}." for i in range(16))


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module")
def mooncake_llm(model_a: Path, master: MooncakeMaster, store_root: Path, llm_factory: Any) -> Any:
    return llm_factory(
        model_a,
        artifact_root=str(store_root / "mooncake-metrics"),
        artifact_backend="mooncake",
        artifact_mooncake_master=master.master_address,
        artifact_mooncake_metadata=master.metadata_url,
        artifact_mooncake_host="127.0.0.1",
        artifact_capacity="64MiB",
    )


def test_r3_through_mooncake_equals_the_oracle_and_hits_read_it_back(
    mooncake_llm: Any, model_a: Path, store_root: Path
) -> None:
    def store_kind(worker: Any) -> str:
        connector = worker.model_runner.aux_output_connector
        return type(connector.store).__name__

    assert mooncake_llm.collective_rpc(store_kind) == ["MooncakeStore"]
    (first,) = mooncake_llm.generate([PROMPT], GREEDY)
    assert_matches_oracle(model_a, first)
    before = connector_stats(mooncake_llm)
    assert before["objects"] > 0
    (again,) = mooncake_llm.generate([PROMPT], GREEDY)
    assert again.num_cached_tokens >= 32
    after = connector_stats(mooncake_llm)
    assert after["reads"] - before["reads"] == again.num_cached_tokens // 32
    assert_matches_oracle(model_a, again)
    np.testing.assert_array_equal(again.outputs[0].routed_experts, first.outputs[0].routed_experts)
    # The engine's counters are on this node, where /metrics reads every store's.
    (store_dir,) = (store_root / "mooncake-metrics").glob("r3-*")
    snapshot = StoreMetrics.read(store_dir)
    assert snapshot is not None and snapshot.published_objects >= before["objects"]
    assert snapshot.read_objects >= again.num_cached_tokens // 32
    assert snapshot.pinned_objects > 0 and snapshot.publish_seconds.count > 0


def test_keys_handle_names_mooncake_and_another_process_reads_it(
    mooncake_llm: Any, model_a: Path
) -> None:
    prompt = PROMPT.replace("sentence", "keys sentence")
    (arrays,) = mooncake_llm.generate([prompt], GREEDY)
    handle = mooncake_llm.generate([prompt], KEYS)[0].outputs[0].routed_experts
    text = handle.to_json()
    assert handle.store.backend == "mooncake", text
    read = read_handle_elsewhere(text, env=client_env())
    np.testing.assert_array_equal(read, arrays.outputs[0].routed_experts)
    assert_matches_oracle(model_a, arrays)


def test_r3_on_a_store_node_outlives_its_engine_for_an_engine_on_another_root(
    model_b: Path,
    master: MooncakeMaster,
    store_root: Path,
    tmp_path: Path,
    llm_factory: Any,
    kill_engine: Any,
) -> None:
    """Engines that add no memory (``--artifact-mooncake-segment 0``) put R3 on a store node
    (``mooncake_client``): after the first engine is SIGKILLed, a second one with another root
    (another node, as far as /dev/shm goes) gets the prompt's KV from shared KV storage and
    its R3 from Mooncake."""
    settings = {
        "artifact_backend": "mooncake",
        "artifact_mooncake_master": master.master_address,
        "artifact_mooncake_metadata": master.metadata_url,
        "artifact_mooncake_host": "127.0.0.1",
        "artifact_mooncake_segment": 0,
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
        },
    }
    prompt = PROMPT.replace("Mooncake", "Store node")
    with mooncake_store_node(master):
        first_engine = llm_factory(model_b, artifact_root=str(store_root / "node-a"), **settings)
        (first,) = first_engine.generate([prompt], GREEDY)
        assert_matches_oracle(model_b, first)
        assert connector_stats(first_engine)["objects"] > 0  # waits for its publications
        kill_engine(first_engine)

        second_engine = llm_factory(model_b, artifact_root=str(store_root / "node-b"), **settings)
        before = connector_stats(second_engine)["reads"]
        (again,) = second_engine.generate([prompt], GREEDY)
        assert again.outputs[0].finish_reason == "length", again.outputs[0].stop_reason
        assert again.num_cached_tokens >= 32, "the prompt's KV must come from the KV storage"
        assert connector_stats(second_engine)["reads"] - before == again.num_cached_tokens // 32
        assert_matches_oracle(model_b, again)
        np.testing.assert_array_equal(
            again.outputs[0].routed_experts, first.outputs[0].routed_experts
        )
