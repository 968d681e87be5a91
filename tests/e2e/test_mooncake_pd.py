"""Prefill/decode across "nodes" on the Mooncake backend: two engines that share nothing but a
``mooncake_master`` (each its own store root, objects on a store node) and a KV storage
(``ExampleConnector`` as producer and consumer). The decode engine's R3 is complete and
equal to the oracle: its prompt rows are read from Mooncake, where the prefill engine put
them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import assert_matches_oracle, connector_stats
from vllm_artifact_testing.mooncake_master import (
    MooncakeMaster,
    mooncake_master,
    mooncake_store_node,
)

pytestmark = pytest.mark.engine

PREFILL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
DECODE = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with mooncake_master() as running, mooncake_store_node(running):
        yield running


@pytest.fixture(scope="module")
def pair(
    model_a: Path, master: MooncakeMaster, store_root: Path, tmp_path_factory: Any, llm_factory: Any
) -> tuple[Any, Any]:
    storage = tmp_path_factory.mktemp("mooncake-pd-kv")

    def engine(role: str, node: str) -> Any:
        return llm_factory(
            model_a,
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

    return engine("kv_producer", "prefill-node"), engine("kv_consumer", "decode-node")


def test_decode_engine_reads_the_prompts_r3_from_mooncake(
    pair: tuple[Any, Any], model_a: Path
) -> None:
    producer, consumer = pair
    prompt = " ".join(f"Cross-node line {i} picks expert {i * 3 % 8}." for i in range(14))
    (prefilled,) = producer.generate([prompt], PREFILL)
    assert prefilled.outputs[0].finish_reason == "length"
    connector_stats(producer)  # its publications are out
    before = connector_stats(consumer)["reads"]
    (decoded,) = consumer.generate([prompt], DECODE)
    assert decoded.outputs[0].finish_reason == "length", decoded.outputs[0].stop_reason
    assert decoded.num_cached_tokens >= 32, "the prompt's KV must come from the KV connector"
    assert connector_stats(consumer)["reads"] - before == decoded.num_cached_tokens // 32
    assert_matches_oracle(model_a, decoded)
