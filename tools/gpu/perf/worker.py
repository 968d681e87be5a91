"""One engine of the side-by-side R3 throughput benchmark, driven over stdin/stdout.

``driver.py`` starts one worker per configuration (``off``: R3 off; ``native``: vLLM's own
routed experts, our plugin not loaded; ``ours``: our plugin) and keeps them all alive, so
the timed rounds of the three configurations interleave on one warm GPU and the machine's
drift lands on all of them alike. Commands are JSON lines on stdin; answers are JSON lines
on stdout prefixed with ``@@perf``; everything else a worker prints is vLLM's log.

Per round the worker reports what the ratios need (seconds, tokens) and what explains them:
the wall time of every engine step as the frontend saw it (``LLMEngine.step`` returns), the
CPU time of every thread of the frontend and the engine core, vLLM's step and latency
counters, and for ``ours`` the store's publications (objects and bytes) during the round.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TAG = "@@perf "


def reply(**fields: Any) -> None:
    sys.stdout.write(TAG + json.dumps(fields) + "\n")
    sys.stdout.flush()


def workload_prompts(name: str, seed: int, scale: float) -> tuple[list[list[int]], int]:
    """Token-id prompts and output length of a workload (random ids, fresh per seed, the
    same for every configuration of a round)."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(3, 500, size=max(1, int(n * scale))).tolist()

    if name == "decode":  # 256 x 256 in, 256 out: decode steps of a full batch
        return [ids(256) for _ in range(max(1, int(256 * scale)))], max(2, int(256 * scale))
    if name == "prefill":  # 128 x 2048 in (4 prefixes of 1536 shared), 16 out
        prefixes = [ids(1536) for _ in range(4)]
        n = max(4, int(128 * scale))
        return [prefixes[i % 4] + ids(512) for i in range(n)], 16
    raise ValueError(f"unknown workload {name!r}")


