"""A full cyclic-GC collection in an offline ``LLM`` process with R3 on, before and after
``gc.freeze()`` (the tiny test model on this CPU; ``full_collection.txt``).

    .venv/bin/python benchmarks/results/2026-12-07/cpu-frontend-gc/full_collection.py
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(REPO / "tools/testing")]


def full_collection(label: str) -> None:
    took = []
    for _ in range(3):
        started = time.perf_counter()
        gc.collect()
        took.append(time.perf_counter() - started)
    print(
        f"{label}: tracked {len(gc.get_objects())}, frozen {gc.get_freeze_count()}, full "
        f"collection {min(took) * 1e3:.1f}-{max(took) * 1e3:.1f} ms",
        flush=True,
    )


def main() -> None:
    from vllm_artifact_testing.engine_env import ENGINE_KWARGS, apply_cpu_engine_env

    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = next((REPO / ".cache/models").glob("qwen3-moe-8x2-*"))
    kwargs: dict[str, Any] = dict(ENGINE_KWARGS)
    llm = LLM(
        model=str(model),
        **kwargs,
        enable_routed_experts=True,
        artifact_root=f"/dev/shm/gcfreeze-{os.getpid()}",
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=list(range(5, 69)))] * 4, SamplingParams(max_tokens=4)
    )
    full_collection("before gc.freeze()")
    gc.freeze()
    full_collection("after gc.freeze()")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
