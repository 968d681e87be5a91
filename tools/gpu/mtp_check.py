"""R3 under MTP speculative decoding, against the transformers oracle (GPU machine; runs on the
CPU build too).

    python tools/gpu/mtp_check.py [--engine-args JSON] [--json OUT.json]

Builds the tiny GLM-4.5-style model with one MTP layer (``vllm_artifact_testing.mtp_model``),
starts one engine (spawned processes, float32, TF32 off, Triton fp32 dots in IEEE mode) with
``speculative_config={"method": "mtp", "num_speculative_tokens": 2}``, generates greedily, and
compares every R3 row with the oracle (sigmoid router with correction bias and grouped
selection). Prints rows equal/total, accepted/drafted tokens and PASS/FAIL; exit 0 only on
PASS (every row equal, drafts both accepted and rejected, the draft's router not bound to the
capturer, keys path equal to the array path).

On CUDA vLLM picks ``GroupedTopKRouter`` for this router, whose default calls the compiled
``torch.ops._moe_C.grouped_topk``; the stand-ins of ``tools/gpu/shims`` have none, so this
script sets ``VLLM_USE_FUSED_MOE_GROUPED_TOPK=0`` unless it is set: vLLM then runs its own
PyTorch ``grouped_topk`` (under ``torch.compile``), and R3 records what that returns.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _environment(cuda: bool) -> None:
    """Variables the engine processes inherit (set before vLLM starts any)."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # R3 is captured by MRV2 only
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc probes
    if cuda:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("VLLM_USE_FUSED_MOE_GROUPED_TOPK", "0")
    else:
        from vllm_artifact_testing.engine_env import apply_cpu_engine_env

        apply_cpu_engine_env()


def _speculator(worker: Any) -> str:
    return type(worker.model_runner.speculator).__name__


def _check(llm: Any, model: Path, num_speculative_tokens: int) -> dict[str, Any]:
    """Run the prompts, a prefix hit and the keys path on ``llm``; every finding as JSON."""
    from vllm import SamplingParams
    from vllm_artifact_testing.engine_probe import executed_tokens, vllm_counters
    from vllm_artifact_testing.mtp_model import MTP_NEW_TOKENS, MTP_PROMPTS, bound_routers

    from vllm_artifact.client import read_r3_keys
    from vllm_artifact.selftest.oracle import hf_router_topk, routing_agreement

    found: dict[str, Any] = {
        "speculator": llm.collective_rpc(_speculator)[0],
        "routers": llm.collective_rpc(bound_routers)[0],
        "grouped_topk_fused": os.environ.get("VLLM_USE_FUSED_MOE_GROUPED_TOPK"),
        "num_speculative_tokens": num_speculative_tokens,
        "cases": [],
    }
    greedy = SamplingParams(max_tokens=MTP_NEW_TOKENS, temperature=0, ignore_eos=True)
    before = vllm_counters(llm, *COUNTERS)
    first = llm.generate(list(MTP_PROMPTS), greedy)
    after = vllm_counters(llm, *COUNTERS)
    found["drafted"], found["accepted"] = (int(after[n] - before[n]) for n in COUNTERS)
    again = llm.generate([MTP_PROMPTS[0]], greedy)[0]
    found["prefix_hit_tokens"] = again.num_cached_tokens
    named = [(f"prompt {i}", output) for i, output in enumerate(first)]
    for name, output in [*named, ("prompt 0 again (prefix hit)", again)]:
        agreement = routing_agreement(
            output.outputs[0].routed_experts, hf_router_topk(model, executed_tokens(output))
        )
        found["cases"].append({"name": name, **agreement.__dict__, "ok": agreement.ok})
    keys = SamplingParams(
        max_tokens=MTP_NEW_TOKENS,
        temperature=0,
        ignore_eos=True,
        extra_args={"routed_experts_format": "keys"},
    )
    same = [
        bool((read_r3_keys(k.outputs[0].routed_experts, timeout=60).experts == a).all())
        for k, a in zip(
            llm.generate(list(MTP_PROMPTS), keys),
            (o.outputs[0].routed_experts for o in first),
            strict=True,
        )
    ]
    found["keys_path_equal"] = all(same)
    return found


def _problems(found: dict[str, Any]) -> list[str]:
    problems = [
        f"{c['name']}: {c['equal']}/{c['rows']} rows equal; {c['first_problem']}"
        for c in found["cases"]
        if not c["ok"]
    ]
    if found["speculator"] != "MTPSpeculator":
        problems.append(f"speculator is {found['speculator']}, not MTPSpeculator")
    if any(r.endswith("+capture") for r in found["routers"]["draft"]):
        problems.append(f"the draft's router is bound to the capturer: {found['routers']}")
    if not all(r.endswith("+capture") for r in found["routers"]["target"]):
        problems.append(f"a target router is not bound to the capturer: {found['routers']}")
    if not 0 < found["accepted"] < found["drafted"]:
        problems.append(
            f"drafts not both accepted and rejected ({found['accepted']}/{found['drafted']})"
        )
    if not found["keys_path_equal"]:
        problems.append("the keys path's rows differ from the array path's")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON")
    parser.add_argument("--json", type=Path, help="also write the findings as JSON here")
    parser.add_argument("--cache-dir", type=Path, help="where the tiny model is built")
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    args = parser.parse_args(argv)
    if not isinstance(args.engine_args, dict):
        parser.error("--engine-args must be a JSON object of LLM(...) keywords")

    import torch

    _environment(torch.cuda.is_available())
    from vllm_artifact_testing.mtp_model import ensure_mtp_model

    from vllm_artifact.selftest.runner import engine, full_precision, versions

    full_precision()
    model = ensure_mtp_model(args.cache_dir)
    root = Path(tempfile.mkdtemp(prefix="vllm-artifact-mtp-", dir="/dev/shm"))
    started = time.monotonic()
    speculative = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    try:
        with engine(
            model, root, args.engine_args, speculative_config=speculative, disable_log_stats=False
        ) as llm:
            found = _check(llm, model, args.num_speculative_tokens)
        problems = _problems(found)
    except Exception as error:  # an engine that does not start, or dies: nothing checked
        found = {"error": f"{type(error).__name__}: {error}"}
        problems = [found["error"]]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    found["seconds"] = round(time.monotonic() - started, 1)
    found["versions"] = versions().__dict__
    found["problems"] = problems
    found["verdict"] = "FAIL" if problems else "PASS"

    print(f"\nMTP check: {found['versions']['device']}, vLLM {found['versions']['vllm']}")
    for case in found.get("cases", []):
        print(f"{case['name']:<30} {case['equal']:>5}/{case['rows']:<5} rows equal")
    if "drafted" in found:
        print(f"drafts accepted {found['accepted']}/{found['drafted']}, routers {found['routers']}")
    for problem in problems:
        print("problem:", problem)
    print(found["verdict"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(found, indent=2, default=str) + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