def thread_cpu(pid: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, keyed ``name:tid`` (Python's
    thread name where known, else the kernel's)."""
    import psutil

    out: dict[str, float] = {}
    with contextlib.suppress(psutil.Error):
        for thread in psutil.Process(pid).threads():
            name = names.get(thread.id, "?")
            if name == "?":
                with contextlib.suppress(OSError):
                    name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
            out[f"{name}:{thread.id}"] = thread.user_time + thread.system_time
    return out


def python_thread_names() -> dict[int, str]:
    import threading

    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def counters(llm: Any) -> dict[str, float]:
    want = {
        "vllm:iteration_tokens_total",
        "vllm:inter_token_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:prefix_cache_hits",
        "vllm:prefix_cache_queries",
    }
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name not in want:
            continue
        if hasattr(metric, "count"):
            found[metric.name + ".count"] = found.get(metric.name + ".count", 0) + metric.count
            found[metric.name + ".sum"] = found.get(metric.name + ".sum", 0.0) + metric.sum
        elif hasattr(metric, "value"):
            found[metric.name] = found.get(metric.name, 0) + metric.value
    return found


def store_counts(llm: Any) -> dict[str, int]:
    """Objects and bytes in our store after the publisher drained (``ours`` only)."""

    def stats(worker: Any) -> dict[str, int]:
        connector = worker.model_runner.aux_output_connector
        if connector is None or getattr(connector, "store", None) is None:
            return {}
        connector.flush_publications()
        store = connector.store.stats()
        return {
            "objects": store.objects,
            "bytes_used": store.bytes_used,
            "evictions": store.evictions,
            "reads": connector.reads,
        }

    return next((s for s in llm.collective_rpc(stats) if s), {})


class Worker:
    def __init__(self, config: str, model: str, root: str, engine_args: dict[str, Any]):
        self.config = config
        self.model = model
        self.root = root
        self.engine_args = engine_args
        self.llm: Any = None
        self.engine_pids: list[int] = []
        self.steps: list[tuple[float, int]] = []

    def start(self) -> dict[str, Any]:
        from vllm import LLM

        kwargs = dict(self.engine_args)
        if self.config == "native":
            kwargs["enable_return_routed_experts"] = True
        elif self.config == "ours":
            kwargs.update(enable_routed_experts=True, artifact_root=self.root)
        started = time.perf_counter()
        self.llm = LLM(self.model, **kwargs)
        startup = time.perf_counter() - started
        with contextlib.suppress(Exception):
            manager = self.llm.llm_engine.engine_core.resources.engine_manager
            import psutil

            cores = [psutil.Process(p.pid) for p in manager.processes]
            # the engine cores and their workers (one process with the core on a single GPU)
            self.engine_pids = [p.pid for c in cores for p in [c, *c.children(recursive=True)]]
        plugins = sorted(m for m in sys.modules if m.startswith("vllm_artifact"))
        engine = self.llm.llm_engine
        original_step = engine.step

        def timed_step() -> Any:
            outputs = original_step()
            self.steps.append((time.perf_counter(), len(outputs)))
            return outputs

        engine.step = timed_step
        return {
            "startup_s": startup,
            "pid": os.getpid(),
            "engine_pids": self.engine_pids,
            "plugin_modules_loaded": len(plugins),
            "kwargs": repr(kwargs),
        }

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Any:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def warm(self, scale: float) -> dict[str, Any]:
        """Every batch shape the rounds use, on other prompts (Triton compiles its MoE
        kernels per shape on first use), then an empty prefix cache."""
        started = time.perf_counter()
        for name, seed in (("decode", 99), ("prefill", 98)):
            prompts, _ = workload_prompts(name, seed, scale)
            self.generate(prompts, 8)
        self.llm.reset_prefix_cache()
        return {"warm_s": time.perf_counter() - started}

    def run(self, workload: str, seed: int, scale: float) -> dict[str, Any]:
        prompts, max_tokens = workload_prompts(workload, seed, scale)
        self.llm.reset_prefix_cache()
        before_store = store_counts(self.llm) if self.config == "ours" else {}
        before = counters(self.llm)
        pids = [os.getpid(), *self.engine_pids]
        names = python_thread_names()
        with contextlib.suppress(Exception):  # the engine core's threads (same process as
            for found in self.llm.collective_rpc(lambda _: python_thread_names()):  # its worker)
                names.update({int(k): v for k, v in found.items()})
        cpu0 = {pid: thread_cpu(pid, names) for pid in pids}
        self.steps = []
        started = time.perf_counter()
        outputs = self.generate(prompts, max_tokens)
        seconds = time.perf_counter() - started
        cpu1 = {pid: thread_cpu(pid, names) for pid in pids}
        after = counters(self.llm)
        after_store = store_counts(self.llm) if self.config == "ours" else {}
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        tokens = hashlib.blake2b(digest_size=8)
        r3 = hashlib.blake2b(digest_size=8)
        r3_bytes, missing = 0, 0
        per_request: list[str] = []  # so a difference between engines is counted, not only seen
        for o in outputs:
            tokens.update(np.asarray(o.outputs[0].token_ids, dtype=np.int64).tobytes())
            experts = o.outputs[0].routed_experts
            if self.config != "off":
                if not isinstance(experts, np.ndarray):
                    missing += 1
                    continue
                r3_bytes += experts.nbytes
                r3.update(str(experts.shape).encode())
                r3.update(np.ascontiguousarray(experts).tobytes())
                one = hashlib.blake2b(np.ascontiguousarray(experts).tobytes(), digest_size=6)
                per_request.append(one.hexdigest())
        threads = {
            "frontend" if pid == os.getpid() else f"engine{i}": {
                name: round(cpu1[pid].get(name, 0.0) - cpu0[pid].get(name, 0.0), 4)
                for name in cpu1[pid]
                if cpu1[pid].get(name, 0.0) - cpu0[pid].get(name, 0.0) > 0.001
            }
            for i, pid in enumerate(pids)
        }
        return {
            "workload": workload,
            "seed": seed,
            "config": self.config,
            "seconds": seconds,
            "out_tokens": out_tokens,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "out_tok_s": out_tokens / seconds,
            "tokens_digest": tokens.hexdigest(),
            "r3_digest": r3.hexdigest(),
            "r3_request_digests": per_request,
            "r3_bytes": r3_bytes,
            "r3_missing": missing,
            "steps": [[round(t - started, 5), n] for t, n in self.steps],
            "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
            "store": {k: after_store[k] - before_store.get(k, 0) for k in after_store},
            "threads_cpu_s": threads,
        }

    def stop(self) -> None:
        import psutil

        for pid in self.engine_pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                for child in [proc, *proc.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        child.kill()


def main() -> None:
    config, model, root = sys.argv[1], sys.argv[2], sys.argv[3]
    engine_args = json.loads(sys.argv[4])
    # collective_rpc of a local function (the workers' Python thread names) needs pickle
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    worker = Worker(config, model, root, engine_args)
    import vllm  # noqa: F401  (imported before "start", so the workers' imports overlap)

    reply(event="imported", pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["cmd"] == "start":
                reply(event="ready", **worker.start())
            elif command["cmd"] == "warm":
                reply(event="warm", **worker.warm(command["scale"]))
            elif command["cmd"] == "run":
                reply(
                    event="result",
                    **worker.run(command["workload"], command["seed"], command["scale"]),
                )
            elif command["cmd"] == "stop":
                break
        except Exception as error:  # the driver reports it and stops this configuration
            reply(event="error", error=f"{type(error).__name__}: {error}"[:2000])
            break
    worker.stop()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
