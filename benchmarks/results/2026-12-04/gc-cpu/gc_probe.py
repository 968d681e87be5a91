"""Engine-core garbage collections with R3 off, vLLM's own R3 and ours (vLLM's GC log).

.venv/bin/python benchmarks/results/2026-12-04/gc-cpu/gc_probe.py off|native|ours
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def main(mode: str) -> None:
    os.environ["VLLM_GC_DEBUG"] = "1"  # the engine core logs every collection
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if mode == "native":
        os.environ["VLLM_PLUGINS"] = "none"
    from vllm import LLM, SamplingParams

    from vllm_artifact.selftest.tiny_models import ensure_tiny_model

    kwargs: dict[str, Any] = {
        "model": str(ensure_tiny_model("qwen3-moe-16x4-dense0")),
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 1024,
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 128,
        "block_size": 32,
        "enforce_eager": True,
    }
    if mode == "ours":
        kwargs.update(enable_routed_experts=True, artifact_root="/dev/shm/gcx-root")
    elif mode == "native":
        kwargs.update(enable_return_routed_experts=True)
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=96, ignore_eos=True, temperature=0)
    for round_ in range(2):  # 64 prompts of 64 tokens decoding in lockstep
        prompts: Any = [
            {"prompt_token_ids": [(7 * i + j + round_ * 131) % 500 + 3 for j in range(64)]}
            for i in range(64)
        ]
        began = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        found = [getattr(o.outputs[0], "routed_experts", None) for o in outputs]
        rows = sum(len(r) for r in found if r is not None)
        print(f"ROUND {mode} {round_} {seconds:.3f}s rows={rows}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
