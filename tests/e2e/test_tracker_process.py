"""``--artifact-tracker process`` on a real engine: R3 equals the transformers oracle (chunked
prefill, prefix hits read from the store, n=2), the store is written by the tracker process,
and a tracker process killed from outside fails only the requests it held; the engine starts
a new one, which takes the store over and serves everything after.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import assert_matches_oracle

from vllm_artifact.client import r3_failure

pytestmark = pytest.mark.engine

CHUNK_BUDGET = 64
LONG_PROMPT = " ".join(
    f"Routing decision {i} sends token {i * 5 % 11} to expert {i % 8}." for i in range(40)
)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_a: Path, store_root: Path, llm_factory: Any) -> Any:
    return llm_factory(
        model_a,
        artifact_root=str(store_root),
        artifact_tracker="process",
        artifact_switch_interval_ms=1.5,
        max_num_batched_tokens=CHUNK_BUDGET,
        max_num_seqs=8,
    )


def tracker(llm: Any) -> dict[str, Any]:
    """The rank-zero connector's tracker pid, its counters (after its publications) and
    whether it holds a store in the engine's own process."""

    def probe(worker: Any) -> dict[str, Any]:
        connector = worker.model_runner.aux_output_connector
        if connector is None or connector.tracker_pid is None:
            return {}
        connector.flush_publications()
        return {
            "pid": connector.tracker_pid,
            "engine_pid": os.getpid(),
            "reads": connector.reads,
            "tails": connector.tails_published,
            "answered_here": connector.steps_answered_here,
            "store_in_engine": connector.store is not None,
        }

    return next(s for s in llm.collective_rpc(probe) if s)


def test_the_given_switch_interval_reaches_rank_zero(llm: Any) -> None:
    def interval(worker: Any) -> float:
        return sys.getswitchinterval()

    assert llm.collective_rpc(interval) == [pytest.approx(0.0015)]


def test_rows_match_the_oracle_with_chunks_prefix_hits_and_n2(llm: Any, model_a: Path) -> None:
    before = tracker(llm)
    assert not before["store_in_engine"]
    assert psutil.Process(before["pid"]).ppid() == before["engine_pid"]
    for output in llm.generate(PROMPTS, GREEDY):
        assert_matches_oracle(model_a, output)
    first = llm.generate([LONG_PROMPT], GREEDY)[0]
    assert len(first.prompt_token_ids) > 3 * CHUNK_BUDGET, "several prefill chunks"
    first_rows = assert_matches_oracle(model_a, first)
    again = llm.generate([LONG_PROMPT], GREEDY)[0]
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= 32
    np.testing.assert_array_equal(assert_matches_oracle(model_a, again), first_rows)
    sampled = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3)
    (pair,) = llm.generate([PROMPTS[0]], sampled)
    for index in range(2):
        assert_matches_oracle(model_a, pair, index)
    after = tracker(llm)
    assert after["pid"] == before["pid"]
    assert after["reads"] > before["reads"], "the prefix hit's rows came from the store"
    assert after["tails"] > before["tails"]
    # Steady-decode steps were answered by the engine itself, and their rows were right.
    assert after["answered_here"] > before["answered_here"]


def test_a_killed_tracker_fails_only_what_it_held_and_a_new_one_serves(
    llm: Any, model_a: Path
) -> None:
    first = llm.generate([LONG_PROMPT], GREEDY)[0]
    killed = tracker(llm)["pid"]
    os.kill(killed, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(killed)], timeout=10)
    # A new process takes the store over: the prefix hit's rows are read from it.
    again = llm.generate([LONG_PROMPT], GREEDY)[0]
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= 32
    np.testing.assert_array_equal(
        assert_matches_oracle(model_a, again), first.outputs[0].routed_experts
    )
    restarted = tracker(llm)
    assert restarted["pid"] != killed and restarted["reads"] > 0

    # Killed while a request runs: that request fails closed, the engine goes on.
    outputs: list[Any] = []
    long_run = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    runner = threading.Thread(target=lambda: outputs.extend(llm.generate(PROMPTS[:1], long_run)))
    runner.start()
    time.sleep(1.0)
    os.kill(restarted["pid"], signal.SIGKILL)
    runner.join(timeout=120)
    (failed,) = outputs
    out = failed.outputs[0]
    assert out.finish_reason == "error" and out.routed_experts is None
    failure = r3_failure(out.stop_reason)
    assert failure is not None and failure.reason == "tracker_process", out.stop_reason
    # Later requests are served, with R3 equal to the oracle.
    for output in llm.generate(PROMPTS, GREEDY):
        assert_matches_oracle(model_a, output)
