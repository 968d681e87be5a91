"""End-to-end cost of R3 over HTTP: R3 off vs vLLM's own routed experts vs vllm-artifact.

Three ``vllm serve`` processes of the same tiny MoE model (Model Runner V2, the CPU engine
settings of ``vllm_artifact_testing.engine_env``) stay up side by side:

* ``off``:  our plugin loaded, R3 not requested (the plugin must be inert);
* ``vllm``: vLLM 0.32's own routed experts (``--enable-return-routed-experts``) with our plugins
  excluded through ``VLLM_PLUGINS`` (only the CPU support plugin loads);
* ``ours``: ``--enable-routed-experts`` with a private store root under /dev/shm.

Every round runs each workload once per configuration, rotating the configuration order each
round. By default (``--turn 1``) the three batches of a workload run at once while the servers
take turns of 1 s, the other two stopped (``time_slices.TimeSlices``: never two servers on the
CPUs at once, and all three meet the same minutes of this drifting machine); a batch's
duration and latencies count only its server's turns. ``--turn 0`` runs one batch after the
other instead (the method of the earlier runs in benchmarks/results/2026-12-01/README.md; its
per-round ratios scattered 2-3x more). The prefix cache is reset before every batch (vLLM's
dev-mode endpoint) and every round has its own prompts.

Workloads:

* ``decode``:  many concurrent requests, short distinct prompts, long outputs (``ignore_eos``);
* ``prefill``: long prompts (a shared system prefix plus a distinct body), 4 output tokens;
* ``chat``:    concurrent multi-turn conversations; each turn resends the whole conversation,
  so the previous turns are prefix-cache hits (for ``ours`` their R3 is read from the store).

Printed per workload: medians over rounds of output tokens/s and of request latency (all
requests of all rounds pooled), ratios ours/off and ours/vLLM of throughput as the geometric
mean of the paired per-round ratios with its 95% confidence interval (the verdict; the ratio of
medians and the per-round range are printed too), prefix-cache hit rate (``/metrics``
counters and ``cached_tokens`` of the responses), peak RSS of each server's process tree and
the store's bytes. Targets (issue 6): ours/off >= 0.97 and
ours >= vLLM's own in throughput (and the same bounds on latency), hit rate with R3 on equal
to R3 off.

Also recorded for every batch, right around its requests: CPU seconds (user + sys) of the busy
server per process role (API server = the root pid, engine core and worker by their vLLM
process titles) and per thread (labelled with the Python thread name from ``py-spy dump`` when
py-spy is installed, else ``native:<comm>``), the CPU of the idle servers, the machine's busy
and steal time and what ran outside the servers, and the engine steps of the batch (vLLM's
``iteration_tokens`` histogram). Printed per configuration: CPU seconds per 1000 output tokens
per role, ours minus vLLM's and off, and the threads that differ most (or exist only in ours).
On this machine the engine core and the worker each spin on a core while they wait for the
other (vLLM's shm message queue), so their CPU follows wall time; the other rows show what
anything else costs.

Server instances: each configuration runs in one server process for the whole run, so a
server that is persistently faster or slower than another of the same configuration (seen
here: ±5% between runs in prefill, with nothing configured differently) does not cancel in
the paired rounds. ``--instances K`` splits the rounds into K blocks, each with freshly
started servers in a rotated start order (``--start-order`` sets the first block's).

Run: ``.venv/bin/python benchmarks/bench_e2e.py [--rounds N] [--instances K] [--turn S]
[--decode-requests N] [--quick] [--json FILE]`` (15-25 minutes with the defaults on 2 shared
cores, most of it the decode workload; ``--decode-requests 32`` adds about a third; ``--quick``
takes about 4).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import requests
from e2e_stats import TARGET_VS_OFF, TARGET_VS_VLLM, paired_ratio, resolution, round_blocks
from server_processes import (
    CONFIGS,
    LABELS,
    CpuSample,
    ThreadLabels,
    cpu_delta,
    cpu_sample,
    describe_processes,
    environ,
    role_order,
    server_plans,
    tree_memory,
)
from time_slices import TimeSlices
from vllm_artifact_testing.server import RunningServer, vllm_server

from vllm_artifact.client import decode_routed_experts
from vllm_artifact.selftest.tiny_models import ensure_tiny_model
from vllm_artifact.selftest.tokenizer import training_corpus

#: Special tokens of the tiny model's tokenizer are 0..2; prompts use ordinary ids only.
TOKEN_LOW, TOKEN_HIGH = 3, 512
#: Our register() log line, and the line our worker connector logs when it opens the store.
OUR_HOOKS_LINE = "vllm-artifact: hooks installed"
OUR_STORE_LINE = "vllm-artifact: R3 store root="


# ------------------------------------------------------------------------------ workloads


@dataclass(frozen=True)
class Sizes:
    decode_requests: int = 16
    decode_prompt: int = 64
    decode_tokens: int = 128
    prefill_requests: int = 32
    prefill_prompt: int = 1000
    prefill_shared: int = 256  # shared system prefix inside each prefill prompt
    prefill_tokens: int = 4
    chat_conversations: int = 8
    chat_turns: int = 4
    chat_tokens: int = 16


QUICK = Sizes(
    decode_requests=8,
    decode_tokens=32,
    prefill_requests=8,
    chat_conversations=4,
    chat_turns=2,
    chat_tokens=8,
)

#: A few short requests of each shape, to pay the one-off costs before anything is timed.
WARM_UP = Sizes(
    decode_requests=2,
    decode_tokens=4,
    prefill_requests=2,
    chat_conversations=1,
    chat_turns=2,
    chat_tokens=4,
)


@dataclass
class Batch:
    """One workload batch on one server."""

    elapsed: float = 0.0  # seconds the server worked on the batch (wall, or its turns)
    latencies: list[float] = field(default_factory=list)
    #: perf_counter times: the batch's first send and last reply, and each request's
    started: float = 0.0
    ended: float = 0.0
    spans: list[tuple[float, float]] = field(default_factory=list)
    turns: int = 0  # with --turn: the turns its server got
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, summed
    hits: float = 0.0  # /metrics prefix-cache counters, delta over the batch
    queries: float = 0.0
    steps: float = 0.0  # engine steps (count of vllm:iteration_tokens_total), delta
    step_tokens: float = 0.0  # tokens those steps scheduled (its sum), delta
    #: request (index, or (conversation, turn)) -> response; checked after timing
    responses: dict[object, dict[str, Any]] = field(default_factory=dict)
    #: CPU seconds of this server by role and thread, and of the machine (``cpu_delta``)
    cpu: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n)]


def decode_prompts(sizes: Sizes, round_index: int) -> list[list[int]]:
    rng = random.Random(f"decode-{round_index}")
    return [random_prompt(rng, sizes.decode_prompt) for _ in range(sizes.decode_requests)]


def prefill_prompts(sizes: Sizes, round_index: int) -> list[list[int]]:
    rng = random.Random(f"prefill-{round_index}")
    shared = random_prompt(rng, sizes.prefill_shared)
    body = sizes.prefill_prompt - sizes.prefill_shared
    return [shared + random_prompt(rng, body) for _ in range(sizes.prefill_requests)]


def chat_script(sizes: Sizes, round_index: int) -> tuple[str, list[list[str]]]:
    """A system prompt shared by every conversation, and each conversation's user turns."""
    sentences = training_corpus(seed=1000 + round_index, num_sentences=400)[40:]
    rng = random.Random(f"chat-{round_index}")
    system = "You are a router. " + " ".join(sentences[:12])
    users = [
        [" ".join(rng.sample(sentences, 3 if turn == 0 else 2)) for turn in range(sizes.chat_turns)]
        for _ in range(sizes.chat_conversations)
    ]
    return system, users


