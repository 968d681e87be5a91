"""Offline ``LLM(..., enable_routed_experts=True).generate()`` on a real engine vs the oracle,
then the store under faults on the same engine: R3 of prefix hits comes from the /dev/shm
store, and a missing or corrupt object fails only the affected request, closed.

One engine (module fixture) on a private store root. The oracle is a Hugging Face
transformers forward pass of the same weights (router top-k per token and layer); rows are
compared as sets.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm_artifact_testing.engine_probe import (
    assert_matches_oracle,
    connector_stats,
    executed_tokens,
)
from vllm_artifact_testing.store_faults import flip_in_every_slot

from vllm_artifact.client import R3Keys, decode_r3, r3_failure, read_r3_keys
from vllm_artifact.client import reader as client_reader
from vllm_artifact.core.npy import npy_file_of
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_assembly import ArrivingRows, FilePool
from vllm_artifact.errors import CapacityError, WeightVersionError
from vllm_artifact.integration.hooks import terminal_output
from vllm_artifact.selftest.oracle import assert_routing_matches, hf_router_topk

pytestmark = pytest.mark.engine

# A chunk budget far below the long prompt's length forces chunked prefill.
CHUNK_BUDGET = 64
LONG_PROMPT = " ".join(
    f"Expert {i} of the mixture handles token {i * 7 % 13} in layer {i % 4}." for i in range(40)
)
SHORT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning replays the router.",
    "Hello, world! How are you today?",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_a(model_a: Path, store_root: Path, llm_factory: Any) -> Any:
    return llm_factory(
        model_a, artifact_root=str(store_root), max_num_batched_tokens=CHUNK_BUDGET, max_num_seqs=8
    )


@pytest.fixture(autouse=True)
def fresh_prefix_cache(llm_a: Any) -> None:
    """Each test starts with an empty prefix cache, so it passes in any order and alone: the
    fault tests damage every object in the store, and a later test's first request must not
    hit a prefix whose R3 they damaged (it recomputes and republishes, replacing it)."""
    assert llm_a.reset_prefix_cache()


def test_rank_zero_runs_with_the_default_switch_interval(llm_a: Any) -> None:
    def interval(worker: Any) -> float:
        return sys.getswitchinterval()

    assert llm_a.collective_rpc(interval) == [pytest.approx(0.0005)]


def test_shape_and_dtype_uint8(llm_a: Any) -> None:
    outputs = llm_a.generate(SHORT_PROMPTS, GREEDY)
    for output in outputs:
        experts = output.outputs[0].routed_experts
        prompt_len = len(output.prompt_token_ids)
        generated = len(output.outputs[0].token_ids)
        assert generated == GREEDY.max_tokens
        assert experts.shape == (prompt_len + generated - 1, 4, 2)
        assert experts.dtype == np.uint8


def test_batch_matches_oracle(llm_a: Any, model_a: Path) -> None:
    for output in llm_a.generate(SHORT_PROMPTS, GREEDY):
        assert_matches_oracle(model_a, output)


def test_chunked_prefill_and_prefix_hit_match_oracle(llm_a: Any, model_a: Path) -> None:
    first = llm_a.generate([LONG_PROMPT], GREEDY)[0]
    prompt_len = len(first.prompt_token_ids)
    assert prompt_len > 3 * CHUNK_BUDGET, "the prompt must span several prefill chunks"
    first_rows = assert_matches_oracle(model_a, first)

    again = llm_a.generate([LONG_PROMPT], GREEDY)[0]
    # Block size 32: every full block of the prompt but the last is served from the KV cache.
    assert again.num_cached_tokens is not None and again.num_cached_tokens >= 32
    again_rows = assert_matches_oracle(model_a, again)
    np.testing.assert_array_equal(again_rows, first_rows)


def test_sampled_generation_matches_oracle(llm_a: Any, model_a: Path) -> None:
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=1)
    for output in llm_a.generate(SHORT_PROMPTS, sampled):
        assert_matches_oracle(model_a, output)


def test_stop_string_keeps_exact_executed_rows(llm_a: Any, model_a: Path) -> None:
    """A stop string found in the frontend drops the tokens after it, and their rows."""
    prompt = "Stop strings cut the text at an exact token boundary:"
    unbounded = llm_a.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    tokens = list(unbounded.outputs[0].token_ids)
    stop = llm_a.get_tokenizer().decode(tokens[10:12])
    assert stop and stop in unbounded.outputs[0].text
    stopped = llm_a.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < len(tokens)
    experts = assert_matches_oracle(model_a, stopped)
    np.testing.assert_array_equal(experts, unbounded.outputs[0].routed_experts[: experts.shape[0]])


def test_rows_reach_the_frontend_in_two_parts_unless_a_stop_string_can_end_the_request(
    llm_a: Any, model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine sends the prompt's rows of a request it ends itself at once and holds the
    rest until its end; a request with stop strings (the frontend matches them, and may end
    it before the engine does) gets them step by step. Both equal the oracle, and both were
    joined as they arrived (no concatenation at the end)."""
    chunk_counts: list[int] = []
    join = ArrivingRows.joined

    def counting_join(chunks: ArrivingRows) -> Any:
        chunk_counts.append(len(chunks))
        joined = join(chunks)
        assert joined is not None  # not the fallback
        return joined

    monkeypatch.setattr(ArrivingRows, "joined", counting_join)
    monkeypatch.setattr(terminal_output, "concatenate_into_npy", None)  # never called
    held = llm_a.generate([LONG_PROMPT], GREEDY)[0]  # chunked prefill, then 11 decode steps
    assert chunk_counts == [2]  # the prompt's (and first token's) rows, then the rest
    assert_matches_oracle(model_a, held)

    chunk_counts.clear()
    never_said = SamplingParams(**_greedy_args(), stop=["never said by this model"])
    per_step = llm_a.generate([LONG_PROMPT], never_said)[0]
    assert len(chunk_counts) == 1 and chunk_counts[0] >= GREEDY.max_tokens - 1
    np.testing.assert_array_equal(
        assert_matches_oracle(model_a, per_step), held.outputs[0].routed_experts
    )


