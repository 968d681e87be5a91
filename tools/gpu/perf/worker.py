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
import gc
import hashlib
import json
import os
import sys
import time
from typing import Any

import cloudpickle
import engine_hooks  # beside this file (run as a script), as waits
import gpu_timeline as gpu_timeline_module
import numpy as np
import proc_stats
from engine_hooks import (
    all_inline,
    background_publisher,
    copied_frames,
    early_facts,
    fresh_arrays,
    per_layer_capture,
    pinned_views,
    python_profile,
    short_switch_interval,
    skip_copy,
    step_timers,
    torch_profile,
    unbind_capture,
)
from frontend_hooks import frontend_files, no_frontend_join
from gpu_timeline import gpu_timeline
from hw_counters import open_counters
from keys_read import KEYS_CAPACITY, KEYS_LEASE_S, read_keys
from pinning import pin_tree
from proc_stats import (
    FREEZE_FRONTEND_GC,
    allocator_setting,
    gc_delta,
    gc_totals,
    process_counters,
    python_thread_names,
    thread_cpu,
    thread_waits,
)
from report import span_digests
from waits import WaitSampler

# collective_rpc ships these functions to the engine core, whose path need not reach here
cloudpickle.register_pickle_by_value(engine_hooks)
cloudpickle.register_pickle_by_value(proc_stats)
cloudpickle.register_pickle_by_value(gpu_timeline_module)

TAG = "@@perf "


def reply(**fields: Any) -> None:
    sys.stdout.write(TAG + json.dumps(fields) + "\n")
    sys.stdout.flush()


#: The driver's commands for a profiled round (``Worker.profiled_round``).
PROFILED_ROUNDS = ("torch_profile", "python_profile", "frontend_profile")


def workload_prompts(
    name: str, seed: int, scale: float, count: int | None = None, repeat: int = 1
) -> tuple[list[list[int]], int]:
    """Token-id prompts and output length of a workload (random ids, fresh per seed, the
    same for every configuration of a round); ``count`` keeps only the first prompts;
    ``repeat`` makes the round that many workloads long, one after another, each with its own
    ids (the first is the workload of ``repeat=1``): a longer round of the same shape."""
    prompts, max_tokens = _workload(name, seed, scale)
    for part in range(1, repeat):
        prompts += _workload(name, [seed, part], scale)[0]
    return prompts[:count], max_tokens