# ------------------------------------------------------------------------------ HTTP


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=128)
    )


async def post_json(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[tuple[float, float], dict[str, Any]]:
    """The reply's JSON and the request's (sent, answered) ``perf_counter`` times."""
    t0 = time.perf_counter()
    reply = await client.post(url, json=body)
    t1 = time.perf_counter()
    if reply.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:2000]}")
    result: dict[str, Any] = reply.json()
    return (t0, t1), result


def account(
    batch: Batch, request: object, span: tuple[float, float], result: dict[str, Any]
) -> None:
    usage = result["usage"]
    batch.spans.append(span)
    batch.latencies.append(span[1] - span[0])
    batch.output_tokens += usage["completion_tokens"]
    batch.prompt_tokens += usage["prompt_tokens"]
    batch.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    batch.responses[request] = result


async def run_completions(
    server: RunningServer, model: str, prompts: Sequence[list[int]], max_tokens: int
) -> Batch:
    batch = Batch()
    url = server.base_url + "/v1/completions"
    async with new_client() as client:

        async def one(index: int, prompt: list[int]) -> None:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            account(batch, index, *await post_json(client, url, body))

        batch.started = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        batch.ended = time.perf_counter()
        batch.elapsed = batch.ended - batch.started
    return batch


async def run_chat(
    server: RunningServer, model: str, script: tuple[str, list[list[str]]], max_tokens: int
) -> Batch:
    system, conversations = script
    batch = Batch()
    url = server.base_url + "/v1/chat/completions"
    async with new_client() as client:

        async def conversation(index: int, turns: list[str]) -> None:
            messages = [{"role": "system", "content": system}]
            for turn, text in enumerate(turns):
                messages.append({"role": "user", "content": text})
                body = {
                    "model": model,
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                span, result = await post_json(client, url, body)
                account(batch, (index, turn), span, result)
                reply = result["choices"][0]["message"]["content"] or ""
                messages.append({"role": "assistant", "content": reply})

        batch.started = time.perf_counter()
        await asyncio.gather(*(conversation(i, t) for i, t in enumerate(conversations)))
        batch.ended = time.perf_counter()
        batch.elapsed = batch.ended - batch.started
    return batch


#: Counters read from ``/metrics`` around every batch (summed over engines): prefix-cache
#: hits and queries, and the count and sum of vLLM's tokens-per-engine-step histogram.
COUNTERS = {
    "hits": "vllm:prefix_cache_hits_total",
    "queries": "vllm:prefix_cache_queries_total",
    "steps": "vllm:iteration_tokens_total_count",
    "step_tokens": "vllm:iteration_tokens_total_sum",
}


def engine_counters(server: RunningServer) -> dict[str, float]:
    """The :data:`COUNTERS` of one server, from one ``/metrics`` scrape."""
    text = requests.get(server.base_url + "/metrics", timeout=30).text
    return {
        name: sum(
            float(v)
            for v in re.findall(
                rf"^{re.escape(metric)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.MULTILINE
            )
        )
        for name, metric in COUNTERS.items()
    }


def reset_prefix_cache(server: RunningServer) -> None:
    for _ in range(50):
        reply = requests.post(server.base_url + "/reset_prefix_cache", timeout=60)
        reply.raise_for_status()
        if reply.json().get("success"):
            return
        time.sleep(0.2)  # blocks still held by a finishing request
    raise RuntimeError(f"{server.base_url}: /reset_prefix_cache kept failing")


def per_1000_tokens(batches: list[Batch], value: Callable[[Batch], float]) -> dict[str, float]:
    """All rounds pooled (sum of seconds / sum of output tokens), and the per-round range."""
    rounds = [1000 * value(b) / b.output_tokens for b in batches if b.output_tokens]
    tokens = sum(b.output_tokens for b in batches)
    return {
        "pooled": 1000 * sum(value(b) for b in batches) / tokens if tokens else float("nan"),
        "round_min": min(rounds, default=float("nan")),
        "round_max": max(rounds, default=float("nan")),
    }


def cpu_rows(batches: list[Batch]) -> dict[str, dict[str, float]]:
    """Per role (and totals) CPU seconds per 1000 output tokens."""
    roles = sorted({r for b in batches for r in b.cpu.get("roles", {})}, key=role_order)

    def of_role(role: str) -> Callable[[Batch], float]:
        return lambda b: float(b.cpu["roles"].get(role, 0.0))

    rows = {role: per_1000_tokens(batches, of_role(role)) for role in roles}
    rows["server total"] = per_1000_tokens(batches, lambda b: sum(b.cpu["roles"].values()))
    rows["other servers"] = per_1000_tokens(batches, lambda b: b.cpu["other_servers"])
    rows["client"] = per_1000_tokens(batches, lambda b: b.cpu["client"])
    rows["outside"] = per_1000_tokens(batches, lambda b: b.cpu["outside"])
    rows["machine busy"] = per_1000_tokens(batches, lambda b: b.cpu["machine_busy"])
    rows["steal"] = per_1000_tokens(batches, lambda b: b.cpu["steal"])
    rows["wall x CPUs"] = per_1000_tokens(batches, lambda b: b.elapsed * (os.cpu_count() or 1))
    return rows


def thread_rows(batches: list[Batch]) -> dict[str, dict[str, float]]:
    """``role/label`` -> CPU seconds per 1000 output tokens (pooled) and thread count."""
    keys = sorted(
        {(r, t) for b in batches for r, ts in b.cpu.get("threads", {}).items() for t in ts}
    )
    tokens = sum(b.output_tokens for b in batches)
    out = {}
    for role, label in keys:
        seconds = sum(b.cpu["threads"].get(role, {}).get(label, 0.0) for b in batches)
        count = max(b.cpu["thread_counts"].get(role, {}).get(label, 0) for b in batches)
        out[f"{role}/{label}"] = {
            "per_1000_tokens": 1000 * seconds / tokens if tokens else float("nan"),
            "threads": count,
        }
    return out


def report_cpu(chosen: list[Workload], batches: dict[tuple[str, str], list[Batch]]) -> None:
    """CPU seconds (user + sys) per 1000 output tokens: by role of the busy server, and by
    thread for threads that differ between vLLM's own and ours."""
    print(
        "\nCPU seconds (user + sys) per 1000 output tokens while the requests ran, all rounds "
        "pooled (per-round min-max); 'outside' = machine busy minus the three servers and "
        "the client"
    )
    for workload in chosen:
        rows = {c: cpu_rows(batches[(workload.name, c)]) for c in CONFIGS}
        print(f"\n{workload.name}:")
        print(
            f"  {'role':<14}"
            + "".join(f"{LABELS[c]:>24}" for c in CONFIGS)
            + "   ours-vLLM  ours-off"
        )
        names = list(dict.fromkeys(n for c in CONFIGS for n in rows[c]))
        for name in names:
            cells = []
            for c in CONFIGS:
                x = rows[c].get(name)
                cells.append(
                    f"{x['pooled']:8.2f} ({x['round_min']:6.2f}-{x['round_max']:6.2f})"
                    if x
                    else f"{'-':>24}"
                )
            ours = rows["ours"].get(name, {}).get("pooled", 0.0)
            vllm = rows["vllm"].get(name, {}).get("pooled", 0.0)
            off = rows["off"].get(name, {}).get("pooled", 0.0)
            print(
                f"  {name:<14}"
                + "".join(f"{x:>24}" for x in cells)
                + f"   {ours - vllm:+9.2f} {ours - off:+9.2f}"
            )
        invol = {
            c: per_1000_tokens(
                batches[(workload.name, c)],
                lambda b: sum(s["involuntary"] for s in b.cpu["ctx_switches"].values()),
            )["pooled"]
            for c in CONFIGS
        }
        print(
            "  involuntary context switches per 1000 tokens (server tree): "
            + ", ".join(f"{c} {invol[c]:.0f}" for c in CONFIGS)
        )
        for c in CONFIGS:
            done = batches[(workload.name, c)]
            per_step = [1000 * b.elapsed / b.steps for b in done if b.steps]
            step_tokens = summarize([b.step_tokens / b.steps for b in done if b.steps])
            print(
                f"  {LABELS[c]:<15} engine steps per batch {summarize([b.steps for b in done]):.0f}"
                f", tokens per step {step_tokens:.1f}"
                f", ms per step {summarize(per_step):.0f} (rounds "
                + "/".join(f"{x:.0f}" for x in per_step)
                + ")"
            )
        threads = {c: thread_rows(batches[(workload.name, c)]) for c in CONFIGS}
        keys = set(threads["ours"]) | set(threads["vllm"])
        only_ours = sorted(k for k in threads["ours"] if k not in threads["vllm"])

        per_key = {
            c: {k: v["per_1000_tokens"] for k, v in threads[c].items()} for c in ("ours", "vllm")
        }
        diffs = {k: per_key["ours"].get(k, 0.0) - per_key["vllm"].get(k, 0.0) for k in keys}
        shown = list(dict.fromkeys(sorted(keys, key=lambda k: -abs(diffs[k]))[:10] + only_ours))
        print("  threads, s per 1000 tokens (thread count): largest ours-vLLM and ours only")
        for key in shown:
            cells = []
            for c in CONFIGS:
                x = threads[c].get(key)
                cells.append(
                    f"{x['per_1000_tokens']:7.3f} ({x['threads']:>2})" if x else f"{'-':>12}"
                )
            tag = "  [ours only]" if key in only_ours else ""
            print(
                f"    {key[:44]:<44}"
                + "".join(f"{x:>14}" for x in cells)
                + f" {diffs[key]:+8.3f}{tag}"
            )


def dir_bytes(root: Path) -> tuple[int, int]:
    """(apparent size, allocated bytes) of every file under ``root``."""
    apparent = allocated = 0
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if path.is_file():
                apparent += st.st_size
                allocated += st.st_blocks * 512
    return apparent, allocated


def start_servers(
    stack: contextlib.ExitStack,
    model: Path,
    store_root: Path,
    log_dir: Path,
    order: Sequence[str] = CONFIGS,
) -> dict[str, RunningServer]:
    """The three configurations, started one after the other in ``order`` (each ~40-60 s
    here; the order shows whether a server's speed follows its configuration or its start)."""
    plans = server_plans(store_root)
    servers: dict[str, RunningServer] = {}
    for name in order:
        args, env = plans[name]
        t0 = time.perf_counter()
        with environ(VLLM_SERVER_DEV_MODE="1", **env):
            servers[name] = stack.enter_context(vllm_server(model, args, log_dir=log_dir))
        print(
            f"  started {name:<4} ({LABELS[name]}) in {time.perf_counter() - t0:4.0f} s: "
            f"{servers[name].base_url}, log {servers[name].log_path}",
            flush=True,
        )
    return servers


def check_logs(servers: dict[str, RunningServer]) -> list[str]:
    """Which plugin each server really runs, from its log; returns problems."""
    problems = []
    logs = {name: s.log_path.read_text(errors="replace") for name, s in servers.items()}
    if OUR_HOOKS_LINE not in logs["off"] or OUR_STORE_LINE in logs["off"]:
        problems.append("off: expected our hooks installed and no R3 store opened")
    # Our log lines start "vllm-artifact:"; our modules appear as vllm_artifact. or /. (The
    # model's cache path, /root/.cache/vllm-artifact/..., is neither.)
    if re.search(r"vllm-artifact:|vllm_artifact[./]", logs["vllm"]):
        problems.append("vllm: our plugin was active (its log mentions vllm-artifact)")
    if OUR_HOOKS_LINE not in logs["ours"] or OUR_STORE_LINE not in logs["ours"]:
        problems.append("ours: our hooks or R3 store line missing from the log")
    return problems


# ------------------------------------------------------------------------------ the run


@dataclass
class Workload:
    name: str
    describe: str
    run: Callable[[RunningServer, int], Batch]  # (server, round) -> batch


def workloads(model: str, sizes: Sizes) -> list[Workload]:
    s = sizes
    return [
        Workload(
            "decode",
            f"{s.decode_requests} concurrent requests, {s.decode_prompt}-token prompts, "
            f"{s.decode_tokens} output tokens",
            lambda srv, r: asyncio.run(
                run_completions(srv, model, decode_prompts(s, r), s.decode_tokens)
            ),
        ),
        Workload(
            "prefill",
            f"{s.prefill_requests} concurrent requests, {s.prefill_prompt}-token prompts "
            f"({s.prefill_shared} shared), {s.prefill_tokens} output tokens",
            lambda srv, r: asyncio.run(
                run_completions(srv, model, prefill_prompts(s, r), s.prefill_tokens)
            ),
        ),
        Workload(
            "chat",
            f"{s.chat_conversations} concurrent conversations x {s.chat_turns} turns, "
            f"{s.chat_tokens} output tokens per turn (/v1/chat/completions)",
            lambda srv, r: asyncio.run(run_chat(srv, model, chat_script(s, r), s.chat_tokens)),
        ),
    ]


def timed_batch(
    workload: Workload, server: RunningServer, round_index: int, pids: dict[str, int]
) -> tuple[Batch, CpuSample, CpuSample]:
    """One batch from a cold prefix cache, with the prefix-cache counters' deltas, and CPU
    samples of every server right before and after the requests (not around the resets and
    /metrics scrapes)."""
    reset_prefix_cache(server)
    before = engine_counters(server)
    sample0 = cpu_sample(pids)
    batch = workload.run(server, round_index)
    sample1 = cpu_sample(pids)
    time.sleep(0.5)  # let the last iteration's stats reach /metrics
    add_engine_counters(batch, before, engine_counters(server))
    return batch, sample0, sample1


def add_engine_counters(batch: Batch, before: dict[str, float], after: dict[str, float]) -> None:
    batch.hits, batch.queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
    batch.steps = after["steps"] - before["steps"]
    batch.step_tokens = after["step_tokens"] - before["step_tokens"]


def sliced_batches(
    workload: Workload,
    servers: dict[str, RunningServer],
    order: Sequence[str],
    round_index: int,
    pids: dict[str, int],
    turn_s: float,
) -> tuple[dict[str, Batch], CpuSample, CpuSample]:
    """Every configuration's batch in flight at once, the servers running in turns of
    ``turn_s`` seconds (``time_slices``): durations and latencies count only the time each
    server ran. Same cold prefix caches and counters as :func:`timed_batch`; the CPU samples
    span all three batches (each server's own CPU is still its batch's alone)."""
    for name in order:
        reset_prefix_cache(servers[name])
    before = {name: engine_counters(servers[name]) for name in order}
    done: dict[str, Batch] = {}
    errors: list[BaseException] = []
    sample0 = cpu_sample(pids)
    with TimeSlices({name: servers[name].process.pid for name in order}, turn_s) as slices:

        def run(name: str) -> None:
            try:
                done[name] = workload.run(servers[name], round_index)
            except BaseException as error:  # re-raised below, on the main thread
                errors.append(error)
            finally:
                slices.finish(name)

        threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in order]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    sample1 = cpu_sample(pids)
    if errors:
        raise errors[0]
    for name, batch in done.items():
        batch.elapsed = slices.active(name, batch.started, batch.ended)
        batch.latencies = [slices.active(name, a, b) for a, b in batch.spans]
        batch.turns = slices.turns(name)
    time.sleep(0.5)  # let the last iteration's stats reach /metrics
    for name in order:
        add_engine_counters(done[name], before[name], engine_counters(servers[name]))
    return done, sample0, sample1


