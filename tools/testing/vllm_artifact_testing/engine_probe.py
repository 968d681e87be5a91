"""Look inside a running offline engine from a test: connector counters, executed tokens,
the oracle check of one completion, and a keys handle read by another process."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from vllm_artifact.selftest.oracle import assert_routing_matches, hf_router_topk


def connector_stats(llm: Any) -> dict[str, int]:
    """Counters of the rank-zero worker connector, read through vLLM's ``collective_rpc``
    (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send the function to the workers). With
    ``--artifact-tracker process`` the store is the tracker process's: its counters only."""

    def stats(worker: Any) -> dict[str, int]:
        connector = worker.model_runner.aux_output_connector
        if connector is not None and connector.tracker_pid is not None:
            connector.flush_publications()
            return {
                "reads": connector.reads,
                "adopted": connector.adopted,
                "tails": connector.tails_published,
                "tracker_pid": connector.tracker_pid,
            }
        if connector is None or connector.store is None:
            return {}
        connector.flush_publications()  # counts after the background writes, not racing them
        store = connector.store.stats()
        return {
            "reads": connector.reads,
            "adopted": connector.adopted,
            "tails": connector.tails_published,
            "inline_batches": connector._publisher.inline_batches,  # written on the step thread
            "objects": store.objects,
            "bytes_used": store.bytes_used,
            "capacity_bytes": store.capacity_bytes,  # the arena file, overhead included
            "capacity_objects": store.capacity_objects,
            "evictions": store.evictions,
            "pinned": store.pinned_objects,
        }

    return next(s for s in llm.collective_rpc(stats) if s)


def vllm_counters(llm: Any, *names: str) -> dict[str, float]:
    """Totals of vLLM's counters ``names`` over all their labels (needs
    ``disable_log_stats=False``), from one read of the engine's metrics."""
    totals = dict.fromkeys(names, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals


def executed_tokens(output: Any, index: int = 0) -> list[int]:
    """Tokens that went through a forward pass for completion ``index``: the prompt and all
    generated but the last."""
    return list(output.prompt_token_ids) + list(output.outputs[index].token_ids)[:-1]


def assert_matches_oracle(model: str | Path, output: Any, index: int = 0) -> np.ndarray:
    """Completion ``index``'s routed experts equal the transformers oracle on every executed
    token; returns them."""
    experts = output.outputs[index].routed_experts
    assert isinstance(experts, np.ndarray), f"no routed experts: {output.outputs[index]}"
    tokens = executed_tokens(output, index)
    assert experts.shape[0] == len(tokens)
    assert_routing_matches(experts, hf_router_topk(model, tokens))
    return experts


_READ_HANDLE = """
import sys, numpy
from vllm_artifact.client import read_r3_keys
numpy.save(sys.stdout.buffer, read_r3_keys(sys.stdin.read(), timeout=60).experts)
"""


def read_handle_elsewhere(handle_json: str, env: Mapping[str, str] | None = None) -> np.ndarray:
    """Rows of a keys handle (its JSON text) read by ``read_r3_keys`` in a separate Python
    process, as a trainer would read it."""
    done = subprocess.run(
        [sys.executable, "-c", _READ_HANDLE],
        input=handle_json.encode(),
        capture_output=True,
        timeout=300,
        env=None if env is None else dict(env),
    )
    if done.returncode != 0:
        raise AssertionError(f"the reader process failed: {done.stderr.decode()[-3000:]}")
    rows: np.ndarray = np.load(io.BytesIO(done.stdout))
    return rows
