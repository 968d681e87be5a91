"""One engine of ``tools/gpu/matrix.py``, run in a process of its own:
``python3 tools/gpu/matrix_jobs.py JOB.json``.

Each engine gets a fresh process so that GPU memory is returned between engines and so that
vLLM's own capture can run with our plugin excluded (``VLLM_PLUGINS``, read at process start).
The job's steps run one ``generate`` each; what they return (token ids, R3 rows, cached tokens)
and what the engine shows around them (vLLM's counters, our connector's, which classes run in
the worker) are pickled for the parent, which holds the oracle and the verdicts.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

#: vLLM counters recorded around every step (totals over labels; absent ones read 0).
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:kv_offload_load_bytes",
    "vllm:kv_offload_store_bytes",
    "vllm:num_preemptions",
)


def plugin_modules() -> list[str]:
    """Our plugin's modules loaded in this process (the self-test's oracle and settings, which
    the jobs import themselves, are not the plugin)."""
    return sorted(m for m in sys.modules if m.startswith("vllm_artifact.integration"))


def worker_probe(worker: Any) -> dict[str, Any]:
    """What runs in the worker: our modules loaded or not, the routed-experts connector's and
    speculator's classes, the KV connector, and the offload stand-in's calls (if loaded)."""
    runner = worker.model_runner
    modules = sorted(
        m for m in sys.modules if m == "vllm_artifact" or m.startswith("vllm_artifact.")
    )
    aux = getattr(runner, "aux_output_connector", None)
    speculator = getattr(runner, "speculator", None)
    stand_in = sys.modules.get("cache_ops_stand_in")
    found: dict[str, Any] = {
        "pid": os.getpid(),
        "plugin_modules": modules,
        "aux_output_connector": None
        if aux is None
        else type(aux).__module__ + "." + type(aux).__name__,
        "speculator": None if speculator is None else type(speculator).__name__,
        "stand_in_calls": None if stand_in is None else dict(stand_in.CALLS),
    }
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            found["kv_connector"] = type(get_kv_transfer_group()).__name__
    return found


def snapshot(llm: Any, ours: bool) -> dict[str, Any]:
    from vllm_artifact_testing.engine_probe import connector_stats, vllm_counters

    found: dict[str, Any] = {"counters": vllm_counters(llm, *COUNTERS)}
    if ours:
        found["connector"] = connector_stats(llm)  # waits for the background publications
    found["workers"] = llm.collective_rpc(worker_probe)
    return found


def record(output: Any) -> dict[str, Any]:
    choice = output.outputs[0]
    return {
        "prompt": output.prompt,
        "prompt_token_ids": list(output.prompt_token_ids),
        "token_ids": list(choice.token_ids),
        "routed_experts": choice.routed_experts,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "num_cached_tokens": output.num_cached_tokens,
    }


def start(job: dict[str, Any]) -> Any:
    """Ours through our keyword (``runner.engine_kwargs``), or vLLM's own capture with the same
    settings minus our options."""
    from vllm import LLM

    from vllm_artifact.selftest.runner import engine_kwargs

    kwargs = {
        **engine_kwargs(Path(job["root"])),
        "disable_log_stats": False,  # vLLM's counters around every step
        **job["engine_args"],
        **job["overrides"],
    }
    if job["mode"] == "native":
        del kwargs["enable_routed_experts"], kwargs["artifact_root"]
        kwargs["enable_return_routed_experts"] = True
    return LLM(job["model"], **kwargs)


def crash(llm: Any, root: Path, prompts: list[str], params: Any) -> dict[str, Any]:
    """SIGKILL vLLM's processes while a long generation publishes (as the CPU crash test does);
    the offline client may never return from that generate, so it runs in a daemon thread."""
    from vllm_artifact_testing.chaos import published, sigkill, wait_for_publications

    before = published(root)
    threading.Thread(target=llm.generate, args=(prompts, params), daemon=True).start()
    wait_for_publications(root, before + 8)
    killed = sigkill(os.getpid(), "engine")
    return {"killed_pids": killed, "published_before_kill": published(root) - before}


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    ours = job["mode"] == "ours"
    result: dict[str, Any] = {"steps": [], "started": time.time()}
    llm = start(job)
    result["engine_seconds"] = round(time.time() - result["started"], 1)
    result["frontend_plugin_modules"] = plugin_modules()
    config = llm.llm_engine.vllm_config
    result["config"] = {
        "scheduler_cls": str(config.scheduler_config.scheduler_cls),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "dtype": str(config.model_config.dtype),
        "block_size": config.cache_config.block_size,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "kv_transfer": None
        if config.kv_transfer_config is None
        else {
            "kv_connector": config.kv_transfer_config.kv_connector,
            "kv_role": config.kv_transfer_config.kv_role,
        },
    }
    result["at_start"] = snapshot(llm, ours)
    for step in job["steps"]:
        params = SamplingParams(max_tokens=step["max_tokens"], temperature=0, ignore_eos=True)
        if step.get("crash"):
            result["crash"] = crash(llm, Path(job["root"]), step["prompts"], params)
            result["finished"] = time.time()
            return result  # its processes are gone: no snapshot, no clean shutdown
        before = snapshot(llm, ours)
        outputs = llm.generate(step["prompts"], params, use_tqdm=False)
        after = snapshot(llm, ours)
        result["steps"].append(
            {
                "name": step["name"],
                "outputs": [record(o) for o in outputs],
                "before": before,
                "after": after,
            }
        )
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()  # clean shutdown, as runner.engine does
    result["finished"] = time.time()
    return result


def main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    try:
        result = run(job)
    except Exception as error:
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"}
    Path(job["result"]).write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # A SIGKILLed engine leaves the offline client's threads waiting forever.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