def check_r3(config: str, batch: Batch, shape_per_token: tuple[int, int]) -> list[str]:
    """R3 present and well-shaped exactly where it should be; returns problems."""
    problems = []
    for result in batch.responses.values():
        choice = result["choices"][0]
        payload = choice.get("routed_experts")
        if config == "off":
            if payload is not None:
                problems.append("off: a response carries routed_experts")
            continue
        if payload is None:
            problems.append(f"{config}: a response has no routed_experts")
            continue
        usage = result["usage"]
        rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        experts = decode_routed_experts(payload)
        if experts.shape != (rows, *shape_per_token):
            problems.append(f"{config}: routed_experts shape {experts.shape}, expected {rows} rows")
    return problems


def same_r3(a: Batch, b: Batch) -> tuple[int, int]:
    """(identical, compared) routed_experts arrays of two batches with the same requests."""
    same = total = 0
    for request, ra in a.responses.items():
        rb = b.responses.get(request)
        if rb is None:
            continue
        pa, pb = ra["choices"][0].get("routed_experts"), rb["choices"][0].get("routed_experts")
        if pa is None or pb is None:
            continue
        total += 1
        same += bool(np.array_equal(decode_routed_experts(pa), decode_routed_experts(pb)))
    return same, total


def warm_up(servers: dict[str, RunningServer], model: str) -> None:
    """First requests of each shape pay one-off costs; keep them out of the timings."""
    for server in servers.values():
        for workload in workloads(model, WARM_UP):
            workload.run(server, -1)
        reset_prefix_cache(server)