def test_the_frontends_files_come_from_its_pool_and_are_used_again_once_dropped(
    llm_a: Any, model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R3 files cut from the frontend's pool (here for files of any size: this model's are
    far below the pool's smallest) carry the oracle's rows; rows a caller keeps stay intact
    while later requests fill the pool, and dropped rows' memory serves the next requests."""
    pool = FilePool(RecycledArrays(max_bytes=1 << 20, min_bytes=1, steps_per_doubling=4))
    monkeypatch.setattr(terminal_output, "_FILES", pool)
    kept = llm_a.generate(SHORT_PROMPTS, GREEDY)
    kept_rows = [assert_matches_oracle(model_a, output) for output in kept]
    assert all(npy_file_of(rows) is not None for rows in kept_rows)
    assert all(not npy_file_of(rows).flags.owndata for rows in kept_rows)  # type: ignore[union-attr]
    assert pool.arrays.reused == 0
    before = [rows.copy() for rows in kept_rows]
    later = llm_a.generate([LONG_PROMPT, *SHORT_PROMPTS], GREEDY)
    for rows, copy in zip(kept_rows, before, strict=True):
        np.testing.assert_array_equal(rows, copy)
    buffers = pool.arrays.nbytes
    del kept, kept_rows, later
    again = llm_a.generate(SHORT_PROMPTS, GREEDY)
    assert pool.arrays.reused >= len(SHORT_PROMPTS) and pool.arrays.nbytes == buffers
    for output in again:
        assert_matches_oracle(model_a, output)


def test_a_prefix_hits_first_rows_arrive_in_the_file_the_engine_made(
    llm_a: Any, model_a: Path
) -> None:
    """A repeated long prompt: the engine reads its hit rows from the store into a new array
    with its computed rows, made the data part of a ``.npy`` file with room for the generated
    tokens' rows; the frontend adopts the frame that file arrives in instead of copying the
    prompt's rows (counted on /metrics). The answer is the oracle's, as the first time, and
    exactly np.save's file."""

    def files(how: str) -> float:
        found = REGISTRY.get_sample_value("vllm_artifact_frontend_files_total", {"how": how})
        return found or 0.0

    copied, adopted = files("copied"), files("adopted")
    first = llm_a.generate([LONG_PROMPT], GREEDY)[0]
    # no prefix hit: its rows are views of steps' arrays, copied as they arrive
    assert (files("copied"), files("adopted")) == (copied + 1, adopted)
    again = llm_a.generate([LONG_PROMPT], GREEDY)[0]
    assert again.num_cached_tokens > 0
    assert (files("copied"), files("adopted")) == (copied + 1, adopted + 1)
    rows = assert_matches_oracle(model_a, again)
    np.testing.assert_array_equal(rows, first.outputs[0].routed_experts)
    file = npy_file_of(rows)
    with io.BytesIO() as saved:
        np.save(saved, np.ascontiguousarray(rows), allow_pickle=False)
        assert file is not None and file.tobytes() == saved.getvalue()


def test_n_logprobs_and_penalties_with_r3(llm_a: Any, model_a: Path) -> None:
    """Sampling features keep working with R3 on, and every completion gets its own rows.
    (Structured output cannot run on the CPU backend: docs/compatibility.md.)"""
    params = SamplingParams(
        n=2,
        max_tokens=12,
        temperature=0.9,
        seed=5,
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        ignore_eos=True,
    )
    output = llm_a.generate([SHORT_PROMPTS[0]], params)[0]
    assert len(output.outputs) == 2
    for index, completion in enumerate(output.outputs):
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids) == 12
        assert_matches_oracle(model_a, output, index)


