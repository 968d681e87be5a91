"""Runtime combinations on the real engine (issue 5 cells that exercise our own code).

* Tensor parallelism 2 on the uint16 model (300 experts, a dense layer): every rank captures,
  rank zero alone owns the store; R3 equals the oracle's, IDs above 255 and the dense mark.
* A KV connector with ``kv_role=kv_both`` (vLLM's ExampleConnector, KV saved on disk) after the
  first engine is SIGKILLed and a second starts: the prefix arrives as an *external* KV hit,
  and its R3 comes from the store that outlived the first engine (vLLM's in-process store dies
  with it).
* Asynchronous scheduling (kept on by the CPU test switch) with prefix hits from the store.
* N-gram speculative decoding (MRV2's n-gram speculator; on CPU its drafts come from the CPU
  support package's PyTorch proposer): rows of rejected drafts never reach the output.
* EAGLE speculative decoding with a tiny draft that mostly guesses right (drafts accepted and
  rejected; the draft has no router).
* The async and n-gram engines share one store root (two live engines, two stores): both
  generate at once while a separate process reads every object of both stores.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.eagle_draft import build_bigram_eagle_draft
from vllm_artifact_testing.engine_probe import (
    assert_matches_oracle,
    connector_stats,
    vllm_counters,
)

from vllm_artifact.client import decode_r3, read_r3_keys

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
KEYS = {"routed_experts_format": "keys"}
PROMPT = " ".join(f"Matrix sentence {i} picks expert {i * 3 % 8}." for i in range(24))


def check(model: Path, output: Any) -> None:
    assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
    assert_matches_oracle(model, output)


@pytest.mark.parametrize("tracker", ["engine", "process"])
def test_tensor_parallel_2_uint16_model_rank_zero_alone_writes(
    model_b: Path, store_root: Path, llm_factory: Any, kill_engine: Any, tracker: str
) -> None:
    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # Two CPU workers on two cores must be bound by hand (vLLM's automatic binding needs NUMA).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        llm = llm_factory(
            model_b,
            artifact_root=str(store_root / f"tp2-{tracker}"),
            artifact_tracker=tracker,
            tensor_parallel_size=2,
        )
    finally:
        if previous is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous

    def roles(worker: Any) -> tuple[bool, bool, bool]:
        """Connector, store, large batches written inline (the /dev/shm store's writer), or
        with the tracker process: connector, tracker process, no store in this process."""
        connector = worker.model_runner.aux_output_connector
        if tracker == "process":
            return (
                connector is not None,
                connector.tracker_pid is not None,
                connector.store is None,
            )
        publisher = connector._publisher
        return (
            connector is not None,
            connector.store is not None,
            publisher is not None and publisher.inline_from_blocks is not None,
        )

    writer = [(True, False, True), (True, True, True)] if tracker == "process" else None
    assert sorted(llm.collective_rpc(roles)) == (
        writer or [(True, False, False), (True, True, True)]
    )
    prompts = [PROMPT, "The router picks four of three hundred experts."]
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts[:1], GREEDY)[0]
    for output in (*first, again):
        check(model_b, output)
        experts = output.outputs[0].routed_experts
        assert experts.dtype == np.uint16 and experts.shape[1:] == (4, 4)
        # vLLM leaves the dense layer's rows at 0 (like expert 0); ours carries the dense mark.
        assert (experts[:, 1, :] == 65535).all()
        assert decode_r3(output.outputs[0]).dense_layers == (1,)
    assert max(o.outputs[0].routed_experts[:, [0, 2, 3]].max() for o in first) > 255, (
        "IDs above 255 need uint16"
    )
    assert again.num_cached_tokens >= 32
    assert connector_stats(llm)["reads"] == again.num_cached_tokens // 32
    np.testing.assert_array_equal(
        again.outputs[0].routed_experts, first[0].outputs[0].routed_experts
    )
    kill_engine(llm)  # two CPU workers each: not kept for the module's other engines


def test_external_kv_hit_after_restart_is_served_from_the_store(
    model_a: Path, store_root: Path, tmp_path: Path, llm_factory: Any, kill_engine: Any
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
    assert connector_stats(first_engine)["objects"] > 0  # waits until its publications are out
    kill_engine(first_engine)  # the store and the saved KV outlive a SIGKILL

    second_engine = llm_factory(model_a, **settings)
    before = connector_stats(second_engine)["reads"]
    again = second_engine.generate([PROMPT], GREEDY)[0]
    check(model_a, again)
    assert connector_stats(second_engine)["reads"] > before, "prefix R3 must come from the store"
    assert (again.outputs[0].routed_experts == first.outputs[0].routed_experts).all()


@pytest.fixture(scope="module")
def shared_root(store_root: Path) -> Path:
    """One root for two live engines of the same model (each gets its own store)."""
    return store_root / "shared"


@pytest.fixture(scope="module")
def async_llm(model_a: Path, shared_root: Path, llm_factory: Any) -> Any:
    """vLLM's CPU platform turns async scheduling off; the CPU test switch keeps it on, so
    ArtifactAsyncScheduler runs with steps planned ahead of the previous step's output."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ARTIFACT_CPU_ASYNC_SCHEDULING", "1")  # read when the engine starts
        return llm_factory(model_a, artifact_root=str(shared_root), async_scheduling=True)


def test_async_scheduling_with_prefix_caching(async_llm: Any, model_a: Path) -> None:
    llm = async_llm
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


def test_a_prefill_steps_blocks_written_inline_are_read_back_as_prefix_hits(
    async_llm: Any, model_a: Path
) -> None:
    """A step that completes 64 blocks or more has them written inline on the step thread
    (core/publisher.py); its requests' R3 matches the oracle, and so does that of the same
    prompts again, whose prefix rows are read from those objects."""
    llm = async_llm
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompts = [
        " ".join(f"Inline batch {p} sentence {i} routes to {(i * p) % 7}." for i in range(40))
        for p in range(8)
    ]
    before = connector_stats(llm)
    first = llm.generate(prompts, GREEDY)
    total = sum(len(output.prompt_token_ids) for output in first)
    assert min(budget, total) >= 64 * 32, "one step must complete 64 blocks of 32 tokens"
    for output in first:
        check(model_a, output)
    written = connector_stats(llm)
    assert written["inline_batches"] > before["inline_batches"]
    again = llm.generate(prompts, GREEDY)
    for output, earlier in zip(again, first, strict=True):
        check(model_a, output)
        assert output.num_cached_tokens >= 32
        np.testing.assert_array_equal(
            output.outputs[0].routed_experts, earlier.outputs[0].routed_experts
        )
    assert connector_stats(llm)["reads"] > written["reads"], "prefix R3 must come from the store"


SPEC_DECODE_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def spec_decode_counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative decoding counters (needs ``disable_log_stats=False``)."""
    return vllm_counters(llm, *SPEC_DECODE_COUNTERS)


def generate_speculatively(
    llm: Any, model: Path, prompts: list[str], params: SamplingParams
) -> tuple[list[Any], float, float]:
    """Generate, check every output against the oracle; returns the outputs and how many
    drafts the engine proposed and accepted during this call."""
    before = spec_decode_counters(llm)
    outputs = llm.generate(prompts, params)
    for output in outputs:
        check(model, output)
    after = spec_decode_counters(llm)
    drafted, accepted = (after[name] - before[name] for name in SPEC_DECODE_COUNTERS)
    return outputs, drafted, accepted


def assert_keys_path_equal(llm: Any, prompts: list[str], max_tokens: int, arrays: Any) -> None:
    """The same greedy requests on the keys path read back the array path's rows."""
    keys = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=KEYS)
    for output, earlier in zip(llm.generate(prompts, keys), arrays, strict=True):
        read = read_r3_keys(output.outputs[0].routed_experts, timeout=60).experts
        np.testing.assert_array_equal(read, earlier.outputs[0].routed_experts)