@functools.cache
def code_version() -> str:
    """Where the servers import vllm_artifact from, and that tree's git revision when the run
    started (cached: the JSON written at the end names the code the servers ran, not a commit
    made meanwhile)."""
    import vllm_artifact

    package = Path(vllm_artifact.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=package,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "no git"
    return f"{package} ({rev})"


def summarize(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def run_round(
    r: int,
    rounds: int,
    chosen: list[Workload],
    servers: dict[str, RunningServer],
    pids: dict[str, int],
    labels: ThreadLabels,
    batches: dict[tuple[str, str], list[Batch]],
    same: dict[str, list[int]],
    shape_per_token: tuple[int, int],
    turn_s: float,
) -> list[str]:
    """Round ``r``: every workload once per configuration, the order rotated by ``r`` (one
    batch after the other, or with ``turn_s`` all at once in turns); returns the problems
    found."""
    problems: list[str] = []
    order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
    for workload in chosen:
        line = [f"  round {r + 1}/{rounds} {workload.name:<7}"]
        if turn_s:
            sliced, sample0, sample1 = sliced_batches(workload, servers, order, r, pids, turn_s)
            labels.refresh(sample1)
        for name in order:
            if turn_s:
                batch = sliced[name]
            else:
                batch, sample0, sample1 = timed_batch(workload, servers[name], r, pids)
                labels.refresh(sample1)  # new threads: named after the batch
            batch.cpu = cpu_delta(name, sample0, sample1, labels)
            problems += check_r3(name, batch, shape_per_token)
            batches[(workload.name, name)].append(batch)
            line.append(f"{name} {batch.tokens_per_s:6.1f} tok/s")
        a, b = batches[(workload.name, "vllm")][-1], batches[(workload.name, "ours")][-1]
        s_, t_ = same_r3(a, b)
        same[workload.name][0] += s_
        same[workload.name][1] += t_
        for batch in (a, b, batches[(workload.name, "off")][-1]):
            batch.responses.clear()
        print("  ".join(line), flush=True)
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--quick", action="store_true", help="small workloads, one round")
    ap.add_argument(
        "--workloads", default="decode,prefill,chat", help="comma-separated subset to run"
    )
    ap.add_argument(
        "--decode-requests", type=int, help="concurrent requests of the decode workload (16)"
    )
    ap.add_argument("--model", default="qwen3-moe-8x2", help="tiny model variant")
    ap.add_argument(
        "--start-order", default=",".join(CONFIGS), help="order in which the servers start"
    )
    ap.add_argument(
        "--instances",
        type=int,
        default=1,
        help="split the rounds over this many sets of freshly started servers",
    )
    ap.add_argument(
        "--turn",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="run the three batches of a workload at once, the servers taking turns of this "
        "many seconds (the others stopped; default 1); 0 = one batch after the other",
    )
    ap.add_argument("--json", type=Path, help="write all measurements here (for plotting)")
    args = ap.parse_args()
    if args.turn < 0:
        ap.error("--turn must be 0 (one batch after the other) or a positive number of seconds")
    sizes = QUICK if args.quick else Sizes()
    if args.decode_requests:
        sizes = dataclasses.replace(sizes, decode_requests=args.decode_requests)
    rounds = args.rounds or (1 if args.quick else 3)
    selected = args.workloads.split(",")
    start_order = args.start_order.split(",")
    if sorted(start_order) != sorted(CONFIGS):
        ap.error(f"--start-order must name each of {', '.join(CONFIGS)} once")
    if not 1 <= args.instances <= rounds:
        ap.error("--instances must be between 1 and the number of rounds")

    model_path = ensure_tiny_model(args.model)
    config = json.loads((model_path / "config.json").read_text())
    shape_per_token = (config["num_hidden_layers"], config["num_experts_per_tok"])
    model = str(model_path)
    chosen = [w for w in workloads(model, sizes) if w.name in selected]
    load_start = os.getloadavg()
    started_at = datetime.datetime.now().astimezone()
    print(
        f"bench_e2e {started_at:%Y-%m-%d %H:%M %Z}: {rounds} round(s), {os.cpu_count()} CPUs, "
        f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
        f"model {args.model}; vllm_artifact from {code_version()}"
    )
    if args.turn:
        print(
            f"  batches of a round run at once, the servers taking turns of {args.turn:g} s; "
            "durations and latencies count each server's own turns"
        )
    store_root = Path(tempfile.mkdtemp(prefix="vllm-artifact-bench-e2e-", dir="/dev/shm"))
    store_root.chmod(0o700)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-artifact-bench-e2e-logs-"))
    batches: dict[tuple[str, str], list[Batch]] = {(w.name, c): [] for w in chosen for c in CONFIGS}
    same: dict[str, list[int]] = {w.name: [0, 0] for w in chosen}
    problems: list[str] = []
    memory: dict[str, tuple[int, int, int]] = {}
    store = (0, 0)
    completed = 0
    n, k = rounds, args.instances
    blocks = round_blocks(n, k)
    aborted = False
    try:
        for instance, block in enumerate(blocks):
            # Each instance starts fresh servers, its start order rotated: a server process can
            # be persistently faster or slower than another of the same configuration.
            order = start_order[instance % 3 :] + start_order[: instance % 3]
            if args.instances > 1:
                print(f"  instance {instance + 1}/{args.instances}: start order {','.join(order)}")
            with contextlib.ExitStack() as stack:
                t_start = time.perf_counter()
                servers = start_servers(stack, model_path, store_root, log_dir, order)
                problems += check_logs(servers)
                warm_up(servers, model)
                print(f"  servers ready and warmed up in {time.perf_counter() - t_start:.0f} s")
                pids = {name: s.process.pid for name, s in servers.items()}
                labels = ThreadLabels()
                describe_processes(pids, labels)
                try:
                    for r in block:
                        problems += run_round(
                            r,
                            rounds,
                            chosen,
                            servers,
                            pids,
                            labels,
                            batches,
                            same,
                            shape_per_token,
                            args.turn,
                        )
                        completed += 1
                except (OSError, RuntimeError, httpx.HTTPError, requests.RequestException) as error:
                    # A server died (or was signalled by someone else): report complete rounds.
                    problems.append(
                        f"aborted after {completed} rounds: {type(error).__name__}: {error}"
                    )
                    for done in batches.values():
                        del done[completed:]
                    print(f"  ABORTED after {completed} rounds: {error}", flush=True)
                    aborted = True
                for name, pid in pids.items():  # peak over the instances, the rest of the last
                    peak, current, huge = tree_memory(pid)
                    memory[name] = (max(peak, memory.get(name, (0, 0, 0))[0]), current, huge)
                store = dir_bytes(store_root)
            if aborted:
                break
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
    rounds = completed
    load_end = os.getloadavg()
    if rounds == 0:
        print("no complete round: nothing to report; " + "; ".join(problems))
        print(f"server logs kept in {log_dir}")
        sys.exit(1)
    report(chosen, batches, same, memory, store, problems, rounds, load_end)
    report_cpu(chosen, batches)
    if args.json:
        dump_json(
            args.json,
            args,
            sizes,
            rounds,
            chosen,
            batches,
            memory,
            store,
            same,
            problems,
            (started_at, load_start, load_end),
        )
        print(f"\nmeasurements written to {args.json}")
    if problems:
        print(f"server logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ report


def stats(batches: list[Batch]) -> dict[str, float]:
    latencies = [t for b in batches for t in b.latencies]
    hits = sum(b.hits for b in batches)
    queries = sum(b.queries for b in batches)
    prompt = sum(b.prompt_tokens for b in batches)
    return {
        "tok_s": summarize([b.tokens_per_s for b in batches]),
        "all_tok_s": summarize([(b.output_tokens + b.prompt_tokens) / b.elapsed for b in batches]),
        "latency": summarize(latencies),
        "latency_p90": float(np.percentile(latencies, 90)) if latencies else float("nan"),
        "hit_rate": hits / queries if queries else float("nan"),
        "cached_rate": sum(b.cached_tokens for b in batches) / prompt if prompt else float("nan"),
    }


def per_round_ratios(num: list[Batch], den: list[Batch]) -> list[float]:
    return [a.tokens_per_s / b.tokens_per_s for a, b in zip(num, den, strict=True)]


def ratios(
    batches: dict[tuple[str, str], list[Batch]], workload: str
) -> dict[str, dict[str, float]]:
    s = {c: stats(batches[(workload, c)]) for c in CONFIGS}
    out = {}
    for ref in ("off", "vllm"):
        rounds = per_round_ratios(batches[(workload, "ours")], batches[(workload, ref)])
        paired, low, high = paired_ratio(rounds)
        out[ref] = {
            "tok_s": s["ours"]["tok_s"] / s[ref]["tok_s"],
            "latency": s["ours"]["latency"] / s[ref]["latency"],
            "round_min": min(rounds),
            "round_max": max(rounds),
            "paired": paired,
            "paired_ci_low": low,
            "paired_ci_high": high,
        }
    return out


def report(
    chosen: list[Workload],
    batches: dict[tuple[str, str], list[Batch]],
    same: dict[str, list[int]],
    memory: dict[str, tuple[int, int, int]],
    store: tuple[int, int],
    problems: list[str],
    rounds: int,
    load_end: tuple[float, float, float],
) -> None:
    print(f"\nmedians over {rounds} round(s); latency = median (p90) of every request")
    verdicts: list[tuple[str, bool]] = []
    for workload in chosen:
        print(f"\n{workload.name}: {workload.describe}")
        print(
            f"  {'config':<15} {'out tok/s':>9} {'all tok/s':>9} {'latency s':>17} "
            f"{'hit rate':>9} {'cached':>7}"
        )
        for c in CONFIGS:
            s = stats(batches[(workload.name, c)])
            print(
                f"  {LABELS[c]:<15} {s['tok_s']:9.1f} {s['all_tok_s']:9.1f} "
                f"{s['latency']:8.2f} ({s['latency_p90']:6.2f}) {s['hit_rate']:9.1%} "
                f"{s['cached_rate']:7.1%}"
            )
        r = ratios(batches, workload.name)
        for ref, target in (("off", TARGET_VS_OFF), ("vllm", TARGET_VS_VLLM)):
            x = r[ref]
            ok_t = x["paired"] >= target
            ok_l = x["latency"] <= 1 / target
            resolved = resolution(x["paired_ci_low"], x["paired_ci_high"], target)
            print(
                f"  ours/{ref:<4} tok/s: paired geo-mean {x['paired']:5.3f} (95% CI "
                f"{x['paired_ci_low']:.3f}-{x['paired_ci_high']:.3f}, {resolved}; rounds "
                f"{x['round_min']:.3f}-{x['round_max']:.3f}; ratio of medians {x['tok_s']:5.3f}; "
                f"target >= {target:.2f}: {verdict(ok_t)})"
            )
            print(
                f"  {'':<10}latency (median of all requests) {x['latency']:5.3f} "
                f"(target <= {1 / target:.3f}: {verdict(ok_l)})"
            )
            verdicts += [
                (f"{workload.name}: ours/{ref} tok/s (paired geo-mean, {resolved})", ok_t),
                (f"{workload.name}: ours/{ref} latency", ok_l),
            ]
        h_off = stats(batches[(workload.name, "off")])
        h_ours = stats(batches[(workload.name, "ours")])
        h_vllm = stats(batches[(workload.name, "vllm")])
        equal = h_ours["hit_rate"] == h_off["hit_rate"] or (
            np.isnan(h_ours["hit_rate"]) and np.isnan(h_off["hit_rate"])
        )
        print(
            f"  hit rate ours {h_ours['hit_rate']:.2%} vs off {h_off['hit_rate']:.2%} "
            f"(vLLM's {h_vllm['hit_rate']:.2%}): {verdict(equal)};  identical R3 arrays "
            f"ours vs vLLM's: {same[workload.name][0]}/{same[workload.name][1]}"
        )
        verdicts.append((f"{workload.name}: hit rate ours == off", equal))
    print("\nmemory (each server's process tree: API server, engine core, worker)")
    for c in CONFIGS:
        peak, current, huge = memory[c]
        print(
            f"  {LABELS[c]:<15} peak RSS {peak / 2**30:5.2f} GiB, now {current / 2**30:5.2f} GiB, "
            f"of which {huge / 2**30:5.2f} GiB in transparent huge pages"
        )
    print(
        f"  store root of ours: {store[0] / 2**20:.1f} MiB apparent, "
        f"{store[1] / 2**20:.1f} MiB allocated in /dev/shm"
    )
    done = [b for w in chosen for c in CONFIGS for b in batches[(w.name, c)]]
    turns = [b.turns for b in done if b.turns]
    if turns:  # --turn: the "other servers" ran their own batches in their turns
        print(
            f"\nturns per batch {min(turns)}-{max(turns)} (batches at once, one server running "
            f"at a time); load average at the end {load_end[0]:.2f}"
        )
    else:
        idle_cpu = sum(b.cpu["other_servers"] for b in done)
        busy_cpu = sum(sum(b.cpu["roles"].values()) for b in done)
        print(
            f"\nCPU used by the idle servers while another ran a batch: {idle_cpu:.1f} s "
            f"(vs {busy_cpu:.1f} s by the busy one); load average at the end {load_end[0]:.2f}"
        )
    print("\nsummary")
    for name, ok in verdicts:
        print(f"  {verdict(ok)}  {name}")
    if problems:
        print(f"\nPROBLEMS ({len(problems)}):")
        for problem in dict.fromkeys(problems):
            print(f"  {problem}")
    else:
        print(
            "\nchecks: off returned no R3; vLLM's and ours returned R3 of the right shape on every "
            "response; logs show our plugin inactive in vLLM's configuration"
        )


def dump_json(
    path: Path,
    args: argparse.Namespace,
    sizes: Sizes,
    rounds: int,
    chosen: list[Workload],
    batches: dict[tuple[str, str], list[Batch]],
    memory: dict[str, tuple[int, int, int]],
    store: tuple[int, int],
    same: dict[str, list[int]],
    problems: list[str],
    when: tuple[datetime.datetime, tuple[float, ...], tuple[float, ...]],
) -> None:
    started_at, load_start, load_end = when
    data: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code": code_version(),
        "date": started_at.isoformat(timespec="minutes"),
        "cpus": os.cpu_count(),
        "load_start": load_start,
        "load_end": load_end,
        "rounds": rounds,
        "sizes": sizes.__dict__,
        "targets": {"vs_off": TARGET_VS_OFF, "vs_vllm": TARGET_VS_VLLM},
        "memory": {
            c: {"peak_rss": m[0], "rss": m[1], "anon_huge_pages": m[2]} for c, m in memory.items()
        },
        "start_order": args.start_order.split(","),
        "instances": args.instances,
        "turn_s": args.turn,
        "store_bytes": {"apparent": store[0], "allocated": store[1]},
        "problems": sorted(set(problems)),
        "workloads": {},
    }
    for workload in chosen:
        data["workloads"][workload.name] = {
            "describe": workload.describe,
            "stats": {c: stats(batches[(workload.name, c)]) for c in CONFIGS},
            "ratios": ratios(batches, workload.name),
            "identical_r3": same[workload.name],
            "cpu_per_1000_tokens": {c: cpu_rows(batches[(workload.name, c)]) for c in CONFIGS},
            "threads_per_1000_tokens": {
                c: thread_rows(batches[(workload.name, c)]) for c in CONFIGS
            },
            "batches": {
                c: [
                    {
                        "elapsed": b.elapsed,
                        "output_tokens": b.output_tokens,
                        "prompt_tokens": b.prompt_tokens,
                        "cached_tokens": b.cached_tokens,
                        "hits": b.hits,
                        "queries": b.queries,
                        "latencies": b.latencies,
                        "cpu": b.cpu,
                        "steps": b.steps,
                        "step_tokens": b.step_tokens,
                        "turns": b.turns,
                    }
                    for b in batches[(workload.name, c)]
                ]
                for c in CONFIGS
            },
        }
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