KEYS = {"routed_experts_format": "keys"}


def test_keys_only_handoff_reads_back_the_array_paths_rows(llm_a: Any, model_a: Path) -> None:
    """``routed_experts_format="keys"``: each completion carries an ``R3Keys`` handle instead of
    rows; reading it from the store gives exactly the array path's (oracle-equal) rows, for a
    chunked prefill with a prefix hit, a batch, n > 1, a stop string and a prompt start."""
    prompts = [LONG_PROMPT, *SHORT_PROMPTS]
    arrays = llm_a.generate(prompts, GREEDY)
    keyed = llm_a.generate(prompts, SamplingParams(**_greedy_args(), extra_args=KEYS))
    assert keyed[0].num_cached_tokens >= 32  # the long prompt's prefix came from the KV cache
    for by_array, by_keys in zip(arrays, keyed, strict=True):
        handle = by_keys.outputs[0].routed_experts
        assert isinstance(handle, R3Keys), handle
        # rows from token 0: the frontend checked the objects' envelopes, not their payloads
        assert handle.objects_xxh3 is not None and handle.rows_xxh3 is None, handle
        assert list(by_keys.outputs[0].token_ids) == list(by_array.outputs[0].token_ids)
        read = read_r3_keys(handle)
        np.testing.assert_array_equal(read.experts, by_array.outputs[0].routed_experts)
        assert read.dense_layers == decode_r3(by_array.outputs[0]).dense_layers

    sampled = SamplingParams(n=2, max_tokens=9, temperature=0.9, seed=3, extra_args=KEYS)
    output = llm_a.generate([SHORT_PROMPTS[1]], sampled)[0]
    for index, completion in enumerate(output.outputs):
        read = read_r3_keys(completion.routed_experts).experts
        assert_routing_matches(read, hf_router_topk(model_a, executed_tokens(output, index)))

    # A stop token (the engine stops on it, unlike stop strings) ends a request mid-block.
    prompt = "Stop tokens end a request inside a block:"
    unbounded = llm_a.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    stop_id = unbounded.outputs[0].token_ids[9]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id], extra_args=KEYS)
    stopped = llm_a.generate([prompt], params)[0]
    assert stopped.outputs[0].finish_reason == "stop"
    read = read_r3_keys(stopped.outputs[0].routed_experts).experts
    assert read.shape[0] == len(executed_tokens(stopped))
    np.testing.assert_array_equal(read, unbounded.outputs[0].routed_experts[: read.shape[0]])

    start = SamplingParams(**_greedy_args(), routed_experts_prompt_start=20, extra_args=KEYS)
    late = llm_a.generate([LONG_PROMPT], start)[0]
    assert late.outputs[0].routed_experts.rows_xxh3 is not None  # rows from mid-block
    read = read_r3_keys(late.outputs[0].routed_experts).experts
    np.testing.assert_array_equal(read, arrays[0].outputs[0].routed_experts[20:])


def _greedy_args() -> dict[str, Any]:
    return {"max_tokens": GREEDY.max_tokens, "temperature": 0, "ignore_eos": True}


