"""Soak: SIGKILL a serving engine mid-generation, round after round, restarting on one root.

Each round starts ``vllm serve MODEL --enable-routed-experts --artifact-root ROOT
--artifact-capacity SIZE`` and checks what the crash before it left: one store (the restarted
engine took the dead one's over), no temporary files, every object reads back with its checks
(``ShmStore.scrub``), the store within the configured capacity measured from outside (the
arena file's size, a reader's count of its objects), and every keys-only handle answered in
earlier rounds still reads the rows it read then or is reported missing (evicted), never
corrupt or different. Then it sends a batch of concurrent requests (array and keys path,
shared prefixes so prefix hits read the store), checks every answer that arrives against the
transformers oracle, and SIGKILLs, alternately, the whole engine and only the rank-zero worker
(the R3 writer) while the batch runs. A last round serves without a kill.

The capacity is small on purpose (default 24 KiB: 48 objects, a round's worth): the store
evicts earlier rounds' objects while later rounds publish, so re-reading old handles takes
both branches (identical, missing), and the script fails if it never evicted. The engine warns
at startup that the capacity is below its KV cache (checked every round). The tests run one
such crash (``tests/e2e/test_capacity.py``); this runs many.

Run: ``.venv/bin/python scripts/soak_restarts.py [--rounds 20] [--artifact-capacity 24KiB]
[--json FILE]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import requests
from vllm_artifact_testing.chaos import TARGETS, check_root, sigkill, store_names
from vllm_artifact_testing.engine_env import ENGINE_KWARGS
from vllm_artifact_testing.server import RunningServer, vllm_server

from vllm_artifact.client import R3Reader, decode_r3
from vllm_artifact.core import R3Layout
from vllm_artifact.core.store import ShmStore
from vllm_artifact.core.store.shm_arena import ARENA_NAME, ArenaGeometry
from vllm_artifact.core.store.shm_metrics import StoreMetrics
from vllm_artifact.errors import ObjectMissingError
from vllm_artifact.integration.config import parse_size
from vllm_artifact.selftest.oracle import assert_routing_matches, hf_router_topk
from vllm_artifact.selftest.tiny_models import ensure_tiny_model

MODEL = "qwen3-moe-8x2"
#: What the engine logs at startup when its store holds fewer blocks than its KV cache.
CAPACITY_WARNING = "R3 blocks but the KV cache can hold"


@dataclass
class Figures:
    rounds: int = 0
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    requests_sent: int = 0
    answered: int = 0  # HTTP 200 before the kill, R3 oracle-checked
    lost_to_kill: int = 0  # no answer: connection closed or an error reply during the kill
    failed_without_kill: int = 0  # an error reply or a closed connection before the kill
    keys_read: int = 0
    keys_missing_after_kill: int = 0
    handles_reread: int = 0  # earlier rounds' handles read again after a restart: identical
    handles_missing_later: int = 0  # ... or reported missing (evicted)
    handles_evicted: int = 0  # distinct handles found missing
    evictions: int = 0  # the writers' own counts, summed over the engines
    objects_scrubbed: int = 0
    corrupt_objects: int = 0
    leftover_files: int = 0
    extra_stores: int = 0
    max_store_bytes: int = 0  # objects x slot size, a reader's count
    max_store_objects: int = 0
    capacity_bytes: int = 0  # --artifact-capacity
    capacity_objects: int = 0
    arena_bytes: int = 0  # the arena file on disk
    capacity_warnings: int = 0  # rounds whose engine logged the below-KV-cache warning
    seconds: float = 0.0


@dataclass(frozen=True)
class Capacity:
    """The configured capacity and the arena it must give, computed here from the model's
    layout (not asked of the engine)."""

    nbytes: int
    geometry: ArenaGeometry

    @classmethod
    def of(cls, model: Path, nbytes: int) -> Capacity:
        config = json.loads((model / "config.json").read_text())
        layout = R3Layout(
            num_layers=config["num_hidden_layers"],
            top_k=config["num_experts_per_tok"],
            num_experts=config["num_experts"],
            block_size=int(str(ENGINE_KWARGS["block_size"])),
        )
        return cls(nbytes, ArenaGeometry.for_capacity(layout, nbytes))


@dataclass
class KeysRecord:
    handle: str
    rows: np.ndarray
    missing: bool = False


def prompts_for(round_index: int, n: int) -> list[str]:
    families = [
        " ".join(f"Soak family {f} line {i} routes to {(i * f) % 8}." for i in range(8))
        for f in range(4)
    ]
    return [f"{families[i % 4]} Round {round_index} request {i}." for i in range(n)]


@dataclass
class Outcome:
    reply: dict[str, Any] | None  # None: no answer (an error reply or the connection closed)
    error: str
    at: float  # time.monotonic() when it came


def one_request(
    server: RunningServer, model: Path, prompt: str, max_tokens: int, keys: bool
) -> Outcome:
    body: dict[str, Any] = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if keys:
        body["vllm_xargs"] = {"routed_experts_format": "keys"}
    try:
        reply = requests.post(server.base_url + "/v1/completions", json=body, timeout=300)
    except requests.RequestException as error:
        return Outcome(None, repr(error), time.monotonic())
    if reply.status_code != 200:
        return Outcome(None, f"HTTP {reply.status_code}: {reply.text[:300]}", time.monotonic())
    result: dict[str, Any] = reply.json()
    return Outcome(result, "", time.monotonic())


def check_answer(
    model: Path, reply: dict[str, Any], keys: bool, reader: R3Reader, figures: Figures
) -> KeysRecord | None:
    """Oracle-check one answer; a keys answer is read at once (the kill may beat the
    publisher: then its objects are missing, never partial)."""
    choice = reply["choices"][0]
    executed = choice["prompt_token_ids"] + choice["token_ids"][:-1]
    if keys:
        try:
            experts = reader.read(choice["routed_experts"], timeout=5).experts
        except ObjectMissingError:
            figures.keys_missing_after_kill += 1
            return None
        figures.keys_read += 1
    else:
        experts = decode_r3(choice).experts
    assert experts.shape[0] == len(executed)
    assert_routing_matches(experts, hf_router_topk(model, executed))
    return KeysRecord(choice["routed_experts"], experts) if keys else None


def check_capacity(root: Path, capacity: Capacity, figures: Figures) -> None:
    """The store under ``root`` against the configured capacity, from outside the engine: the
    arena file is the size that capacity gives, and holds no more objects than it has slots."""
    (name,) = store_names(root)
    arena_bytes = (root / name / ARENA_NAME).stat().st_size
    assert arena_bytes == capacity.geometry.file_nbytes <= capacity.nbytes, arena_bytes
    store = ShmStore.open_reader(str(root), name)
    try:
        stats = store.stats()
    finally:
        store.close()
    assert stats.capacity_objects == capacity.geometry.slot_count, stats
    assert stats.objects <= capacity.geometry.slot_count, stats
    used = stats.objects * capacity.geometry.slot_nbytes
    assert used <= capacity.nbytes
    figures.max_store_bytes = max(figures.max_store_bytes, used)
    figures.max_store_objects = max(figures.max_store_objects, stats.objects)
    figures.arena_bytes = arena_bytes


def check_restart(
    root: Path, records: list[KeysRecord], reader: R3Reader, capacity: Capacity, figures: Figures
) -> None:
    check = check_root(root)
    figures.objects_scrubbed += check.objects
    figures.corrupt_objects += check.corrupt
    figures.leftover_files += len(check.leftovers)
    figures.extra_stores += max(0, len(check.stores) - 1)
    assert check.corrupt == 0 and not check.leftovers and len(check.stores) == 1, check
    check_capacity(root, capacity, figures)
    for record in records:
        try:
            again = reader.read(record.handle, timeout=1).experts
        except ObjectMissingError:
            figures.handles_missing_later += 1
            figures.handles_evicted += not record.missing
            record.missing = True
            continue
        assert not record.missing, "a handle read again after it was reported missing"
        np.testing.assert_array_equal(again, record.rows)
        figures.handles_reread += 1


def writer_evictions(root: Path) -> int:
    """Objects the store's current writer has evicted (its counters restart with it)."""
    (name,) = store_names(root)
    snapshot = StoreMetrics.read(root / name)
    return 0 if snapshot is None else snapshot.evictions


