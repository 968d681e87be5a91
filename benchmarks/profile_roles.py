"""Where each process of a server spends a decode batch: py-spy profiles of the API server,
the engine core and the worker, for R3 off, vLLM's own R3 and ours, one server at a time
(or prefill or chat batches).

For each configuration: start ``vllm serve`` on the tiny model (the same flags and plugin
selection as ``bench_e2e.py``), run a warm-up batch, then record the three processes with py-spy
(``--nonblocking``, so the processes are not paused per sample) for exactly the duration of
``--batches`` batches of one ``bench_e2e`` workload (``--workload``: decode, the default, 16
concurrent requests of 64-token prompts and 128 output tokens; prefill; chat), stopping py-spy
with SIGINT when the last response arrives. Printed per process role: samples per 1000 output tokens
converted to seconds, split into "waiting" (the shm message queue's spin, ZMQ/asyncio polls)
and the rest; then the frames (function and file, inclusive) whose seconds per 1000 tokens
differ most between vLLM's own and ours, and every vllm-artifact frame.

Run: ``.venv/bin/python benchmarks/profile_roles.py [--configs off,vllm,ours] [--rate 50]
[--workload decode|prefill|chat] [--batches N]``
(about 3 minutes per configuration). Needs py-spy (not a dependency).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests
from bench_e2e import WARM_UP, Sizes, workloads
from server_processes import ROLES, environ, py_spy_path, role_pids, server_plans
from vllm_artifact_testing.server import RunningServer, vllm_server

from vllm_artifact.selftest.tiny_models import ensure_tiny_model

#: Frames in which a thread waits for work (spinning or polling), not doing any.
WAIT_FRAMES = (
    "acquire_read (vllm/distributed/device_communicators/shm_broadcast.py",
    "wait (vllm/distributed/device_communicators/shm_broadcast.py",
    "dequeue (vllm/distributed/device_communicators/shm_broadcast.py",
    "select (selectors.py",
    "_run_once (asyncio/base_events.py",
    "poll (zmq/",
    "recv_multipart (zmq/",
    "get (queue.py",
    "wait (threading.py",
)


def run_batch(
    server: RunningServer, model: Path, seed: int, workload: str = "decode", tiny: bool = False
) -> tuple[float, int]:
    """One batch of ``bench_e2e``'s workload of that name (its prompts for round ``seed``; a
    few short requests with ``tiny``, for warming up); (seconds, output tokens)."""
    sizes = WARM_UP if tiny else Sizes()
    (chosen,) = (w for w in workloads(str(model), sizes) if w.name == workload)
    batch = chosen.run(server, seed)
    return batch.elapsed, batch.output_tokens


def frame_key(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (path/file.py)``."""
    return re.sub(r":\d+\)$", ")", frame)


def load(raw: Path) -> list[tuple[str, list[str], int]]:
    """(thread, frames root first, count) per distinct stack of a py-spy raw file."""
    stacks = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():  # a frame py-spy could not format cleanly
            continue
        thread, *frames = stack.split(";")
        stacks.append((thread, [frame_key(f) for f in frames], int(count)))
    return stacks


def analyse(raw: Path, rate: int, tokens: int) -> dict[str, Any]:
    """Seconds per 1000 output tokens: per thread (waiting, working) and per inclusive frame."""
    scale = 1000 / rate / tokens
    threads: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    frames: collections.Counter[str] = collections.Counter()
    for thread, stack, n in load(raw):
        name = re.sub(r"^.*?\"(.*)\".*$|^\(?(.*?)\)?$", r"\1\2", thread).strip() or thread
        name = re.sub(r"\d+", "N", name)
        waiting = any(w in f for f in stack[-3:] for w in WAIT_FRAMES)
        threads[name][0 if waiting else 1] += n * scale
        for frame in set(stack):
            frames[f"{name}: {frame}"] += n
    return {
        "threads": {t: {"waiting": w, "working": k} for t, (w, k) in threads.items()},
        "frames": {f: n * scale for f, n in frames.items()},
    }


