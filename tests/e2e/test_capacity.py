"""Capacity pressure, preemption and a crash on a real engine.

The KV cache is shrunk to 64 blocks so that it, too, evicts and preempts; the store capacity
is "auto" (sized from the KV cache). Four long requests that outgrow the KV cache are
preempted and recomputed: their R3 (rows or a keys-only handle) spans their whole life.
Repeated recent prompts hit the KV cache and must get their R3 from the store; nothing fails
and the store never grows past its capacity, measured from outside (the arena file, a
reader's count).
Then the engine is SIGKILLed mid-generation (while it publishes) and a new engine starts on
the same root (the bounded CI version of ``scripts/soak_restarts.py``); it replaces the
module's engine, so the tests pass in any order. An engine whose /dev/shm cannot hold the
``auto`` capacity fails at startup with the fix.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm import SamplingParams
from vllm_artifact_testing.chaos import (
    check_root,
    published,
    sigkill,
    store_names,
    wait_for_publications,
)
from vllm_artifact_testing.engine_env import ENGINE_KWARGS
from vllm_artifact_testing.engine_probe import (
    assert_matches_oracle,
    connector_stats,
    executed_tokens,
    vllm_counters,
)
from vllm_artifact_testing.store_faults import small_tmpfs

from vllm_artifact.client import R3Keys, read_r3_keys
from vllm_artifact.core import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_arena import ARENA_NAME, ArenaGeometry
from vllm_artifact.integration.metrics import StoreCollector
from vllm_artifact.selftest.oracle import assert_routing_matches, hf_router_topk

pytestmark = pytest.mark.engine

KV_BLOCKS = 64
#: ``auto`` capacity: room for 2 x the R3 of every KV block (docs/configuration.md).
AUTO_OBJECTS = 2 * KV_BLOCKS
ENGINE = {
    "num_gpu_blocks_override": KV_BLOCKS,
    "max_num_seqs": 4,
    "max_model_len": 1024,
    "disable_log_stats": False,  # vLLM counts preemptions
}


@dataclass
class ModuleEngine:
    """The module's engine; the crash test replaces it with the engine it restarts."""

    llm: Any


@pytest.fixture(scope="module")
def engine(model_a: Path, store_root: Path, llm_factory: Any) -> ModuleEngine:
    return ModuleEngine(llm_factory(model_a, artifact_root=str(store_root), **ENGINE))


@pytest.fixture
def llm(engine: ModuleEngine) -> Any:
    return engine.llm


def model_layout(model: Path) -> R3Layout:
    """The R3 layout of a tiny model, from its config.json (every layer MoE)."""
    config = json.loads((model / "config.json").read_text())
    assert config["mlp_only_layers"] == [] and config["decoder_sparse_step"] == 1
    return R3Layout(
        num_layers=config["num_hidden_layers"],
        top_k=config["num_experts_per_tok"],
        num_experts=config["num_experts"],
        block_size=int(str(ENGINE_KWARGS["block_size"])),
    )


def exported_store_metrics(root: Path) -> dict[str, float]:
    """What vLLM's /metrics would show for the stores under ``root`` (our collector,
    rendered and parsed as Prometheus text), by sample name; one store."""
    collector = StoreCollector()
    collector.add_root(root)
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name not in values or "_bucket" in sample.name, sample
            values[sample.name] = sample.value
    return values


def test_serving_ten_times_the_capacity(llm: Any, model_a: Path, store_root: Path) -> None:
    # The configured capacity, measured from outside the engine: the arena file on disk and a
    # reader's own count of the objects in it, against the documented ``auto`` value.
    layout = model_layout(model_a)
    assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == KV_BLOCKS
    auto = ArenaGeometry(layout, AUTO_OBJECTS)
    (name,) = store_names(store_root)
    arena = store_root / name / ARENA_NAME
    assert arena.stat().st_size == auto.file_nbytes == 49152  # 128 objects of 256 bytes
    reader = ShmStore.open_reader(str(store_root), name)
    stats = connector_stats(llm)
    assert stats["capacity_objects"] == reader.stats().capacity_objects == AUTO_OBJECTS
    assert stats["capacity_bytes"] == auto.file_nbytes
    capacity_tokens = AUTO_OBJECTS * layout.block_size
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    served_tokens = 0
    max_objects = 0
    previous: list[str] = []
    outputs = []
    try:
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
            connector_stats(llm)  # waits until the round's publications are out
            max_objects = max(max_objects, reader.stats().objects)
            assert arena.stat().st_size == auto.file_nbytes
        objects = reader.stats().objects
    finally:
        reader.close()
    after = connector_stats(llm)
    print(
        f"served {served_tokens} tokens in {len(outputs)} requests; store capacity "
        f"{AUTO_OBJECTS} objects, at most {max_objects} held, {after['evictions']} evictions, "
        f"{after['reads'] - stats['reads']} objects read for prefix hits, {after['pinned']} "
        f"pinned at the end (KV cache: {KV_BLOCKS} blocks)"
    )
    assert served_tokens >= 10 * capacity_tokens
    assert objects == after["objects"] and max_objects == AUTO_OBJECTS  # full, never above
    assert after["evictions"] - stats["evictions"] > 0
    assert after["reads"] > stats["reads"], "repeats must have been served from the store"
    # Pins follow the KV cache: only objects whose block the KV cache still holds are pinned.
    assert 0 < after["pinned"] <= KV_BLOCKS
    exported = exported_store_metrics(store_root)  # what /metrics shows for this store
    assert exported["vllm_artifact_store_evictions_total"] == after["evictions"]
    assert exported["vllm_artifact_store_pinned_objects"] == after["pinned"]
    assert exported["vllm_artifact_store_objects"] == objects
    assert exported["vllm_artifact_store_capacity_bytes"] == auto.file_nbytes
    # Every request's R3 against the oracle (a repeated prompt's tokens are run once).
    oracles: dict[tuple[int, ...], Any] = {}
    for output in outputs:
        tokens = tuple(executed_tokens(output))
        if tokens not in oracles:
            oracles[tokens] = hf_router_topk(model_a, tokens)
        experts = output.outputs[0].routed_experts
        assert experts is not None and experts.shape[0] == len(tokens)
        assert_routing_matches(experts, oracles[tokens])


