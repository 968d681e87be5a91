"""Capacity pressure on a real engine: a small store serving many times its capacity.

The KV cache is shrunk to 64 blocks so that it, too, evicts; the store capacity is "auto"
(sized from the KV cache). Repeated recent prompts hit the KV cache and must get their R3
from the store; nothing fails and the store never grows past its capacity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import assert_matches_oracle, connector_stats

pytestmark = pytest.mark.engine

KV_BLOCKS = 64


def test_serving_ten_times_the_capacity(model_a: Path, store_root: Path, llm_factory: Any) -> None:
    llm = llm_factory(
        model_a,
        artifact_root=str(store_root),
        num_gpu_blocks_override=KV_BLOCKS,
        max_num_seqs=4,
        max_model_len=1024,
    )
    # Capacity in tokens of R3 payload (the arena file also holds headers and the index).
    capacity_tokens = connector_stats(llm)["capacity_objects"] * 32
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    served_tokens = 0
    max_objects = 0
    previous: list[str] = []
    outputs = []
    for i in range(200):
        if served_tokens >= 10 * capacity_tokens:
            break
        fresh = [
            " ".join(f"Request {i}.{k} sentence {j} routes to {i * j % 8}." for j in range(12))
            for k in range(3)
        ]
        # New prompts plus repeats of the previous round's: the repeats hit the KV cache.
        for output in llm.generate(fresh + previous, greedy):
            assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
            served_tokens += len(output.prompt_token_ids) + len(output.outputs[0].token_ids)
            outputs.append(output)
        previous = fresh
        max_objects = max(max_objects, connector_stats(llm)["objects"])
    stats = connector_stats(llm)
    assert served_tokens >= 10 * capacity_tokens
    assert max_objects <= stats["capacity_objects"]
    assert stats["evictions"] > 0
    assert stats["reads"] > 0, "repeats must have been served from the store"
    # Pins follow the KV cache: only objects whose block the KV cache still holds are pinned.
    print(f"pinned objects at the end: {stats['pinned']} (KV cache: {KV_BLOCKS} blocks)")
    assert 0 < stats["pinned"] <= KV_BLOCKS
    for output in outputs[-6:]:
        assert_matches_oracle(model_a, output)
