"""The Artifact Connector on a real engine: R3 of prefix hits comes from the /dev/shm store,
and a missing or corrupt object fails only the affected request, closed.

One engine (module fixture) on a private store root; the oracle is a transformers forward
pass of the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import (
    assert_matches_oracle,
    connector_stats,
    executed_tokens,
)
from vllm_artifact_testing.store_faults import flip_in_every_slot

from vllm_artifact.client import r3_failure

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT_ONE = " ".join(f"Block {i} of the first prompt goes to expert {i % 8}." for i in range(24))
PROMPT_TWO = " ".join(f"Another text {i} that shares no prefix, layer {i % 4}." for i in range(24))


@pytest.fixture(scope="module")
def llm(model_a: Path, store_root: Path, llm_factory: Any) -> Any:
    return llm_factory(model_a, artifact_root=str(store_root), max_num_seqs=4)


def test_prefix_hit_is_served_from_the_store(llm: Any, model_a: Path) -> None:
    first = llm.generate([PROMPT_ONE], GREEDY)[0]
    assert_matches_oracle(model_a, first)
    before = connector_stats(llm)
    executed = len(executed_tokens(first))
    # Every full block, plus the terminal partial block of a normal finish.
    assert before["objects"] == executed // 32 + (executed % 32 > 0)
    assert before["tails"] == (executed % 32 > 0)

    again = llm.generate([PROMPT_ONE], GREEDY)[0]
    assert again.num_cached_tokens >= 32
    after = connector_stats(llm)
    assert after["reads"] - before["reads"] == again.num_cached_tokens // 32
    assert_matches_oracle(model_a, again)
    np.testing.assert_array_equal(again.outputs[0].routed_experts, first.outputs[0].routed_experts)


def test_corrupt_object_fails_that_request_only(llm: Any, model_a: Path, store_root: Path) -> None:
    llm.generate([PROMPT_ONE], GREEDY)  # make sure its blocks are published
    flip_in_every_slot(store_root, where="payload")
    hit, fresh = llm.generate([PROMPT_ONE, PROMPT_TWO], GREEDY)
    assert hit.outputs[0].finish_reason == "error"
    assert hit.outputs[0].routed_experts is None
    failure = r3_failure(hit.outputs[0].stop_reason)
    assert failure is not None and failure.reason == "corrupt", hit.outputs[0].stop_reason
    assert "checksum" in failure.message
    # The other request of the same batch is untouched and the engine goes on.
    assert fresh.outputs[0].finish_reason == "length"
    assert_matches_oracle(model_a, fresh)


def test_deleted_object_fails_closed_and_engine_keeps_serving(
    llm: Any, model_a: Path, store_root: Path
) -> None:
    llm.generate([PROMPT_TWO], GREEDY)
    flip_in_every_slot(store_root, where="key")
    hit = llm.generate([PROMPT_TWO], GREEDY)[0]
    assert hit.outputs[0].finish_reason == "error"
    failure = r3_failure(hit.outputs[0].stop_reason)
    assert failure is not None and failure.reason == "missing", hit.outputs[0].stop_reason
    assert "Increase --artifact-capacity" in failure.message
    later = llm.generate(["A short prompt after the failure."], GREEDY)[0]
    assert later.outputs[0].finish_reason == "length"
    assert_matches_oracle(model_a, later)


def test_weight_version_change_never_reuses_old_objects(llm: Any, model_a: Path) -> None:
    prompt = " ".join(f"Weights version test sentence {i}." for i in range(30))
    llm.generate([prompt], GREEDY)
    llm.llm_engine.set_weight_version("v2")
    try:
        # The KV cache still holds the prompt (a hit), but its R3 was keyed under the old
        # version: the request fails closed instead of returning the old weights' routing.
        stale = llm.generate([prompt], GREEDY)[0]
        assert stale.outputs[0].finish_reason == "error"
        assert "missing" in str(stale.outputs[0].stop_reason)
        assert "reset the prefix cache" in str(stale.outputs[0].stop_reason)
        # After a prefix-cache reset (what RL loops do after a weight update) it recomputes.
        assert llm.reset_prefix_cache()
        fresh = llm.generate([prompt], GREEDY)[0]
        assert fresh.outputs[0].finish_reason == "length"
        assert_matches_oracle(model_a, fresh)
    finally:
        llm.llm_engine.set_weight_version("default")