def test_a_prefix_cache_reset_unpins_every_object(llm: Any) -> None:
    """Pins follow the KV cache through a reset too: once vLLM drops every block, no object
    stays pinned; the next request pins its own blocks only."""
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    block_size = int(str(ENGINE_KWARGS["block_size"]))
    llm.generate(
        [
            " ".join(f"Before reset {k}, sentence {j} routes to {j % 8}." for j in range(24))
            for k in range(4)
        ],
        greedy,
    )
    pinned_before = connector_stats(llm)["pinned"]
    assert llm.reset_prefix_cache()
    # The reset reaches rank zero with the next step's metadata.
    (output,) = llm.generate(["After the reset, one short request of its own."], greedy)
    own_blocks = (len(output.prompt_token_ids) + 4) // block_size
    pinned_after = connector_stats(llm)["pinned"]
    assert pinned_before > own_blocks, pinned_before
    assert pinned_after <= own_blocks, (pinned_before, pinned_after)


def test_preemption_recompute_matches_oracle(llm: Any, model_a: Path) -> None:
    # 64 KV blocks of 32 tokens hold 2048 tokens; four ~470-token prompts growing by 100 tokens
    # need 18 blocks each, so they cannot all stay resident: vLLM preempts and recomputes.
    prompts = [
        " ".join(f"Request {r} sentence {i} for preemption." for i in range(24)) for r in range(4)
    ]
    # The first two return rows, the last two (the ones vLLM preempts first: it preempts the
    # latest arrival) a keys-only handle; both must span the rows from before preemption.
    arrays = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    keys = arrays.clone()
    keys.extra_args = {"routed_experts_format": "keys"}
    before = preemptions(llm)
    outputs = llm.generate(prompts, [arrays, arrays, keys, keys])
    assert preemptions(llm) > before, "the KV cache was meant to force preemption"
    for output in outputs[:2]:
        assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
        assert_matches_oracle(model_a, output)
    for output in outputs[2:]:
        assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
        handle = output.outputs[0].routed_experts
        assert isinstance(handle, R3Keys), handle
        tokens = executed_tokens(output)
        experts = read_r3_keys(handle).experts
        assert experts.shape[0] == len(tokens)
        assert_routing_matches(experts, hf_router_topk(model_a, tokens))


def preemptions(llm: Any) -> float:
    return vllm_counters(llm, "vllm:num_preemptions")["vllm:num_preemptions"]


def test_sigkill_mid_generation_then_restart_on_the_same_root(
    engine: ModuleEngine, model_a: Path, store_root: Path, llm_factory: Any
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
    llm = engine.llm
    runner = threading.Thread(target=llm.generate, args=(prompts, long_run), daemon=True)
    before = published(store_root)
    runner.start()
    wait_for_publications(store_root, before + 8)  # the background publisher is writing
    killed = sigkill(os.getpid(), "engine")
    llm._test_shut_down = True  # its processes are gone; nothing to shut down
    print(f"SIGKILLed {killed} after {published(store_root) - before} publications")

    second = llm_factory(model_a, artifact_root=str(store_root), **ENGINE)
    engine.llm = second  # the module's engine from now on
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


def test_auto_capacity_that_dev_shm_cannot_hold_fails_at_startup(
    model_a: Path, llm_factory: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """``auto`` capacity is checked against the free space of the root's /dev/shm mount at
    startup: an engine on a 16 KiB tmpfs (its ``auto`` arena needs 48 KiB) fails to start
    with ShmSpaceError saying what to do, instead of a SIGBUS later."""
    auto = ArenaGeometry(model_layout(model_a), AUTO_OBJECTS).file_nbytes
    with small_tmpfs(16 * 1024) as root:
        with pytest.raises(RuntimeError, match="Engine core initialization failed"):
            llm_factory(model_a, artifact_root=str(root), **ENGINE)
        assert list(root.iterdir()) == []  # nothing allocated
    log = "".join(capfd.readouterr())
    assert "ShmSpaceError" in log, log[-3000:]
    expected = f"/dev/shm has 16 KiB free but the R3 store needs {auto // 1024} KiB."
    assert expected in log, log[-3000:]
    assert "docker --shm-size" in log and "smaller --artifact-capacity" in log
