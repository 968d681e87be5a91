"""MTP speculative decoding (``method="mtp"``: Model Runner V2's ``MTPSpeculator``) on a tiny
GLM-4.5-style MoE with one MTP layer (``vllm_artifact_testing.mtp_model``).

The MTP layer is a MoE layer whose router runs at every draft step; R3 is the target's layers
only. The draft's routers must never be bound to the capturer, rows of rejected drafts never
reach the output, and every row equals the transformers oracle (the router is sigmoid with a
correction bias and grouped selection, so the oracle applies that rule, not top-k of logits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm import SamplingParams
from vllm_artifact_testing.engine_probe import assert_matches_oracle, connector_stats, vllm_counters
from vllm_artifact_testing.mtp_model import (
    MTP_NEW_TOKENS,
    MTP_PROMPTS,
    bound_routers,
    ensure_mtp_model,
)

from vllm_artifact.client import decode_r3, read_r3_keys

pytestmark = pytest.mark.engine

COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def mtp_model() -> Path:
    return ensure_mtp_model()


def test_mtp_speculative_decoding_matches_oracle(
    mtp_model: Path, store_root: Path, llm_factory: Any
) -> None:
    llm = llm_factory(
        mtp_model,
        artifact_root=str(store_root / "mtp"),
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        disable_log_stats=False,
    )

    def speculator(worker: Any) -> str:
        return type(worker.model_runner.speculator).__name__

    assert llm.collective_rpc(speculator) == ["MTPSpeculator"]
    # Three MoE layers of the target bound, the MTP layer's one MoE layer not (were it bound,
    # its layer id, 4, would be outside the capture buffer).
    assert llm.collective_rpc(bound_routers) == [
        {"target": ["CPURouter+capture"] * 3, "draft": ["CPURouter"]}
    ]

    greedy = SamplingParams(max_tokens=MTP_NEW_TOKENS, temperature=0, ignore_eos=True)
    before = vllm_counters(llm, *COUNTERS)
    first = llm.generate(list(MTP_PROMPTS), greedy)
    after = vllm_counters(llm, *COUNTERS)
    drafted, accepted = (after[name] - before[name] for name in COUNTERS)
    assert 0 < accepted < drafted, f"drafts must be both accepted and rejected: {drafted=}"
    for output in first:
        assert output.outputs[0].finish_reason == "length"
        assert_matches_oracle(mtp_model, output)
        assert decode_r3(output.outputs[0]).dense_layers == (0,)

    # Drafts verified past max_tokens (dropped by vLLM) do not keep any completion's terminal
    # partial block out of the store.
    stats = connector_stats(llm)
    assert stats["tails"] == len(MTP_PROMPTS), stats

    # A prefix hit: the prompt's rows come from the store, the rest are speculated again.
    reads = stats["reads"]
    again = llm.generate([MTP_PROMPTS[0]], greedy)[0]
    assert again.num_cached_tokens >= 32
    assert connector_stats(llm)["reads"] > reads, "prefix R3 must come from the store"
    np.testing.assert_array_equal(
        again.outputs[0].routed_experts, first[0].outputs[0].routed_experts
    )

    # The keys path reads the array path's rows back from the store.
    keys = SamplingParams(
        max_tokens=MTP_NEW_TOKENS,
        temperature=0,
        ignore_eos=True,
        extra_args={"routed_experts_format": "keys"},
    )
    for output, earlier in zip(llm.generate(list(MTP_PROMPTS), keys), first, strict=True):
        read = read_r3_keys(output.outputs[0].routed_experts, timeout=60).experts
        np.testing.assert_array_equal(read, earlier.outputs[0].routed_experts)
    print(f"MTP: {accepted:.0f} of {drafted:.0f} drafts accepted")
