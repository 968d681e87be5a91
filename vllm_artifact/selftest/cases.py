"""The self-test's workloads: each runs requests on an engine and compares their R3 rows with
the oracle (:func:`vllm_artifact.selftest.oracle.routing_agreement`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_artifact.selftest.oracle import Agreement, hf_router_topk, routing_agreement

LONG_PROMPT = " ".join(
    f"Expert {i} of the mixture handles token {i * 7 % 13} in layer {i % 4}." for i in range(30)
)
SHORT_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning replays the router.",
    "Hello, world! How are you today?",
)
REPEATING_PROMPT = "one two three four five six " * 12


@dataclass(frozen=True)
class CaseResult:
    name: str
    rows: int = 0
    equal: int = 0
    near_ties: int = 0
    status: str = "PASS"  # PASS, FAIL or "not runnable"
    detail: str = ""
    seconds: float = 0.0

    @classmethod
    def of(cls, name: str, agreements: Sequence[Agreement], *problems: str) -> CaseResult:
        rows = sum(a.rows for a in agreements)
        equal = sum(a.equal for a in agreements)
        found = [*problems, *(a.first_problem for a in agreements if a.first_problem)]
        ok = rows > 0 and equal == rows and not problems
        return cls(
            name,
            rows,
            equal,
            sum(a.near_ties for a in agreements),
            "PASS" if ok else "FAIL",
            found[0] if found else ("" if rows else "no rows compared"),
        )

    @classmethod
    def failed(cls, name: str, detail: str) -> CaseResult:
        return cls(name, status="FAIL", detail=detail)

    @classmethod
    def not_runnable(cls, name: str, error: Exception) -> CaseResult:
        message = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        return cls(name, status="not runnable", detail=f"{type(error).__name__}: {message}")

    def timed(self, seconds: float) -> CaseResult:
        return dataclasses.replace(self, seconds=round(seconds, 2))


def executed_tokens(output: Any, index: int = 0) -> list[int]:
    """Tokens that went through a forward pass: the prompt and every generated one but the
    last (R3 has a row for each)."""
    return list(output.prompt_token_ids) + list(output.outputs[index].token_ids)[:-1]


def agreement(model: Path, output: Any, index: int = 0, experts: Any = None) -> Agreement:
    rows = output.outputs[index].routed_experts if experts is None else experts
    if not isinstance(rows, np.ndarray):
        return Agreement(1, 0, 0, f"no R3 array: {output.outputs[index].finish_reason=}")
    return routing_agreement(rows, hf_router_topk(model, executed_tokens(output, index)))


def greedy(max_tokens: int = 8, **fields: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)


@dataclass(frozen=True)
class EngineCase:
    name: str
    run_on: Callable[[Any, Path, Path], CaseResult]
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    def run(self, llm: Any, model: Path, root: Path) -> CaseResult:
        return self.run_on(llm, model, root)


def batch(llm: Any, model: Path, root: Path) -> CaseResult:
    outputs = llm.generate(list(SHORT_PROMPTS), greedy())
    return CaseResult.of("batch of 3 prompts", [agreement(model, o) for o in outputs])


def chunked_prefill(llm: Any, model: Path, root: Path) -> CaseResult:
    output = llm.generate([LONG_PROMPT], greedy())[0]
    problems = [] if len(output.prompt_token_ids) > 64 else ["the prompt fits one chunk"]
    return CaseResult.of("chunked prefill (64-token chunks)", [agreement(model, output)], *problems)


def store_reads(root: Path) -> int:
    """Objects the engine's store has read for prefix hits (its counters file)."""
    from vllm_artifact.core.store.shm_metrics import StoreMetrics

    snapshots = [StoreMetrics.read(path) for path in root.iterdir() if path.is_dir()]
    return sum(s.read_objects for s in snapshots if s is not None)


