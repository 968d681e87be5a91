"""The matrix cells with a KV connector (``tools/gpu/matrix.py``): vLLM's native CPU KV offload
and prefill/decode through shared storage; helpers and the other cells in ``matrix_cells.py``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matrix_cells import (
    HERE,
    Context,
    Verdict,
    delta,
    failed,
    long_prompt,
    oracle_check,
    outputs,
    workers,
)


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def cell_offload(context: Context) -> Verdict:
    # A GPU KV cache of 1280 tokens (max_model_len 1024 must fit) and a 64 MiB CPU tier: four
    # long fillers after the first prompt push its blocks out of the GPU, not out of the CPU.
    overrides: dict[str, Any] = {
        "kv_offloading_size": 1 / 16,
        "kv_cache_memory_bytes": kv_bytes_per_token(context.model) * 1280,
        "disable_log_stats": False,
    }
    env = {}
    if context.cuda:  # the stand-in for the one compiled op offloading calls (see its docstring)
        overrides["worker_extension_cls"] = "cache_ops_stand_in.Registered"
        paths = [str(HERE / "shims"), os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    first = long_prompt("Offloaded")
    steps = [{"name": "first", "prompts": [first], "max_tokens": 8}]
    steps += [
        {"name": f"filler {k}", "prompts": [long_prompt(f"Filler {k}")], "max_tokens": 8}
        for k in range(4)
    ]
    steps.append({"name": "repeat", "prompts": [first], "max_tokens": 8})
    result = context.engine("offload", "ours", context.root("offload"), steps, overrides, env)
    if "error" in result:
        message = result.get("root_cause") or result["error"]
        if not context.cuda and "only supported on CUDA" in message:
            return Verdict("NOT RUNNABLE", detail=message)
        return Verdict("FAIL", detail=f"{result['error']} (root cause: {message})")
    problems = []
    repeat = outputs(result, "repeat")[0]
    external = delta(result, "repeat", "vllm:external_prefix_cache_hits")
    local = delta(result, "repeat", "vllm:prefix_cache_hits")
    reads = delta(result, "repeat", "reads", "connector")
    if not repeat["num_cached_tokens"] or external <= 0:
        problems.append(
            f"the repeat was no offload hit: {repeat['num_cached_tokens']} cached, "
            f"{external:.0f} external hits"
        )
    if local >= repeat["num_cached_tokens"]:
        problems.append(
            f"the repeat hit the GPU prefix cache ({local:.0f} tokens): nothing was evicted"
        )
    if reads <= 0:
        problems.append("the offload hit's R3 was not read from our store")
    if not np.array_equal(repeat["routed_experts"], outputs(result, "first")[0]["routed_experts"]):
        problems.append("the repeat's R3 differs from the first request's")
    connectors = workers(result, "kv_connector")
    config = result["config"]
    loaded = delta(result, "repeat", "vllm:kv_offload_load_bytes")
    stored = delta(result, "repeat", "vllm:kv_offload_store_bytes")
    repeat_step = next(s for s in result["steps"] if s["name"] == "repeat")
    pinned = repeat_step["before"]["connector"].get("pinned")
    calls = [w.get("stand_in_calls") for w in repeat_step["after"]["workers"]]
    evidence = {
        "kv connector": f"{result['config']['kv_transfer']} in the worker: {connectors}",
        "GPU KV cache": f"{config['num_gpu_blocks']} blocks of {config['block_size']} tokens",
        "repeat": f"{repeat['num_cached_tokens']} cached tokens: {external:.0f} from the offload "
        f"tier (external), {local:.0f} from the GPU prefix cache",
        "offload bytes (repeat step)": f"loaded {loaded:.0f}, stored {stored:.0f}",
        "store": f"{reads:.0f} objects read for the repeat; {pinned} pinned before it",
        "swap_blocks_batch stand-in": calls,
    }
    return Verdict.of("offload", oracle_check(context.model, result), problems, evidence)


def cell_pd(context: Context) -> Verdict:
    """Prefill/decode through shared storage (vLLM's ExampleConnector): a producer engine
    saves the prompt's KV, a consumer started after it on the same store root loads that KV
    (a KV connector's hit, kept whole by our scheduler connector; vLLM 0.34's own connector
    would drop it, holding no R3 for those blocks) and reads the prompt's R3 from the store."""
    root = context.root("pd")
    storage = Path(tempfile.mkdtemp(prefix="vllm-artifact-matrix-pd-kv-"))

    def role(kv_role: str) -> dict[str, Any]:
        transfer = {
            "kv_connector": "ExampleConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
        # One forward per prompt: ExampleConnector saves only the last chunk of a prefill.
        args: dict[str, Any] = {
            "kv_transfer_config": transfer,
            "disable_log_stats": False,
            "max_num_batched_tokens": 1024,
        }
        if kv_role == "kv_consumer":
            # The consumer computes only the prompt's last partial block, a step Model Runner
            # V2 replays as a full CUDA graph, and there it starts KV loads outside the
            # forward context: ExampleConnector then loads nothing ("In
            # connector.start_load_kv, but the attn_metadata is None"). Eager, it loads.
            args["enforce_eager"] = True
            args["compilation_config"] = {"mode": 0, "custom_ops": ["none"]}
        return args

    prompt = long_prompt("Disaggregated")
    try:
        steps = [{"name": "prefill", "prompts": [prompt], "max_tokens": 1}]
        producer = context.engine("pd-producer", "ours", root, steps, role("kv_producer"))
        if (verdict := failed(producer, "producer")) is not None:
            return verdict
        steps = [{"name": "decode", "prompts": [prompt], "max_tokens": 8}]
        consumer = context.engine("pd-consumer", "ours", root, steps, role("kv_consumer"))
        if (verdict := failed(consumer, "consumer")) is not None:
            return verdict
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    problems = []
    decoded, prefilled = outputs(consumer, "decode")[0], outputs(producer, "prefill")[0]
    external = delta(consumer, "decode", "vllm:external_prefix_cache_hits")
    reads = delta(consumer, "decode", "reads", "connector")
    if external <= 0 or not decoded["num_cached_tokens"]:
        problems.append(
            f"the consumer computed the prompt itself: {decoded['num_cached_tokens']} cached "
            f"tokens, {external:.0f} from the KV connector"
        )
    if reads <= 0:
        problems.append("the consumer's prompt R3 was not read from the store")
    rows, served = len(prefilled["routed_experts"]), int(decoded["num_cached_tokens"])
    mine, theirs = decoded["routed_experts"][:rows], prefilled["routed_experts"]
    if not np.array_equal(mine[:served], theirs[:served]):
        problems.append(
            f"the R3 of the {served} tokens the KV connector served (read from the store) "
            "differs from the producer's"
        )
    if not np.array_equal(mine[served:], theirs[served:]):
        problems.append(
            f"the R3 of the prompt tokens the consumer computed ({served}-{rows}) differs from "
            "the producer's: did the KV connector load the KV? (its log)"
        )
    evidence = {
        "kv connector": f"{consumer['config']['kv_transfer']} in the worker: "
        f"{workers(consumer, 'kv_connector')}",
        "consumer": f"{decoded['num_cached_tokens']} cached tokens, {external:.0f} from the KV "
        f"connector; {reads:.0f} objects read from the store",
    }
    agreements = oracle_check(context.model, producer) + oracle_check(context.model, consumer)
    return Verdict.of("pd", agreements, problems, evidence)


CELLS: dict[str, Callable[[Context], Verdict]] = {
    "offload": cell_offload,
    "pd": cell_pd,
}