def test_bad_format_option_is_a_clear_error(llm_a: Any) -> None:
    bad = SamplingParams(max_tokens=2, extra_args={"routed_experts_format": "npz"})
    with pytest.raises(VLLMValidationError, match="routed_experts_format must be one of"):
        llm_a.generate(["x"], bad)
    stop = SamplingParams(max_tokens=2, stop=["."], extra_args=KEYS)
    with pytest.raises(VLLMValidationError, match="cannot be combined with stop strings"):
        llm_a.generate(["x"], stop)
    assert llm_a.generate(["x"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


# The store under faults, on the same engine (these run last: they corrupt every stored object).
STORE_GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT_ONE = " ".join(f"Block {i} of the first prompt goes to expert {i % 8}." for i in range(24))
PROMPT_TWO = " ".join(f"Another text {i} that shares no prefix, layer {i % 4}." for i in range(24))


def test_prefix_hit_is_served_from_the_store(llm_a: Any, model_a: Path) -> None:
    """A prompt no other test sends: every object it publishes is new to the store."""
    prompt = " ".join(
        f"Store hit {i}, counted from a fresh start, expert {i % 8}." for i in range(24)
    )
    start = connector_stats(llm_a)
    first = llm_a.generate([prompt], STORE_GREEDY)[0]
    assert_matches_oracle(model_a, first)
    before = connector_stats(llm_a)
    executed = len(executed_tokens(first))
    # Every full block, plus the terminal partial block of a normal finish.
    assert before["objects"] - start["objects"] == executed // 32 + (executed % 32 > 0)
    assert before["tails"] - start["tails"] == (executed % 32 > 0)

    again = llm_a.generate([prompt], STORE_GREEDY)[0]
    assert again.num_cached_tokens >= 32
    after = connector_stats(llm_a)
    assert after["reads"] - before["reads"] == again.num_cached_tokens // 32
    assert_matches_oracle(model_a, again)
    np.testing.assert_array_equal(again.outputs[0].routed_experts, first.outputs[0].routed_experts)


def test_corrupt_object_fails_that_request_only(
    llm_a: Any, model_a: Path, store_root: Path
) -> None:
    llm_a.generate([PROMPT_ONE], STORE_GREEDY)  # make sure its blocks are published
    flip_in_every_slot(store_root, where="payload")
    hit, fresh = llm_a.generate([PROMPT_ONE, PROMPT_TWO], STORE_GREEDY)
    assert hit.outputs[0].finish_reason == "error"
    assert hit.outputs[0].routed_experts is None
    failure = r3_failure(hit.outputs[0].stop_reason)
    assert failure is not None and failure.reason == "corrupt", hit.outputs[0].stop_reason
    assert "checksum" in failure.message
    # The other request of the same batch is untouched and the engine goes on.
    assert fresh.outputs[0].finish_reason == "length"
    assert_matches_oracle(model_a, fresh)


def test_deleted_object_fails_closed_and_engine_keeps_serving(
    llm_a: Any, model_a: Path, store_root: Path
) -> None:
    llm_a.generate([PROMPT_TWO], STORE_GREEDY)
    flip_in_every_slot(store_root, where="key")
    hit = llm_a.generate([PROMPT_TWO], STORE_GREEDY)[0]
    assert hit.outputs[0].finish_reason == "error"
    failure = r3_failure(hit.outputs[0].stop_reason)
    assert failure is not None and failure.reason == "missing", hit.outputs[0].stop_reason
    # Not a capacity problem (nothing was evicted): the message names the stores searched.
    assert "removed or evicted from this engine's store" in failure.message
    assert "Increase --artifact-capacity" not in failure.message
    later = llm_a.generate(["A short prompt after the failure."], STORE_GREEDY)[0]
    assert later.outputs[0].finish_reason == "length"
    assert_matches_oracle(model_a, later)


def test_weight_version_change_never_reuses_old_objects(llm_a: Any, model_a: Path) -> None:
    prompt = " ".join(f"Weights version test sentence {i}." for i in range(30))
    llm_a.generate([prompt], STORE_GREEDY)
    llm_a.llm_engine.set_weight_version("v2")
    try:
        # The KV cache still holds the prompt (a hit), but its R3 was keyed under the old
        # version: the request fails closed instead of returning the old weights' routing.
        stale = llm_a.generate([prompt], STORE_GREEDY)[0]
        assert stale.outputs[0].finish_reason == "error"
        assert "missing" in str(stale.outputs[0].stop_reason)
        assert "reset the prefix cache" in str(stale.outputs[0].stop_reason)
        # After a prefix-cache reset (what RL loops do after a weight update) it recomputes.
        assert llm_a.reset_prefix_cache()
        fresh = llm_a.generate([prompt], STORE_GREEDY)[0]
        assert fresh.outputs[0].finish_reason == "length"
        assert_matches_oracle(model_a, fresh)
    finally:
        llm_a.llm_engine.set_weight_version("default")


BAD_WEIGHT_VERSIONS = ["", "v" * 4097, "step-\ud800"]


@pytest.mark.parametrize("bad", BAD_WEIGHT_VERSIONS, ids=["empty", "too-long", "lone-surrogate"])
def test_a_weight_version_keys_cannot_carry_is_refused_and_the_engine_keeps_serving(
    llm_a: Any, model_a: Path, bad: str
) -> None:
    """vLLM accepts any string; before it was checked, the next step raised inside the worker
    (or EngineCore) and the engine died. Every way in refuses it and keeps the old version."""
    engine = llm_a.llm_engine
    with pytest.raises(WeightVersionError, match="weight version"):
        engine.set_weight_version(bad)
    with pytest.raises(WeightVersionError, match="keeps its current weight version"):
        llm_a.update_weight_version(bad)
    with pytest.raises(WeightVersionError):
        llm_a.finish_weight_update(bad)
    # Past the frontend, straight to the engine process: its own check refuses it too (a lone
    # surrogate cannot even be serialized to it).
    with pytest.raises(Exception, match=r"weight version|surrogates not allowed"):
        engine.engine_core.set_weight_version(bad)
    assert engine.get_weight_version() == "default"
    out = llm_a.generate([f"Still serving after a bad weight version {len(bad)}."], GREEDY)[0]
    assert out.outputs[0].finish_reason == "length"
    assert_matches_oracle(model_a, out)


def _refuse_publications(worker: Any) -> bool:
    """Rank zero's store refuses every publication (a store full of pinned objects)."""
    connector = worker.model_runner.aux_output_connector
    if connector is None or connector.store is None:
        return False
    store = connector.store

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise CapacityError("injected: every slot is pinned")

    store.put_blocks = store.put_runs = store.put = refuse
    return True


def _accept_publications(worker: Any) -> None:
    connector = worker.model_runner.aux_output_connector
    if connector is not None and connector.store is not None:
        for name in ("put_blocks", "put_runs", "put"):
            connector.store.__dict__.pop(name, None)


def test_a_keys_handle_whose_objects_never_arrive_fails_its_request_closed(
    llm_a: Any, model_a: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store refuses the request's objects (CapacityError in the publisher): the handle
    names keys that never appear, so it is not answered; the request fails closed with the
    reason, and the array-path request of the same batch is served."""
    monkeypatch.setattr(client_reader, "_DEFAULT", client_reader.R3Reader(timeout=1.0))
    prompts = [
        " ".join(f"Unpublished keys {i} never reach the trainer." for i in range(12)),
        "An array-path request in the same batch.",
    ]
    params = [SamplingParams(**_greedy_args(), extra_args=KEYS), GREEDY]
    assert any(llm_a.collective_rpc(_refuse_publications))
    try:
        keyed, array = llm_a.generate(prompts, params)
    finally:
        llm_a.collective_rpc(_accept_publications)
    completion = keyed.outputs[0]
    assert completion.finish_reason == "error" and completion.routed_experts is None
    failure = r3_failure(completion.stop_reason)
    assert failure is not None and failure.reason == "missing", completion.stop_reason
    assert "keys handle does not resolve" in failure.message
    assert array.outputs[0].finish_reason == "length"
    assert_matches_oracle(model_a, array)
    # The KV cache still holds the prompt, whose R3 was never stored: a hit would fail closed
    # (missing). Recomputed, it is published and answered again.
    assert llm_a.reset_prefix_cache()
    again = llm_a.generate(prompts[:1], params[:1])[0]
    assert isinstance(again.outputs[0].routed_experts, R3Keys), again.outputs[0]