@pytest.fixture(scope="module")
def ngram_llm(model_a: Path, shared_root: Path, llm_factory: Any) -> Any:
    return llm_factory(
        model_a,
        artifact_root=str(shared_root),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        },
        disable_log_stats=False,
    )


def test_ngram_speculative_decoding_matches_oracle(ngram_llm: Any, model_a: Path) -> None:
    """Each step verifies 3 n-gram drafts per request; R3 holds exactly the executed tokens
    (accepted drafts kept, rejected drafts' rows cut), also when the prefix comes from the
    store, and on the keys path."""
    llm = ngram_llm
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
    first, drafted, accepted = generate_speculatively(llm, model_a, prompts, greedy)
    assert 0 < accepted < drafted, f"drafts must be both accepted and rejected: {drafted=}"

    before = connector_stats(llm)["reads"]
    again = llm.generate(prompts, greedy)
    assert again[0].num_cached_tokens >= 32
    assert connector_stats(llm)["reads"] > before, "prefix R3 must come from the store"
    for output, earlier in zip(again, first, strict=True):
        check(model_a, output)
        assert output.outputs[0].token_ids == earlier.outputs[0].token_ids
        assert (output.outputs[0].routed_experts == earlier.outputs[0].routed_experts).all()
    assert_keys_path_equal(llm, prompts, 32, first)


