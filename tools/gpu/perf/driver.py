"""Side-by-side R3 throughput on one GPU: R3 off, vLLM's own routed experts and ours.

One worker process per configuration (``worker.py``) holds its engine for the whole run;
the engines start one after another (vLLM's memory profiling must not see another engine
allocating), then every round runs each workload on each configuration in a rotated order,
with the round's own fresh prompts. Ratios are paired by round, so drift between rounds
cancels; each ratio comes with its geometric mean over rounds and a 95% bootstrap interval
(a goal is resolved when the interval lies on one side of it). After the timed rounds,
``--profile`` records one more round per configuration with py-spy (frontend and engine core,
every thread) and ``--torch-profile`` a short one under torch.profiler in the engine core
(op tables), ``--python-profile`` one under cProfile on the engine core's main thread
(``cprofile_diff.py`` compares two) and ``--frontend-profile`` a whole one on the frontend's
main thread, none counted in the ratios. ``--concurrent`` runs each
round's configurations at the same time instead of one after another: the machine's speed
drifts by tens of percent within seconds (the eager prefill steps), and at once it drifts
for all of them alike. ``--cpus`` pins every engine to a CPU set; ``--split-cpus`` gives each
configuration whole physical cores of its own, dealt out again each round (``pinning.py``). A
configuration ``ours+nocap`` is ours with vLLM's per-layer capture unbound after start-up:
an experiment that prices the capture itself (its R3 is wrong by design).

    python tools/gpu/perf/driver.py --out DIR [--rounds 5] [--configs off,native,ours]
        [--workloads decode,prefill] [--concurrent] [--profile] [--torch-profile]
        [--python-profile] [--frontend-profile] [--cpus auto] [--split-cpus] [--model DIR]
        [--shape dsv3|dsv3-cpu|small] [--scale 1.0]
        [--repeat N|prefill=4,decode=1] [--prefill-graphs]

On the H200 (``tools/gpu/run.sh perf``) the model is a random-weight Qwen3-MoE with
DeepSeek-V3's R3 shape (58 MoE layers, 256 experts, top-8, hidden 256), bf16, full CUDA
graphs. On a CPU machine (a smoke test of this script) a tiny model and ``--scale`` apply.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from engine_setup import (  # beside this file (run as a script)
    GPU_ENGINE_ARGS,
    MODEL_SHAPES,
    parse_cpus,
    parse_repeat,
    perf_model,
    with_prefill_graphs,
)
from pinning import split_cores
from proc_stats import ALLOCATOR_VARIANTS, FREEZE_FRONTEND_GC
from report import summary

HERE = Path(__file__).resolve().parent
TAG = "@@perf "


def engine_env(config: str, plugins_without_ours: str) -> dict[str, str]:
    """The environment a configuration's worker process (its frontend and engine) starts
    with."""
    env = dict(os.environ)
    if config.partition("+")[0] != "ours":  # our plugin stays out of off and native
        env["VLLM_PLUGINS"] = plugins_without_ours
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # store counters through collective_rpc
    # +thp, +keep: glibc reads its allocator settings at the process's start
    for variant in config.split("+")[1:]:
        env.update(ALLOCATOR_VARIANTS.get(variant, {}))
    return env


class Engine:
    """A worker process and its answers."""

    def __init__(
        self,
        config: str,
        model: Path,
        root: Path,
        args: dict[str, Any],
        log: Path,
        plugins_without_ours: str,
        cpus: set[int] | None = None,
        timers: bool = False,
    ):
        env = engine_env(config, plugins_without_ours)
        self.config = config
        self.root = root
        self.log: IO[str] = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "worker.py"),
                config,
                str(model),
                str(root),
                json.dumps(args),
                *(["timers"] if timers else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            # every process and thread of the engine inherits the worker's CPU set
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.answers: list[dict[str, Any]] = []
        self.ready = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            if line.startswith(TAG):
                with self.ready:
                    self.answers.append(json.loads(line[len(TAG) :]))
                    self.ready.notify_all()
            else:
                self.log.write(line)
                self.log.flush()
        with self.ready:
            self.answers.append({"event": "error", "error": f"worker exited ({self.proc.wait()})"})
            self.ready.notify_all()

    def send(self, **command: Any) -> int:
        """Send one command; returns the index its answer will have (for :meth:`wait`)."""
        with self.ready:
            seen = len(self.answers)
            if self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps(command) + "\n")
                self.proc.stdin.flush()
            return seen

    def wait(self, seen: int, timeout: float, what: object = None) -> dict[str, Any]:
        """The answer with index ``seen`` (an error answer after ``timeout`` seconds)."""
        with self.ready:
            if not self.ready.wait_for(lambda: len(self.answers) > seen, timeout=timeout):
                return {"event": "error", "error": f"no answer in {timeout:.0f} s to {what}"}
            return self.answers[seen]

    def ask(self, timeout: float, **command: Any) -> dict[str, Any]:
        """Send one command and wait for its answer (or the worker's first, for None)."""
        seen = self.send(**command) if command else 0  # the first answer may be in already
        return self.wait(seen, timeout, command)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()
        # The worker kills its engine, whose store stays in /dev/shm (memory) until another
        # store's start collects it after its TTL: gone with the configuration instead.
        shutil.rmtree(self.root, ignore_errors=True)


def profile(
    engine: Engine,
    ready: dict[str, Any],
    out: Path,
    rate: int,
    native: bool,
    idle: bool,
    **command: Any,
) -> dict[str, Any]:
    """One round under py-spy (every thread of the frontend and of the engine core); with
    ``idle`` also the samples of threads off the CPU, to see where they wait."""
    pids = {
        "frontend": ready["pid"],
        **{f"engine{i}": p for i, p in enumerate(ready["engine_pids"])},
    }
    spies = [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                "--native" if native else "--nonblocking",  # native stacks pause the process
                *(["--idle"] if idle else []),
                "--threads",
                "-r",
                str(rate),
                "-f",
                "raw",
                "-o",
                str(out / f"{engine.config}-{command['workload']}-{role}.txt"),
                "-p",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in pids.items()
    ]
    time.sleep(2)
    result = engine.ask(600, **command)
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default="off,native,ours")
    parser.add_argument("--workloads", default="decode,prefill")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=None, help="workload size factor")
    parser.add_argument(
        "--repeat",
        default="1",
        help="a round runs the workload this many times over (new ids each): longer rounds "
        "of the same shape, so what one round's end adds weighs less in its ratio; N for "
        "every workload or per workload, e.g. prefill=4,decode=1",
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/perf-models"))
    parser.add_argument(
        "--shape",
        choices=sorted(MODEL_SHAPES),
        default=None,
        help="the model built (default: dsv3 on a GPU, small on CPU)",
    )
    parser.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON")
    parser.add_argument(
        "--prefill-graphs",
        action="store_true",
        help="full CUDA graphs up to max_num_batched_tokens: prefill steps replay graphs",
    )
    parser.add_argument("--profile", action="store_true", help="one py-spy round at the end")
    parser.add_argument(
        "--torch-profile",
        action="store_true",
        help="one round per configuration under torch.profiler in the engine core (tables)",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run each round's configurations at the same time (drift hits them together)",
    )
    parser.add_argument(
        "--step-timers",
        action="store_true",
        help="time the engine core main thread's scheduler and R3 connector calls per "
        "round, and the GPU's time in and outside forward passes (gpu_timeline.py)",
    )
    parser.add_argument(
        "--wait-sampler",
        action="store_true",
        help="in timed rounds, sample what the engine main thread waits on (waits.py)",
    )
    parser.add_argument(
        "--python-profile",
        action="store_true",
        help="one round per configuration under cProfile on the engine core's main thread",
    )
    parser.add_argument(
        "--frontend-profile",
        action="store_true",
        help="one whole round per configuration under cProfile on the frontend's main thread",
    )
    parser.add_argument(
        "--spy-native",
        action="store_true",
        help="py-spy with native (C/CUDA) frames: launch vs. waiting on the GPU",
    )
    parser.add_argument(
        "--profile-configs",
        default="",
        help="the configurations --profile records (default: all), e.g. off,ours",
    )
    parser.add_argument(
        "--spy-idle",
        action="store_true",
        help="py-spy keeps samples of waiting threads too (with --spy-native: what they wait on)",
    )
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--deadline", type=float, default=540, help="stop rounds after (s)")
    parser.add_argument(
        "--cpus",
        default="",
        help='pin every engine to these CPUs ("auto": 8 CPUs local to GPU 0; "2-5,8")',
    )
    parser.add_argument(
        "--split-cpus",
        action="store_true",
        help="each configuration on physical cores of its own (of --cpus, else all allowed), "
        "rotated each round",
    )
    parser.add_argument(
        "--freeze-frontend-gc",
        action="store_true",
        help="every configuration's frontend freezes its heap after warming up (gc.freeze(), "
        "as vLLM's API server does), so no full collection of the start-up heap (~0.45 s in an "
        "offline LLM process) lands in a round",
    )
    args = parser.parse_args()
    begun = time.monotonic()
    if args.freeze_frontend_gc:  # the workers' environment (engine_env) copies ours
        os.environ[FREEZE_FRONTEND_GC] = "1"
    unknown = [
        c for c in args.configs.split(",") if c.partition("+")[0] not in ("off", "native", "ours")
    ]
    if unknown:  # a misspelt base would run as an engine without R3 and count as missing R3
        parser.error(f"unknown configuration {unknown}: each is off, native or ours[+variant]")
    try:
        repeats = parse_repeat(args.repeat, args.workloads.split(","))
    except ValueError as error:
        parser.error(f"--repeat {args.repeat}: {error}")
    import torch

    cpu = not torch.cuda.is_available()
    scale = args.scale if args.scale is not None else (0.05 if cpu else 1.0)
    if cpu:
        from vllm_artifact_testing.engine_env import ENGINE_KWARGS, apply_cpu_engine_env

        apply_cpu_engine_env()
        engine_args: dict[str, Any] = {
            **ENGINE_KWARGS,
            "max_model_len": 4096,
            "disable_log_stats": False,
        }
    else:
        engine_args = dict(GPU_ENGINE_ARGS)
    engine_args.update(args.engine_args)
    if args.prefill_graphs:
        engine_args = with_prefill_graphs(engine_args)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or perf_model(args.cache, args.shape or ("small" if cpu else "dsv3"))
    configs = args.configs.split(",")
    workloads = args.workloads.split(",")
    # CPU engines need the CPU support plugin in every configuration (docs/cpu.md)
    plugins_without_ours = "vllm_artifact_cpu_support" if cpu else "not_loaded"
    cpus = parse_cpus(args.cpus)
    print(f"engines pinned to CPUs {sorted(cpus) if cpus else 'none'}", flush=True)
    core_sets = (
        split_cores(cpus or os.sched_getaffinity(0), len(configs)) if args.split_cpus else []
    )
    if core_sets:
        print(f"each configuration on cores of its own: {[sorted(s) for s in core_sets]}")
    engines = {
        c: Engine(
            c,
            model,
            Path(f"/dev/shm/perf-{c}-{os.getpid()}"),
            engine_args,
            args.out / f"log-{c}.txt",
            plugins_without_ours,
            cpus,
            args.step_timers,
        )
        for c in configs
    }
    ready: dict[str, dict[str, Any]] = {}
    results: list[dict[str, Any]] = []

    def save() -> None:
        """results.json after every run, so a run cut short keeps what it measured."""
        (args.out / "results.json").write_text(
            json.dumps(
                {
                    "engine_args": engine_args,
                    "model": str(model),
                    "scale": scale,
                    "repeat": repeats,
                    "cpus": sorted(cpus) if cpus else None,
                    "split_cpus": [sorted(s) for s in core_sets],
                    "concurrent": args.concurrent,
                    "spy_rate": args.rate,  # py-spy samples a second: analyze.py's seconds
                    "ready": ready,
                    "results": results,
                },
                indent=1,
            )
        )

    try:
        for config, engine in engines.items():
            print(f"[{time.monotonic() - begun:5.0f}s] {config}: {engine.ask(300)}", flush=True)
        for config, engine in engines.items():  # one start at a time
            ready[config] = engine.ask(600, cmd="start")
            print(f"[{time.monotonic() - begun:5.0f}s] {config}: {ready[config]}", flush=True)
            if ready[config]["event"] != "ready":
                return 1
            warm = engine.ask(600, cmd="warm", scale=scale, workloads=workloads)
            print(f"[{time.monotonic() - begun:5.0f}s] {config}: {warm}", flush=True)
        for rnd in range(args.rounds):
            if time.monotonic() - begun > args.deadline:
                print(f"deadline: stopping after {rnd} rounds", flush=True)
                break
            for w, workload in enumerate(workloads):
                order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
                for i, config in enumerate(configs if core_sets else ()):  # --split-cpus
                    cpus_now = sorted(core_sets[(i + rnd) % len(core_sets)])
                    pinned = engines[config].ask(60, cmd="pin", cpus=cpus_now)
                    if pinned["event"] != "pinned":
                        print(f"{config}: {pinned}", flush=True)
                        return 1
                command = {
                    "cmd": "run",
                    "workload": workload,
                    "seed": 1000 * rnd + w,
                    "waits": args.wait_sampler,
                    "repeat": repeats[workload],
                }
                # --concurrent: every configuration's round starts now and runs at once
                sent = (
                    {c: engines[c].send(**command, scale=scale) for c in order}
                    if args.concurrent
                    else {}
                )
                for config in order:
                    res = (
                        engines[config].wait(sent[config], 600, command)
                        if args.concurrent
                        else engines[config].ask(600, **command, scale=scale)
                    )
                    if res["event"] != "result":
                        print(f"{config}: {res}", flush=True)
                        return 1
                    results.append(res)
                    save()
                    print(
                        f"[{time.monotonic() - begun:5.0f}s] round {rnd} {workload} {config}: "
                        f"{res['seconds']:.3f} s, {res['out_tok_s']:.1f} out tok/s, "
                        f"{len(res['steps'])} steps",
                        flush=True,
                    )
        for wanted, cmd, prefix in (
            (args.torch_profile, "torch_profile", "torch"),
            (args.python_profile, "python_profile", "cprofile"),
            (args.frontend_profile, "frontend_profile", "frontend-cprofile"),
        ):
            if not wanted:
                continue
            for w, workload in enumerate(workloads):
                for config in configs:
                    name = f"{prefix}-{config}-{workload}.txt"
                    res = engines[config].ask(
                        600,
                        cmd=cmd,
                        workload=workload,
                        seed=800_000 + w,
                        scale=scale,
                        dump=str((args.out / name).with_suffix(".pstats").resolve()),
                        repeat=repeats[workload],  # frontend_profile's whole round
                    )
                    (args.out / name).write_text(res.get("table", str(res)))
                    print(
                        f"[{time.monotonic() - begun:5.0f}s] {cmd} {workload} {config}: "
                        f"{res.get('seconds', 0):.3f} s -> {name}",
                        flush=True,
                    )
        if args.profile:
            profiled = args.profile_configs.split(",") if args.profile_configs else configs
            for w, workload in enumerate(workloads):
                for config in (c for c in configs if c in profiled):
                    res = profile(
                        engines[config],
                        ready[config],
                        args.out,
                        args.rate,
                        args.spy_native,
                        args.spy_idle,
                        cmd="run",
                        workload=workload,
                        seed=900_000 + w,
                        scale=scale,
                    )
                    res["profiled"] = True
                    results.append(res)
                    print(
                        f"[{time.monotonic() - begun:5.0f}s] profiled {workload} {config}: "
                        f"{res.get('seconds', 0):.3f} s",
                        flush=True,
                    )
    finally:
        for engine in engines.values():
            engine.close()
        timed = [r for r in results if not r.get("profiled")]
        save()
        text = summary(timed, configs, workloads)
        (args.out / "summary.txt").write_text(text + "\n")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
