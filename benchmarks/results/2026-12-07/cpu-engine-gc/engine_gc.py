# mypy: ignore-errors
"""What the engine core's young GC collections hold, R3 off / vLLM's own / ours, on this CPU.

One child process per configuration (off and native without our plugin, as
tools/gpu/perf/driver.py runs them): an offline ``LLM`` on the perf harness's model with
DeepSeek-V3's R3 shape (``dsv3-cpu``), a warm-up, then ``--rounds`` prefill-shaped rounds
(``--prompts`` prompts of ``--prompt-len`` tokens, 8 output tokens) while ``engine_gc_probe`` counts
the engine process's collections. Prints per configuration: collections and seconds by
generation and thread, the young objects' types and allocation sites per request.

usage: .venv/bin/python benchmarks/results/2026-12-07/cpu-engine-gc/engine_gc.py
       [--configs off,native,ours] [--rounds 2] [--prompts 128] [--prompt-len 512] [--inproc]

(report-worker.txt: --configs off,native,ours --rounds 2 --prompts 64; report-inproc.txt:
--configs off,ours --rounds 2 --prompts 64 --inproc, whose children exited 1 after writing
their results: the kill at the end assumed an engine process, fixed since)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
OUT = Path("/tmp/engine-gc")


def child(args) -> None:
    sys.path[:0] = [str(REPO / "tools/testing"), str(REPO / "tools/gpu/perf")]
    import numpy as np
    from engine_setup import perf_model
    from vllm_artifact_testing.engine_env import ENGINE_KWARGS, apply_cpu_engine_env

    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams

    model = perf_model(OUT / "models", "dsv3-cpu")
    # the worker in the engine-core process, as on one GPU (the CPU build's default is a
    # worker process of its own)
    kwargs = {**ENGINE_KWARGS, "max_model_len": 2048, "distributed_executor_backend": "uni"}
    root = None
    if args.child == "native":
        kwargs["enable_return_routed_experts"] = True
    elif args.child == "ours":
        root = Path(f"/dev/shm/engine-gc-{os.getpid()}")
        kwargs.update(enable_routed_experts=True, artifact_root=str(root))
    llm = LLM(str(model), **kwargs)
    rng = np.random.default_rng(0)

    def prompts():
        return [
            {"prompt_token_ids": rng.integers(3, 500, size=args.prompt_len).tolist()}
            for _ in range(args.prompts)
        ]

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(prompts(), params, use_tqdm=False)
    if not args.inproc:
        print("install:", llm.collective_rpc(_rpc("install")))
    if args.inproc:  # the scheduler's process: this one (the worker's: another)
        import engine_gc_probe as gc_probe

        print("install here:", gc_probe.install())
        gc_probe.start()
    else:
        llm.collective_rpc(_rpc("start"))
    for _ in range(args.rounds):
        llm.generate(prompts(), params, use_tqdm=False)
    if args.inproc:
        result = gc_probe.stop()
    else:
        (result,) = llm.collective_rpc(_rpc("stop"))
    result.update(config=args.child, requests=args.rounds * args.prompts)
    (OUT / f"result-{args.child}.json").write_text(json.dumps(result, indent=1))
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
    import psutil

    resources = getattr(llm.llm_engine.engine_core, "resources", None)  # none in-process
    for proc in resources.engine_manager.processes if resources else ():
        try:
            core = psutil.Process(proc.pid)
            for q in [*core.children(recursive=True), core]:
                q.kill()
        except psutil.NoSuchProcess:
            pass
    os._exit(0)


def _rpc(name):
    import engine_gc_probe as gc_probe

    return getattr(gc_probe, name)


def report(configs, top=18) -> None:
    for c in configs:
        r = json.loads((OUT / f"result-{c}.json").read_text())
        n = r["requests"]
        print(
            f"== {c}: {n} requests; young objects at gen0 starts {r['young'] / n:.1f}/request, "
            f"of them Triton's interpreter's or untraced {r['other'] / n:.1f}/request"
        )
        for (g, t, k), (_, _, s) in zip(r["collections"], r["seconds"], strict=True):
            print(f"   gen{g} {t:40s} {k:6d} x  {s * 1e3:8.1f} ms  ({k / n:.3f}/request)")
        print("   young objects by type (per request):")
        for k, v in r["types"][:top]:
            print(f"     {v / n:8.2f}  {k}")
        print("   allocation sites (sampled 1 in 8, per request):")
        for k, s, v in r["sites"][:top]:
            print(f"     {v / n:8.2f}  {k}\n               {s}")


def compare(configs, top=25) -> None:
    """Young objects per request by allocation site, the last configuration less the first."""
    first, last = (
        json.loads((OUT / f"result-{c}.json").read_text()) for c in (configs[0], configs[-1])
    )
    a = {(k, s): v / first["requests"] for k, s, v in first["sites"]}
    b = {(k, s): v / last["requests"] for k, s, v in last["sites"]}
    print(f"== young objects per request by site, {configs[-1]} less {configs[0]}:")
    diff = {key: b.get(key, 0) - a.get(key, 0) for key in set(a) | set(b)}
    for (k, s), d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(
            f"   {d:+8.2f}  ({a.get((k, s), 0):7.2f} -> {b.get((k, s), 0):7.2f})  {k}\n"
            f"              {s}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="off,native,ours")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--inproc",
        action="store_true",
        help="the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the probe "
        "here: the frontend's and the scheduler's objects (the CPU build's worker stays a "
        "process of its own)",
    )
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    OUT.mkdir(exist_ok=True)
    configs = args.configs.split(",")
    for c in configs:
        env = dict(os.environ)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        if c != "ours":
            env["VLLM_PLUGINS"] = "vllm_artifact_cpu_support"
        argv = [
            sys.executable,
            __file__,
            "--child",
            c,
            "--rounds",
            str(args.rounds),
            "--prompts",
            str(args.prompts),
            "--prompt-len",
            str(args.prompt_len),
        ]
        if args.inproc:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            argv.append("--inproc")
        with open(OUT / f"log-{c}.txt", "w") as log:
            rc = subprocess.run(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800
            ).returncode
        print(f"{c}: exit {rc}", flush=True)
    report(configs)
    compare(configs)


if __name__ == "__main__":
    main()