def run_round(
    index: int,
    kill: str | None,
    model: Path,
    root: Path,
    capacity: Capacity,
    records: list[KeysRecord],
    rng: random.Random,
    figures: Figures,
    per_round: int,
) -> None:
    args = ["--enable-routed-experts", "--artifact-root", str(root), "--max-num-seqs", "8"]
    args += ["--artifact-capacity", str(capacity.nbytes)]
    with vllm_server(model, args) as server, R3Reader() as reader:
        if CAPACITY_WARNING in server.log_path.read_text(errors="replace"):
            figures.capacity_warnings += 1
        check_restart(root, records, reader, capacity, figures)
        prompts = prompts_for(index, per_round)
        modes = [i % 2 == 1 for i in range(per_round)]
        # Short requests finish before the kill, long ones are cut by it.
        lengths = [rng.randint(2, 8) if i % 3 else rng.randint(64, 200) for i in range(per_round)]
        figures.requests_sent += per_round
        with concurrent.futures.ThreadPoolExecutor(max_workers=per_round) as pool:
            futures = [
                pool.submit(one_request, server, model, p, n, k)
                for p, n, k in zip(prompts, lengths, modes, strict=True)
            ]
            killed_at = float("inf")
            if kill is not None:
                time.sleep(rng.uniform(3.0, 8.0))
                evictions = writer_evictions(root)  # just before the kill
                killed_at = time.monotonic()
                sigkill(server.process.pid, kill)
                figures.kills[kill] += 1
            for future, keys in zip(futures, modes, strict=True):
                outcome = future.result()
                reply = outcome.reply
                if reply is None:
                    if outcome.at < killed_at:
                        figures.failed_without_kill += 1
                        print(f"request failed before any kill: {outcome.error}", flush=True)
                    else:
                        figures.lost_to_kill += 1
                    continue
                figures.answered += 1
                record = check_answer(model, reply, keys, reader, figures)
                if record is not None:
                    records.append(record)
            if kill is None:
                evictions = writer_evictions(root)
                check_capacity(root, capacity, figures)
    figures.evictions += evictions
    figures.rounds += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds with a kill")
    parser.add_argument("--requests", type=int, default=12, help="concurrent requests a round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--artifact-capacity",
        default="24KiB",
        help="store capacity (bytes or a size such as 24KiB): small, so that it evicts",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    model = ensure_tiny_model(MODEL)
    nbytes = parse_size(args.artifact_capacity)
    if nbytes == "auto":
        parser.error("--artifact-capacity must be a size: the soak checks eviction")
    capacity = Capacity.of(model, nbytes)
    root = Path(f"/dev/shm/vllm-artifact-soak-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o700)
    rng = random.Random(args.seed)
    figures = Figures(capacity_bytes=capacity.nbytes, capacity_objects=capacity.geometry.slot_count)
    records: list[KeysRecord] = []
    started = time.monotonic()
    try:
        for index in range(args.rounds + 1):
            kill = TARGETS[index % 2] if index < args.rounds else None
            run_round(index, kill, model, root, capacity, records, rng, figures, args.requests)
            assert not figures.failed_without_kill, "a request failed without a kill"
            print(
                f"round {index + 1}/{args.rounds + 1} ({kill or 'no kill'}): "
                f"{figures.answered} answered, {figures.lost_to_kill} lost to kills, "
                f"{figures.objects_scrubbed} objects scrubbed, {figures.corrupt_objects} "
                f"corrupt, earlier handles read again {figures.handles_reread} identical / "
                f"{figures.handles_missing_later} missing, {figures.evictions} evictions, "
                f"{time.monotonic() - started:.0f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures.seconds = round(time.monotonic() - started, 1)
    print(json.dumps(asdict(figures), indent=2))
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2) + "\n")
    assert figures.capacity_warnings == figures.rounds, "an engine did not warn about capacity"
    assert figures.evictions > 0 and figures.handles_missing_later > 0, (
        "the store never evicted an earlier round's objects: lower --artifact-capacity"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