EAGLE_PROMPTS = [
    " ".join(f"Matrix sentence {i} picks expert {i * 3 % 8}." for i in range(6)),
    "one two three four five one two three four five one two three four five one two",
    " ".join(["the cat sat on the mat and the dog sat on the log"] * 2),
]


def test_eagle_speculative_decoding_matches_oracle(
    model_a: Path,
    store_root: Path,
    llm_factory: Any,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """EAGLE (Model Runner V2's EagleSpeculator) with a tiny draft that mostly guesses right:
    the draft model has no router and is never bound to the capturer, R3 holds the target's
    routing of exactly the executed tokens (drafts accepted and rejected), and drafts verified
    past ``max_tokens`` (dropped by vLLM) do not keep the terminal partial block out of the
    store (keys path).

    Its store has an explicit ``--artifact-capacity`` of 64 KiB, room for 160 objects, far
    fewer than the KV cache's blocks (plenty for this test): the engine says so at startup
    (a prefix hit on an evicted object would fail its request)."""
    draft = build_bigram_eagle_draft(model_a, tmp_path / "eagle-draft", EAGLE_PROMPTS)
    capfd.readouterr()  # the engine's log from here on
    llm = llm_factory(
        model_a,
        artifact_root=str(store_root / "eagle"),
        artifact_capacity="64KiB",
        speculative_config={"method": "eagle", "model": str(draft), "num_speculative_tokens": 2},
        disable_log_stats=False,
    )
    kv_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    log = "".join(capfd.readouterr())
    warning = (
        f"--artifact-capacity 0.1 MiB holds 160 R3 blocks but the KV cache can hold "
        f"{kv_blocks}: a prefix hit on an evicted object fails that request"
    )
    assert kv_blocks > 160 and warning in log, log[-3000:]

    def speculator(worker: Any) -> str:
        return type(worker.model_runner.speculator).__name__

    assert llm.collective_rpc(speculator) == ["EagleSpeculator"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first, drafted, accepted = generate_speculatively(llm, model_a, EAGLE_PROMPTS, greedy)
    assert 0 < accepted < drafted, f"drafts must be both accepted and rejected: {drafted=}"
    stats = connector_stats(llm)
    assert stats["tails"] == len(EAGLE_PROMPTS)
    assert stats["capacity_objects"] == 160 and stats["evictions"] == 0, stats
    assert_keys_path_equal(llm, EAGLE_PROMPTS, 24, first)
    print(f"EAGLE: {accepted:.0f} of {drafted:.0f} drafts accepted")


READER_PROCESS = """
import json, sys
from pathlib import Path
from vllm_artifact_testing.chaos import check_root
root, stop = Path(sys.argv[1]), Path(sys.argv[2])
scrubs = checked = corrupt = 0
stores = set()
while not stop.exists() or scrubs < 2:
    check = check_root(root)
    stores.update(check.stores)
    scrubs += 1
    checked += check.objects
    corrupt += check.corrupt
seen = {"scrubs": scrubs, "checked": checked, "corrupt": corrupt, "stores": sorted(stores)}
print(json.dumps(seen))
"""


def test_two_engines_on_one_root_while_another_process_reads(
    async_llm: Any, ngram_llm: Any, model_a: Path, shared_root: Path, tmp_path: Path
) -> None:
    """Two live engines of one model on one root publish to their own stores at the same
    time; a separate process reads every object of both, over and over, meanwhile."""
    stop = tmp_path / "stop"
    reader = subprocess.Popen(
        [sys.executable, "-c", READER_PROCESS, str(shared_root), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    prompts = [
        " ".join(f"Concurrent engines {k} line {i} expert {i * k % 8}." for i in range(20))
        for k in range(3)
    ]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            runs = [pool.submit(llm.generate, prompts, greedy) for llm in (async_llm, ngram_llm)]
            results = [run.result(timeout=600) for run in runs]
    finally:
        stop.touch()
        out, _ = reader.communicate(timeout=300)
    for outputs in results:
        for output in outputs:
            check(model_a, output)
    seen = json.loads(out)
    assert reader.returncode == 0 and seen["corrupt"] == 0, seen
    assert len(seen["stores"]) == 2 and seen["checked"] > 0, seen
    print(f"reader process: {seen}")