def prefix_hit(llm: Any, model: Path, root: Path) -> CaseResult:
    first = llm.generate([LONG_PROMPT], greedy())[0]  # cached (and published) if not already
    reads = store_reads(root)
    again = llm.generate([LONG_PROMPT], greedy())[0]
    problems = []
    if not again.num_cached_tokens:
        problems.append("the repeated prompt was not a prefix-cache hit")
    if store_reads(root) <= reads:
        problems.append("the prefix hit's R3 was not read from the store")
    same = first.outputs[0].routed_experts
    if isinstance(same, np.ndarray) and not np.array_equal(same, again.outputs[0].routed_experts):
        problems.append("the hit's R3 differs from the first request's")
    name = "prefix hit served from the store"
    return CaseResult.of(name, [agreement(model, again)], *problems)


def sampled_n2(llm: Any, model: Path, root: Path) -> CaseResult:
    from vllm import SamplingParams

    params = SamplingParams(n=2, max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    output = llm.generate([SHORT_PROMPTS[1]], params)[0]
    return CaseResult.of("n=2 sampled", [agreement(model, output, i) for i in range(2)])


def stop_string(llm: Any, model: Path, root: Path) -> CaseResult:
    from vllm import SamplingParams

    prompt = "Stop strings cut the text at an exact token boundary:"
    unbounded = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    tokens = list(unbounded.outputs[0].token_ids)
    stop = llm.get_tokenizer().decode(tokens[10:12])
    output = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    problems = []
    if output.outputs[0].finish_reason != "stop" or len(output.outputs[0].token_ids) >= len(tokens):
        problems.append(f"the stop string {stop!r} did not stop the request")
    return CaseResult.of("stop string", [agreement(model, output)], *problems)


def dense_layer(llm: Any, model: Path, root: Path) -> CaseResult:
    from vllm_artifact.client import decode_r3

    output = llm.generate([SHORT_PROMPTS[0]], greedy())[0]
    found = agreement(model, output)
    oracle = hf_router_topk(model, executed_tokens(output))
    expected = tuple(np.flatnonzero(~oracle.moe_layers).tolist())
    problems = []
    if not expected:
        problems.append("the model has no dense layer")
    elif decode_r3(output.outputs[0]).dense_layers != expected:
        problems.append(f"dense layers {decode_r3(output.outputs[0]).dense_layers}, not {expected}")
    return CaseResult.of(f"dense layer {list(expected)} marked", [found], *problems)


def keys_handle(llm: Any, model: Path, root: Path) -> CaseResult:
    from vllm_artifact.client import R3Keys, read_r3_keys

    outputs = llm.generate(
        [LONG_PROMPT, SHORT_PROMPTS[2]], greedy(extra_args={"routed_experts_format": "keys"})
    )
    found, problems = [], []
    for output in outputs:
        handle = output.outputs[0].routed_experts
        if not isinstance(handle, R3Keys):
            problems.append(f"no keys handle: {output.outputs[0].stop_reason}")
            continue
        found.append(agreement(model, output, experts=read_r3_keys(handle).experts))
    return CaseResult.of("keys handle read from the store", found, *problems)


_SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _spec_counters(llm: Any) -> list[float]:
    totals = dict.fromkeys(_SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return list(totals.values())


def ngram_speculation(llm: Any, model: Path, root: Path) -> CaseResult:
    """Drafts both accepted and rejected: accepted drafts' rows kept, rejected ones' cut."""
    before = _spec_counters(llm)
    outputs = llm.generate([REPEATING_PROMPT, LONG_PROMPT], greedy(24))
    drafted, accepted = (a - b for a, b in zip(_spec_counters(llm), before, strict=True))
    problems = []
    if not 0 < accepted < drafted:
        problems.append(f"{accepted:.0f} of {drafted:.0f} drafts accepted: need some of each")
    found = [agreement(model, output) for output in outputs]
    return CaseResult.of(SPECULATIVE.name, found, *problems)


CASES: tuple[EngineCase, ...] = (
    EngineCase("batch of 3 prompts", batch),
    EngineCase("chunked prefill (64-token chunks)", chunked_prefill),
    EngineCase("prefix hit served from the store", prefix_hit),
    EngineCase("n=2 sampled", sampled_n2),
    EngineCase("stop string", stop_string),
    EngineCase("dense layer marked", dense_layer),
    EngineCase("keys handle read from the store", keys_handle),
)
SPECULATIVE = EngineCase(
    "speculative decoding (n-gram)",
    ngram_speculation,
    {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        "disable_log_stats": False,  # the drafted / accepted counters
    },
)