def _workload(name: str, seed: int | list[int], scale: float) -> tuple[list[list[int]], int]:
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
    """Objects and bytes in our store after the publisher drained (``ours`` only); with the
    tracker process (whose store is its own), the decode steps the engine answered itself."""

    def stats(worker: Any) -> dict[str, int]:  # nested: collective_rpc ships it by value
        connector = worker.model_runner.aux_output_connector
        if connector is None:
            return {}
        if getattr(connector, "tracker_pid", None) is not None:
            return {"steps_answered_here": connector.steps_answered_here}
        if getattr(connector, "store", None) is None:
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
    def __init__(
        self, config: str, model: str, root: str, engine_args: dict[str, Any], timers: bool
    ):
        self.config = config
        self.timers = timers  # step_timers in the engine core
        # variants (experiments): "ours+nocap", vLLM's per-layer capture unbound after
        # start-up, "ours+nocopy", no device-to-host copy of the rows, and "ours+nojoin", the
        # frontend's join skipped, a request's first chunk its answer (these: R3 wrong by
        # design); "ours+pinnedviews", the rows handed on as views of the pinned copy, and
        # "ours+perlayer", vLLM's per-layer capture in eager steps instead of ours, batched;
        # "ours+fresh", row arrays in fresh memory, not reused; "ours+background", every batch
        # published on the background thread; "ours+allinline", every batch of blocks inline;
        # "ours+process", ours with --artifact-tracker process (the tracker process);
        # "+copyframes", the engine's ZMQ frames copied, never zero-copy; "ours+keys", every
        # request asks for the keys handoff (routed_experts_format="keys"), and the handles
        # are read from the store after the round, outside its time, as a trainer on the node
        # reads them; "+switch", the engine core's GIL switch interval 0.5 ms, not 5 (ours
        # runs with 0.5 ms by default: "off+switch" is the control, "ours+pyswitch" ours with
        # --artifact-switch-interval-ms keep, the interpreter's 5 ms); "+thp"
        # and "+keep", the allocator settings docs/configuration.md recommends;
        # "ours+earlyfacts", a step's facts applied before its forward is queued (these:
        # R3 right, report.RIGHT_R3); "+twin", nothing changed: a second
        # engine of the same configuration in the same rounds, an A/A control of the measure
        self.base, *self.variants = config.split("+")
        self.model = model
        self.root = root
        self.engine_args = engine_args
        self.llm: Any = None
        self.engine_pids: list[int] = []
        self.pinned: list[int] | None = None  # the CPUs this round's processes run on
        self.steps: list[tuple[float, int]] = []
        # per frontend step: how long its outputs waited after the engine made them (the
        # engine's time.monotonic and this perf_counter are both CLOCK_MONOTONIC here), and
        # how long the frontend then took to process them
        self.output_delays: list[tuple[float, float]] = []
        self.timeline_error = ""  # why gpu_timeline could not be installed

    def start(self) -> dict[str, Any]:
        from vllm import LLM

        kwargs = dict(self.engine_args)
        if self.base == "native":
            kwargs["enable_return_routed_experts"] = True
        elif self.base == "ours":
            kwargs.update(enable_routed_experts=True, artifact_root=self.root)
            if "process" in self.variants:
                kwargs["artifact_tracker"] = "process"
            if "pyswitch" in self.variants:
                kwargs["artifact_switch_interval_ms"] = "keep"
            if "keys" in self.variants:
                # handles are read right after their round; their objects stay pinned for
                # the lease, a few rounds' worth at once: room for them
                kwargs.update(artifact_keys_lease=KEYS_LEASE_S, artifact_capacity=KEYS_CAPACITY)
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
        original_get_output = engine.engine_core.get_output
        got: list[tuple[float, float]] = []  # (received, made by the engine) of the step's

        def timed_get_output() -> Any:
            outputs = original_get_output()
            # only messages that carry requests' outputs: others (stats, wake-ups) may have
            # been made long before, between rounds
            made = getattr(outputs, "timestamp", 0.0) if getattr(outputs, "outputs", None) else 0
            got.append((time.perf_counter(), float(made or 0.0)))
            return outputs

        def timed_step() -> Any:
            got.clear()
            outputs = original_step()
            done = time.perf_counter()
            self.steps.append((done, len(outputs)))
            if got:
                received, made = got[-1]
                waited = received - made if made else float("nan")
                self.output_delays.append((waited, done - received))
            return outputs

        engine.engine_core.get_output = timed_get_output
        engine.step = timed_step
        applied: list[Any] = []
        if self.timers:  # first: an unbound capture is not timed
            self.llm.collective_rpc(step_timers)
            try:  # a measuring aid not yet run on every vLLM: its failure is recorded
                self.llm.collective_rpc(gpu_timeline)
            except Exception as error:
                self.timeline_error = f"{type(error).__name__}: {error}"
        for variant in self.variants:
            if variant == "nocap":
                applied += self.llm.collective_rpc(unbind_capture)
            elif variant == "nocopy" and self.base == "ours":
                applied += self.llm.collective_rpc(skip_copy)
            elif variant == "pinnedviews" and self.base == "ours":
                applied += self.llm.collective_rpc(pinned_views)
            elif variant == "perlayer" and self.base == "ours":
                applied += self.llm.collective_rpc(per_layer_capture)
            elif variant == "fresh" and self.base == "ours":
                applied += self.llm.collective_rpc(fresh_arrays)
            elif variant == "background" and self.base == "ours":
                applied += self.llm.collective_rpc(background_publisher)
            elif variant == "allinline" and self.base == "ours":
                applied += self.llm.collective_rpc(all_inline)
            elif variant == "copyframes":
                applied += self.llm.collective_rpc(copied_frames)
            elif variant == "switch":
                applied += self.llm.collective_rpc(short_switch_interval)
            elif variant == "process" and self.base == "ours":
                applied.append("tracker process")
            elif variant == "pyswitch" and self.base == "ours":
                applied.append("switch interval: the interpreter's own")
            elif variant == "earlyfacts" and self.base == "ours":
                applied += self.llm.collective_rpc(early_facts)
            elif variant == "keys" and self.base == "ours":
                applied.append("keys handoff")
            elif variant == "nojoin" and self.base == "ours":
                applied.append(no_frontend_join())
            elif variant in ("thp", "keep"):  # set by the driver at the process's start
                applied.append(allocator_setting())
            elif variant == "twin":
                applied.append("twin: unchanged")
            else:
                raise ValueError(f"unknown variant {variant!r} of {self.base}")
        return {
            "startup_s": startup,
            "pid": os.getpid(),
            "engine_pids": self.engine_pids,
            "plugin_modules_loaded": len(plugins),
            "variants_applied": applied,  # per rank: routers unbound, or what the variant did
            "kwargs": repr(kwargs),
        }

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Any:
        from vllm import SamplingParams

        extra = {"routed_experts_format": "keys"} if "keys" in self.variants else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra
        )
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def warm(self, scale: float, workloads: list[str]) -> dict[str, Any]:
        """Every batch shape the rounds use, on other prompts (Triton compiles its MoE
        kernels per shape on first use), then an empty prefix cache."""
        started = time.perf_counter()
        for name, seed in (("decode", 99), ("prefill", 98)):
            if name not in workloads:
                continue
            prompts, _ = workload_prompts(name, seed, scale)
            self.generate(prompts, 8)
        self.llm.reset_prefix_cache()
        warmed = {"warm_s": time.perf_counter() - started}
        if os.environ.get(FREEZE_FRONTEND_GC) == "1":
            gc.collect()
            gc.freeze()
            warmed["frontend_gc_frozen"] = gc.get_freeze_count()
        return warmed

    def run(
        self, workload: str, seed: int, scale: float, waits: bool = False, repeat: int = 1
    ) -> dict[str, Any]:
        prompts, max_tokens = workload_prompts(workload, seed, scale, repeat=repeat)
        sampler = WaitSampler(self.engine_pids[0]) if waits and self.engine_pids else None
        self.llm.reset_prefix_cache()
        before_store = {**store_counts(self.llm), **frontend_files()} if self.base == "ours" else {}
        before = counters(self.llm)
        pids = [os.getpid(), *self.engine_pids]
        names = python_thread_names()
        with contextlib.suppress(Exception):  # the engine core's threads (same process as
            for found in self.llm.collective_rpc(lambda _: python_thread_names()):  # its worker)
                names.update({int(k): v for k, v in found.items()})
        self.read_step_timers()  # from zero
        self.read_gpu_timeline()
        gc0 = {"frontend": gc_totals(), "engine": self.engine_gc()}
        cpu0 = {pid: thread_cpu(pid, names) for pid in pids}
        proc0 = {pid: process_counters(pid) for pid in pids}
        waits0 = {pid: thread_waits(pid, names) for pid in pids}
        # instructions and cycles of the engine core's main thread (hw_counters.py says why)
        main_counters, no_counters = (
            open_counters(self.engine_pids[0]) if self.engine_pids else (None, "no engine")
        )
        self.steps = []
        self.output_delays = []
        with sampler or contextlib.nullcontext():
            started = time.perf_counter()
            outputs = self.generate(prompts, max_tokens)
            seconds = time.perf_counter() - started
        cpu1 = {pid: thread_cpu(pid, names) for pid in pids}
        main_thread_counters = main_counters.read() if main_counters else {}
        if main_counters:
            main_counters.close()
        proc1 = {pid: process_counters(pid) for pid in pids}
        waits1 = {pid: thread_waits(pid, names) for pid in pids}
        gc1 = {"frontend": gc_totals(), "engine": self.engine_gc()}
        timers = self.read_step_timers()
        timeline = self.read_gpu_timeline()
        after = counters(self.llm)
        after_store = {**store_counts(self.llm), **frontend_files()} if self.base == "ours" else {}
        keys_rows, keys_figures = read_keys(outputs) if "keys" in self.variants else ({}, {})
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        tokens = hashlib.blake2b(digest_size=8)
        r3 = hashlib.blake2b(digest_size=8)
        r3_bytes, missing = 0, 0
        per_request: list[str] = []  # so a difference between engines is counted, not only seen
        per_span: list[str] = []  # and located: which of a request's tokens differ
        for o in outputs:
            tokens.update(np.asarray(o.outputs[0].token_ids, dtype=np.int64).tobytes())
            experts = keys_rows.get(id(o), o.outputs[0].routed_experts)
            if self.base != "off":
                if not isinstance(experts, np.ndarray):
                    missing += 1
                    continue
                r3_bytes += experts.nbytes
                r3.update(str(experts.shape).encode())
                r3.update(np.ascontiguousarray(experts).tobytes())
                one = hashlib.blake2b(np.ascontiguousarray(experts).tobytes(), digest_size=6)
                per_request.append(one.hexdigest())
                per_span.append(span_digests(experts))
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
            "cpus": self.pinned,
            "repeat": repeat,
            "config": self.config,
            "seconds": seconds,
            "started_host_s": started,  # time.perf_counter: the GPU timeline's span on it
            **({"keys_read": keys_figures} if keys_figures else {}),
            "out_tokens": out_tokens,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "out_tok_s": out_tokens / seconds,
            "tokens_digest": tokens.hexdigest(),
            "r3_digest": r3.hexdigest(),
            "r3_request_digests": per_request,
            "r3_span_digests": per_span,
            "r3_bytes": r3_bytes,
            "r3_missing": missing,
            "steps": [[round(t - started, 5), n] for t, n in self.steps],
            "output_delays": [[round(w, 5), round(p, 5)] for w, p in self.output_delays],
            "counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
            "store": {k: after_store[k] - before_store.get(k, 0) for k in after_store},
            "threads_cpu_s": threads,
            "main_thread_counters": main_thread_counters or {"unavailable": no_counters},
            **{
                field: {
                    "frontend" if pid == os.getpid() else f"engine{i}": {
                        name: count - waits0[pid][kind].get(name, 0)
                        for name, count in waits1[pid][kind].items()
                        if count > waits0[pid][kind].get(name, 0)
                    }
                    for i, pid in enumerate(pids)
                }
                for kind, field in (
                    ("switches", "threads_voluntary_switches"),
                    ("faults", "threads_minor_faults"),
                )
            },
            "gc": {role: gc_delta(gc0[role], gc1[role]) for role in gc0},
            "step_timers": timers,
            "gpu_timeline": timeline,
            "main_thread_waits": sampler.result if sampler else {},
            "process": {
                "frontend" if pid == os.getpid() else f"engine{i}": {
                    k: v - proc0[pid].get(k, 0) for k, v in proc1[pid].items()
                }
                for i, pid in enumerate(pids)
            },
        }

    def profiled_round(self, command: dict[str, Any]) -> dict[str, Any]:
        """The profiled round a driver's command asks for (its ``cmd``, one of
        ``PROFILED_ROUNDS``)."""
        where = (command["workload"], command["seed"], command["scale"])
        if command["cmd"] == "torch_profile":
            return self.torch_profile(*where)
        if command["cmd"] == "python_profile":
            return self.python_profile(*where, dump=command["dump"])
        return self.frontend_profile(*where, dump=command["dump"], repeat=command.get("repeat", 1))

    def torch_profile(self, workload: str, seed: int, scale: float) -> dict[str, Any]:
        """A short round (the workload's first 32 prompts: a few steps of each kind) with
        torch.profiler running in the engine core; not timed."""
        return self._profiled_round(torch_profile, workload, seed, scale)

    def python_profile(self, workload: str, seed: int, scale: float, dump: str) -> dict[str, Any]:
        """The same short round with cProfile on the engine core's main thread (the whole
        profile written to ``dump``)."""
        return self._profiled_round(python_profile, workload, seed, scale, dump=dump)

    def frontend_profile(
        self, workload: str, seed: int, scale: float, dump: str, repeat: int = 1
    ) -> dict[str, Any]:
        """A whole round (not timed) with cProfile on this process's main thread: the
        frontend, which turns every step's outputs into results and joins R3's chunks (the
        engine's own threads are ``python_profile``'s)."""
        prompts, max_tokens = workload_prompts(workload, seed, scale, repeat=repeat)
        self.llm.reset_prefix_cache()
        python_profile()
        started = time.perf_counter()
        outputs = self.generate(prompts, max_tokens)
        seconds = time.perf_counter() - started
        table = python_profile(stop=True, dump=dump)
        del outputs
        return {"seconds": seconds, "table": table}

    def _profiled_round(
        self, profiler: Any, workload: str, seed: int, scale: float, **stop: Any
    ) -> dict[str, Any]:
        """The workload's first 32 prompts between ``profiler()`` and ``profiler(stop=True)``
        in the engine core; its table."""
        prompts, max_tokens = workload_prompts(workload, seed, scale, count=32)
        self.llm.reset_prefix_cache()
        self.llm.collective_rpc(profiler)
        started = time.perf_counter()
        self.generate(prompts, max_tokens)
        seconds = time.perf_counter() - started
        tables = self.llm.collective_rpc(profiler, kwargs={"stop": True, **stop})
        return {"seconds": seconds, "table": tables[0]}

    def read_step_timers(self) -> dict[str, list[float]]:
        """:func:`step_timers` since the last read (installed at start-up with ``timers``)."""
        if not self.timers:
            return {}
        with contextlib.suppress(Exception):
            return dict(self.llm.collective_rpc(step_timers, kwargs={"read": True})[0])
        return {}

    def read_gpu_timeline(self) -> dict[str, Any]:
        """:func:`gpu_timeline` since the last read (installed with the step timers); a
        failure is recorded as ``{"error": ...}``, not raised (the round's timing stands)."""
        if not self.timers:
            return {}
        if self.timeline_error:
            return {"error": self.timeline_error}
        try:
            return dict(self.llm.collective_rpc(gpu_timeline, kwargs={"read": True})[0])
        except Exception as error:  # any failure of the measuring aid
            return {"error": f"{type(error).__name__}: {error}"}

    def engine_gc(self) -> dict[str, float]:
        with contextlib.suppress(Exception):
            return dict(self.llm.collective_rpc(gc_totals)[0])
        return {}

    def stop(self) -> None:
        """vLLM's own shutdown first (it unlinks its shared-memory queues, 400 MB of
        /dev/shm on the CPU build), then whatever is left is killed."""
        import psutil

        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        for pid in self.engine_pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                for child in [proc, *proc.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        child.kill()


def main() -> None:
    config, model, root = sys.argv[1], sys.argv[2], sys.argv[3]
    engine_args = json.loads(sys.argv[4])
    timers = sys.argv[5:6] == ["timers"]
    # collective_rpc of a local function (the workers' Python thread names) needs pickle
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    worker = Worker(config, model, root, engine_args, timers)
    import vllm  # noqa: F401  (imported before "start", so the workers' imports overlap)

    reply(event="imported", pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["cmd"] == "start":
                reply(event="ready", **worker.start())
            elif command["cmd"] == "warm":
                workloads = command.get("workloads", ["decode", "prefill"])
                reply(event="warm", **worker.warm(command["scale"], workloads))
            elif command["cmd"] == "run":
                reply(
                    event="result",
                    **worker.run(
                        command["workload"],
                        command["seed"],
                        command["scale"],
                        command.get("waits", False),
                        command.get("repeat", 1),
                    ),
                )
            elif command["cmd"] == "pin":  # driver.py --split-cpus: this round's cores
                cpus = set(command["cpus"])
                threads = pin_tree([os.getpid()], cpus)
                worker.pinned = sorted(cpus)
                reply(event="pinned", threads=threads)
            elif command["cmd"] in PROFILED_ROUNDS:
                reply(event="profiled", **worker.profiled_round(command))
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
