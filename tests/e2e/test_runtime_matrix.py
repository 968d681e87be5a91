"""Runtime combinations on the real engine (issue 5 cells that exercise our own code).

* Tensor parallelism 2: every rank captures, rank zero alone owns the store; R3 equals TP=1.
* A KV connector with ``kv_role=kv_both`` (vLLM's ExampleConnector, KV saved on disk) after an
  engine restart: the prefix arrives as an *external* KV hit, and its R3 comes from the store
  that outlived the first engine (vLLM's in-process store dies here).
* Preemption under a KV cache too small for the batch: recomputed rows replace what was
  buffered, and every completion still equals the oracle.
* Asynchronous scheduling (kept on by the CPU test switch) with prefix hits from the store.
* N-gram speculative decoding (MRV2's n-gram speculator; on CPU its drafts come from the CPU
  support package's PyTorch proposer): rows of rejected drafts never reach the output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import assert_matches_oracle, connector_stats

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = " ".join(f"Matrix sentence {i} picks expert {i * 3 % 8}." for i in range(24))


def check(model: Path, output: Any) -> None:
    assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
    assert_matches_oracle(model, output)


def test_tensor_parallel_2_rank_zero_alone_writes(
    model_a: Path, store_root: Path, llm_factory: Any
) -> None:
    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # Two CPU workers on two cores must be bound by hand (vLLM's automatic binding needs NUMA).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        llm = llm_factory(model_a, artifact_root=str(store_root / "tp2"), tensor_parallel_size=2)
    finally:
        if previous is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous

    def roles(worker: Any) -> tuple[bool, bool]:
        connector = worker.model_runner.aux_output_connector
        return connector is not None, connector.store is not None

    assert sorted(llm.collective_rpc(roles)) == [(True, False), (True, True)]
    first, again = (llm.generate([PROMPT], GREEDY)[0] for _ in range(2))
    check(model_a, first)
    check(model_a, again)
    assert again.num_cached_tokens >= 32
    assert connector_stats(llm)["reads"] == again.num_cached_tokens // 32


def test_external_kv_hit_after_restart_is_served_from_the_store(
    model_a: Path, store_root: Path, tmp_path: Path, llm_factory: Any, shutdown_engine: Any
) -> None:
    kv_transfer_config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "kv")},
    }
    settings = {
        "artifact_root": str(store_root / "restart"),
        "kv_transfer_config": kv_transfer_config,
    }
    first_engine = llm_factory(model_a, **settings)
    first = first_engine.generate([PROMPT], GREEDY)[0]
    check(model_a, first)
    shutdown_engine(first_engine)

    second_engine = llm_factory(model_a, **settings)
    before = connector_stats(second_engine)["reads"]
    again = second_engine.generate([PROMPT], GREEDY)[0]
    check(model_a, again)
    assert connector_stats(second_engine)["reads"] > before, "prefix R3 must come from the store"
    assert (again.outputs[0].routed_experts == first.outputs[0].routed_experts).all()


def test_preemption_recompute_matches_oracle(
    model_a: Path, store_root: Path, llm_factory: Any
) -> None:
    # 16 KV blocks of 32 tokens hold 512 tokens; four requests growing to ~230 tokens each
    # cannot all stay resident, so the scheduler preempts and later recomputes.
    llm = llm_factory(
        model_a,
        artifact_root=str(store_root / "preempt"),
        num_gpu_blocks_override=16,
        max_num_seqs=4,
        max_model_len=384,
        disable_log_stats=False,
    )
    prompts = [
        " ".join(f"Request {r} sentence {i} for preemption." for i in range(10)) for r in range(4)
    ]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    preemptions = sum(
        metric.value for metric in llm.get_metrics() if metric.name == "vllm:num_preemptions"
    )
    assert preemptions > 0, "the KV cache was meant to force preemption"
    for output in outputs:
        check(model_a, output)


def test_async_scheduling_with_prefix_caching(
    model_a: Path, store_root: Path, llm_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU platform turns async scheduling off; the CPU test switch keeps it on, so
    ArtifactAsyncScheduler runs with steps planned ahead of the previous step's output."""
    monkeypatch.setenv("ARTIFACT_CPU_ASYNC_SCHEDULING", "1")
    llm = llm_factory(model_a, artifact_root=str(store_root / "async"), async_scheduling=True)
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    assert scheduler_config.async_scheduling
    assert str(scheduler_config.scheduler_cls).endswith("ArtifactAsyncScheduler")
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    prompts = [PROMPT, "Async scheduling plans the next step before this one is read back."]
    for output in llm.generate(prompts, sampled):
        check(model_a, output)
    before = connector_stats(llm)["reads"]
    again = llm.generate(prompts, sampled)
    for output in again:
        check(model_a, output)
    assert again[0].num_cached_tokens >= 32
    assert connector_stats(llm)["reads"] > before, "prefix R3 must come from the store"


def spec_decode_counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative decoding counters (needs ``disable_log_stats=False``)."""
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    return {
        name: sum(metric.value for metric in llm.get_metrics() if metric.name == name)
        for name in names
    }


def test_ngram_speculative_decoding_matches_oracle(
    model_a: Path, store_root: Path, llm_factory: Any
) -> None:
    """Each step verifies 3 n-gram drafts per request; R3 holds exactly the executed tokens
    (accepted drafts kept, rejected drafts' rows cut), also when the prefix comes from the
    store."""
    llm = llm_factory(
        model_a,
        artifact_root=str(store_root / "ngram"),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        disable_log_stats=False,
    )
    assert llm.llm_engine.vllm_config.speculative_config.method == "ngram"

    def proposer(worker: Any) -> tuple[str, bool]:
        speculator = worker.model_runner.speculator
        return type(speculator).__name__, getattr(speculator.propose, "_artifact_cpu_ngram", False)

    # MRV2's n-gram speculator, its Triton kernels replaced by the CPU support package.
    assert llm.collective_rpc(proposer) == [("NgramGPUSpeculator", True)]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = [
        PROMPT,
        "one two three four five one two three four five one two three four five one two",
        " ".join(["the cat sat on the mat and the dog sat on the log"] * 4),
    ]
    first = llm.generate(prompts, greedy)
    for output in first:
        check(model_a, output)
    counters = spec_decode_counters(llm)
    drafted = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, f"drafts must be both accepted and rejected: {counters}"

    before = connector_stats(llm)["reads"]
    again = llm.generate(prompts, greedy)
    assert again[0].num_cached_tokens >= 32
    assert connector_stats(llm)["reads"] > before, "prefix R3 must come from the store"
    for output, earlier in zip(again, first, strict=True):
        check(model_a, output)
        assert output.outputs[0].token_ids == earlier.outputs[0].token_ids
        assert (output.outputs[0].routed_experts == earlier.outputs[0].routed_experts).all()
