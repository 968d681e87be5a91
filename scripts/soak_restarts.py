"""Soak: SIGKILL a serving engine mid-generation, round after round, restarting on one root.

Each round starts ``vllm serve MODEL --enable-routed-experts --artifact-root ROOT`` and checks
what the crash before it left: one store (the restarted engine took the dead one's over), no
temporary files, every object reads back with its checks (``ShmStore.scrub``), and every
keys-only handle answered in earlier rounds still reads the rows it read then (or is reported
missing, never corrupt or different). Then it sends a batch of concurrent requests (array and
keys path, shared prefixes so prefix hits read the store), checks every answer that arrives
against the transformers oracle, and SIGKILLs, alternately, the whole engine and only the
rank-zero worker (the R3 writer) while the batch runs. A last round serves without a kill.
The tests run one such crash (``tests/e2e/test_capacity.py``); this runs many.

Run: ``.venv/bin/python scripts/soak_restarts.py [--rounds 20] [--json FILE]``
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
from vllm_artifact_testing.chaos import TARGETS, check_root, sigkill
from vllm_artifact_testing.oracle import assert_routing_matches, hf_router_topk
from vllm_artifact_testing.server import RunningServer, vllm_server
from vllm_artifact_testing.tiny_models import ensure_tiny_model

from vllm_artifact.client import R3Reader, decode_r3
from vllm_artifact.core.store import ShmStore
from vllm_artifact.errors import ObjectMissingError

MODEL = "qwen3-moe-8x2"


@dataclass
class Figures:
    rounds: int = 0
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TARGETS, 0))
    requests_sent: int = 0
    answered: int = 0  # HTTP 200 before the kill, R3 oracle-checked
    lost_to_kill: int = 0  # no answer: connection closed or an error reply during the kill
    keys_read: int = 0
    keys_missing_after_kill: int = 0
    handles_reread: int = 0
    handles_missing_later: int = 0
    objects_scrubbed: int = 0
    corrupt_objects: int = 0
    leftover_files: int = 0
    extra_stores: int = 0
    max_store_bytes: int = 0
    capacity_bytes: int = 0
    seconds: float = 0.0


@dataclass
class KeysRecord:
    handle: str
    rows: np.ndarray


def prompts_for(round_index: int, n: int) -> list[str]:
    families = [
        " ".join(f"Soak family {f} line {i} routes to {(i * f) % 8}." for i in range(8))
        for f in range(4)
    ]
    return [f"{families[i % 4]} Round {round_index} request {i}." for i in range(n)]


def one_request(
    server: RunningServer, model: Path, prompt: str, max_tokens: int, keys: bool
) -> dict[str, Any] | None:
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
    except requests.RequestException:
        return None
    if reply.status_code != 200:
        return None
    result: dict[str, Any] = reply.json()
    return result


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


def check_restart(
    root: Path, records: list[KeysRecord], reader: R3Reader, figures: Figures
) -> None:
    check = check_root(root)
    figures.objects_scrubbed += check.objects
    figures.corrupt_objects += check.corrupt
    figures.leftover_files += len(check.leftovers)
    figures.extra_stores += max(0, len(check.stores) - 1)
    assert check.corrupt == 0 and not check.leftovers and len(check.stores) == 1, check
    store = ShmStore.open_reader(str(root), check.stores[0])
    try:
        stats = store.stats()
    finally:
        store.close()
    figures.max_store_bytes = max(figures.max_store_bytes, stats.bytes_used)
    figures.capacity_bytes = stats.capacity_bytes
    assert stats.bytes_used <= stats.capacity_bytes
    for record in records:
        try:
            again = reader.read(record.handle, timeout=1).experts
        except ObjectMissingError:
            figures.handles_missing_later += 1
            continue
        np.testing.assert_array_equal(again, record.rows)
        figures.handles_reread += 1


def run_round(
    index: int,
    kill: str | None,
    model: Path,
    root: Path,
    records: list[KeysRecord],
    rng: random.Random,
    figures: Figures,
    per_round: int,
) -> None:
    args = ["--enable-routed-experts", "--artifact-root", str(root), "--max-num-seqs", "8"]
    with vllm_server(model, args) as server, R3Reader() as reader:
        check_restart(root, records, reader, figures)
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
            if kill is not None:
                time.sleep(rng.uniform(3.0, 8.0))
                sigkill(server.process.pid, kill)
                figures.kills[kill] += 1
            for future, keys in zip(futures, modes, strict=True):
                reply = future.result()
                if reply is None:
                    figures.lost_to_kill += 1
                    continue
                figures.answered += 1
                record = check_answer(model, reply, keys, reader, figures)
                if record is not None:
                    records.append(record)
    figures.rounds += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds with a kill")
    parser.add_argument("--requests", type=int, default=12, help="concurrent requests a round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    model = ensure_tiny_model(MODEL)
    root = Path(f"/dev/shm/vllm-artifact-soak-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o700)
    rng = random.Random(args.seed)
    figures = Figures()
    records: list[KeysRecord] = []
    started = time.monotonic()
    try:
        for index in range(args.rounds + 1):
            kill = TARGETS[index % 2] if index < args.rounds else None
            lost_before = figures.lost_to_kill
            run_round(index, kill, model, root, records, rng, figures, args.requests)
            if kill is None:
                assert figures.lost_to_kill == lost_before, "a request failed without a kill"
            print(
                f"round {index + 1}/{args.rounds + 1} ({kill or 'no kill'}): "
                f"{figures.answered} answered, {figures.lost_to_kill} lost to kills, "
                f"{figures.objects_scrubbed} objects scrubbed, {figures.corrupt_objects} "
                f"corrupt, {time.monotonic() - started:.0f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures.seconds = round(time.monotonic() - started, 1)
    print(json.dumps(asdict(figures), indent=2))
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
