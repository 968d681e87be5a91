"""Where a decode step's time goes: py-spy profiles of one server's worker and engine core.

Starts ``vllm serve`` on the tiny model (R3 off, or ours with ``--enable-routed-experts``),
runs a warm-up batch, then records both processes with py-spy while a batch of 16 concurrent
128-token requests runs, and prints the share of the worker's main-thread samples per
Triton kernel caller, and every frame of vllm-artifact code seen. ``docs/benchmarks.md`` has
the findings. Needs py-spy (``.venv/bin/pip install py-spy``; not a dependency).

Run: ``.venv/bin/python benchmarks/profile_decode.py {off,ours} [--seconds 25]``
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import itertools
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests
from vllm_artifact_testing.server import RunningServer, vllm_server

from vllm_artifact.selftest.tiny_models import ensure_tiny_model


def batch(server: RunningServer, model: Path) -> float:
    def one(i: int) -> int:
        body: dict[str, Any] = {
            "model": str(model),
            "prompt": f"Decode request {i} " * 8,
            "max_tokens": 128,
            "temperature": 0,
            "ignore_eos": True,
        }
        return requests.post(
            server.base_url + "/v1/completions", json=body, timeout=600
        ).status_code

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert set(pool.map(one, range(16))) == {200}
    return time.monotonic() - started


def summarize(raw: Path, what: str) -> None:
    """Main-thread samples by the frame that called into Triton (or 'no triton'), and every
    vllm-artifact frame in any thread."""
    callers: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    main = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n, frames = int(count), stack.split(";")
        if "vllm_artifact" in stack:
            ours[next(f for f in frames if "vllm_artifact" in f)] += n
        if "MainThread" not in frames[0]:
            continue
        main += n
        caller = "(no triton)"
        for before, frame in itertools.pairwise(frames):
            if "triton/runtime" in frame:
                caller = before
                break
        callers[caller] += n
    print(f"\n{what}: {main} main-thread samples")
    for caller, n in callers.most_common(10):
        print(f"  {100 * n / max(main, 1):5.1f}%  {caller}")
    print("  vllm-artifact frames (any thread):")
    for frame, n in ours.most_common(8):
        if "vllm_artifact" in frame:
            print(f"  {n:6d}  {frame}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("off", "ours"))
    parser.add_argument("--seconds", type=int, default=25)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        sys.exit("py-spy is not installed: .venv/bin/pip install py-spy")
    model = ensure_tiny_model("qwen3-moe-8x2")
    flags = ["--enable-routed-experts"] if args.mode == "ours" else []
    out = Path(tempfile.mkdtemp(prefix="vllm-artifact-profile-"))
    with vllm_server(model, flags) as server:
        batch(server, model)  # warm-up
        titles = {
            p.pid: " ".join(p.cmdline())
            for p in psutil.Process(server.process.pid).children(recursive=True)
        }
        targets = {
            role: next(pid for pid, title in titles.items() if f"VLLM::{role}" in title)
            for role in ("Worker", "EngineCore")
        }
        recorders = {
            role: subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(args.seconds),
                    "-r",
                    "100",
                    "-f",
                    "raw",
                    "--threads",
                    "-o",
                    str(out / f"{role}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for role, pid in targets.items()
        }
        print(f"{args.mode}: batch of 16 x 128 tokens took {batch(server, model):.1f} s")
        for recorder in recorders.values():
            recorder.wait()
    for role in targets:
        summarize(out / f"{role}.txt", f"{args.mode} {role}")
    print(f"\nraw profiles in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