def profile_config(
    config: str,
    model: Path,
    store_root: Path,
    out: Path,
    rate: int,
    py_spy: str,
    workload: str = "decode",
    batches: int = 1,
) -> dict[str, Any]:
    args, env = server_plans(store_root)[config]
    with environ(VLLM_SERVER_DEV_MODE="1", **env), vllm_server(model, args) as server:
        run_batch(server, model, seed=-1, workload=workload, tiny=True)  # warm-up
        run_batch(server, model, seed=-2, workload=workload)
        requests.post(server.base_url + "/reset_prefix_cache", timeout=60)
        pids = role_pids(server.process.pid)
        recorders = {
            role: subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--nonblocking",
                    "--threads",
                    "-r",
                    str(rate),
                    "-f",
                    "raw",
                    "-o",
                    str(out / f"{config}-{role}.txt"),
                    "-p",
                    str(pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for role, pid in pids.items()
        }
        time.sleep(2)  # py-spy attached
        cpu0 = {r: psutil.Process(p).cpu_times() for r, p in pids.items()}
        seconds = 0.0
        tokens = 0
        for b in range(batches):  # new prompts each batch (prefill: no hits but the prefix)
            took, made = run_batch(server, model, seed=b, workload=workload)
            seconds += took
            tokens += made
        cpu1 = {r: psutil.Process(p).cpu_times() for r, p in pids.items()}
        for recorder in recorders.values():
            recorder.send_signal(signal.SIGINT)
        for recorder in recorders.values():
            recorder.wait(timeout=120)
    cpu = {
        r: 1000 * (cpu1[r].user + cpu1[r].system - cpu0[r].user - cpu0[r].system) / tokens
        for r in pids
    }
    print(
        f"{config}: batch of {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s; "
        "CPU s per 1000 tokens " + ", ".join(f"{r} {cpu[r]:.2f}" for r in ROLES if r in cpu),
        flush=True,
    )
    return {
        "tok_s": tokens / seconds,
        "cpu": cpu,
        "roles": {
            role: analyse(out / f"{config}-{role}.txt", rate, tokens)
            for role in pids
            if (out / f"{config}-{role}.txt").exists()
        },
    }


def report(results: dict[str, dict[str, Any]]) -> None:
    configs = list(results)
    for role in ROLES:
        print(f"\n{role}: py-spy seconds per 1000 output tokens (waiting / working), by thread")
        names = sorted({t for c in configs for t in results[c]["roles"].get(role, {})["threads"]})
        for name in names:
            cells = []
            for c in configs:
                x = results[c]["roles"].get(role, {"threads": {}})["threads"].get(name)
                cells.append(f"{x['waiting']:6.2f} /{x['working']:6.2f}" if x else f"{'-':>14}")
            print(
                f"  {name[:40]:<40}"
                + "".join(f"  {c}: {x}" for c, x in zip(configs, cells, strict=True))
            )
        if "vllm" in results and "ours" in results:
            a = results["vllm"]["roles"].get(role, {"frames": {}})["frames"]
            b = results["ours"]["roles"].get(role, {"frames": {}})["frames"]
            keys = set(a) | set(b)
            top = sorted(keys, key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))[:25]
            print("  frames (inclusive) differing most, s per 1000 tokens: vllm -> ours (diff)")
            for k in top:
                print(
                    f"    {a.get(k, 0.0):7.3f} -> {b.get(k, 0.0):7.3f} "
                    f"({b.get(k, 0.0) - a.get(k, 0.0):+7.3f})  {k[:150]}"
                )
            ours_frames = sorted(
                ((v, k) for k, v in b.items() if "vllm_artifact" in k), reverse=True
            )[:25]
            print("  vllm-artifact frames (inclusive), s per 1000 tokens:")
            for v, k in ours_frames:
                print(f"    {v:7.3f}  {k[:150]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="off,vllm,ours")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--workload", choices=("decode", "prefill", "chat"), default="decode")
    parser.add_argument("--batches", type=int, default=1, help="batches recorded per config")
    parser.add_argument("--json", type=Path, help="write the analysis here")
    args = parser.parse_args()
    py_spy = py_spy_path()
    if py_spy is None:
        sys.exit("py-spy is not installed: .venv/bin/pip install py-spy")
    model = ensure_tiny_model("qwen3-moe-8x2")
    out = Path(tempfile.mkdtemp(prefix="vllm-artifact-profile-roles-"))
    store_root = Path(tempfile.mkdtemp(prefix="vllm-artifact-profile-roles-", dir="/dev/shm"))
    store_root.chmod(0o700)
    results = {}
    try:
        for config in args.configs.split(","):
            results[config] = profile_config(
                config, model, store_root, out, args.rate, py_spy, args.workload, args.batches
            )
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nraw profiles in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
