"""Capacity pressure, preemption and a crash on a real engine.

The KV cache is shrunk to 64 blocks so that it, too, evicts and preempts; the store capacity
is "auto" (sized from the KV cache). Four long requests that outgrow the KV cache are
preempted and recomputed: the recomputed rows replace what was buffered. Repeated recent
prompts hit the KV cache and must get their R3 from the store; nothing fails and the store
never grows past its capacity. Then the engine is SIGKILLed mid-generation (while it
publishes) and a new engine starts on the same root (the bounded CI version of
``scripts/soak_restarts.py``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm_artifact_testing.chaos import check_root, published, sigkill, wait_for_publications
from vllm_artifact_testing.engine_probe import assert_matches_oracle, connector_stats, vllm_counters

pytestmark = pytest.mark.engine

KV_BLOCKS = 64
ENGINE = {
    "num_gpu_blocks_override": KV_BLOCKS,
    "max_num_seqs": 4,
    "max_model_len": 1024,
    "disable_log_stats": False,  # vLLM counts preemptions
}


@pytest.fixture(scope="module")
def llm(model_a: Path, store_root: Path, llm_factory: Any) -> Any:
    return llm_factory(model_a, artifact_root=str(store_root), **ENGINE)


def test_serving_ten_times_the_capacity(llm: Any, model_a: Path) -> None:
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


def test_preemption_recompute_matches_oracle(llm: Any, model_a: Path) -> None:
    # 64 KV blocks of 32 tokens hold 2048 tokens; four ~470-token prompts growing by 100 tokens
    # need 18 blocks each, so they cannot all stay resident: vLLM preempts and recomputes.
    prompts = [
        " ".join(f"Request {r} sentence {i} for preemption." for i in range(24)) for r in range(4)
    ]
    before = preemptions(llm)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert preemptions(llm) > before, "the KV cache was meant to force preemption"
    for output in outputs:
        assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
        assert_matches_oracle(model_a, output)


def preemptions(llm: Any) -> float:
    return vllm_counters(llm, "vllm:num_preemptions")["vllm:num_preemptions"]


def test_sigkill_mid_generation_then_restart_on_the_same_root(
    llm: Any, model_a: Path, store_root: Path, llm_factory: Any
) -> None:
    """No half-written object is ever visible after a crash: the restarted engine recovers
    the store (the same one, no leftovers), every object reads back intact, and it serves
    oracle-correct R3 again, prefix hits from the store included."""
    prompts = [
        " ".join(f"Crash test {k} sentence {j} routes to {j * k % 8}." for j in range(10))
        for k in range(4)
    ]
    long_run = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    # vLLM's offline client may never return from generate() once its engine is killed (seen
    # with vLLM 0.32: the client notices the death and cleans up, generate() keeps waiting),
    # so it runs in a daemon thread that is left behind with the dead LLM.
    runner = threading.Thread(target=llm.generate, args=(prompts, long_run), daemon=True)
    before = published(store_root)
    runner.start()
    wait_for_publications(store_root, before + 8)  # the background publisher is writing
    killed = sigkill(os.getpid(), "engine")
    llm._test_shut_down = True  # its processes are gone; nothing to shut down
    print(f"SIGKILLed {killed} after {published(store_root) - before} publications")

    second = llm_factory(model_a, artifact_root=str(store_root), **ENGINE)
    root = check_root(store_root)
    assert len(root.stores) == 1 and not root.leftovers, root  # the same store, taken over
    assert root.corrupt == 0 and root.objects > 0, root
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = second.generate(prompts, greedy)
    again = second.generate(prompts, greedy)
    assert connector_stats(second)["reads"] > 0  # the repeats' prefixes came from the store
    for output in (*first, *again):
        assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
        assert_matches_oracle(model_a, output)
