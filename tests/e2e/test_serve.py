"""``vllm serve --enable-routed-experts`` over HTTP on 127.0.0.1, checked against the oracle."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from vllm_artifact_testing.server import RunningServer, vllm_servers
from vllm_artifact_testing.store_faults import flip_in_every_slot

from vllm_artifact.client import decode_r3
from vllm_artifact.selftest.oracle import assert_routing_matches, hf_router_topk

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def servers(model_a: Path, model_b: Path, store_root: Path) -> Iterator[list[RunningServer]]:
    """Both servers of this module, started at the same time (their start-ups overlap)."""
    # --enable-scale-out serves the token-in/token-out endpoint (/inference/v1/generate).
    args_a = ["--enable-routed-experts", "--enable-prompt-tokens-details", "--enable-scale-out"]
    # The upstream spelling --enable-return-routed-experts keeps working.
    args_b = ["--enable-return-routed-experts"]
    # Each in a root of the module's own: never the user's default root.
    specs = [
        (model_a, [*args_a, "--artifact-root", str(store_root)]),
        (model_b, [*args_b, "--artifact-root", str(store_root / "server-b")]),
    ]
    # Dev mode serves vLLM's RL endpoints (/update_weight_version, /finish_weight_update).
    with vllm_servers(specs, env={"VLLM_SERVER_DEV_MODE": "1"}) as started:
        yield started


@pytest.fixture(scope="module")
def server_a(servers: list[RunningServer]) -> RunningServer:
    return servers[0]


@pytest.fixture(scope="module")
def server_b_old_flag(servers: list[RunningServer]) -> RunningServer:
    """The uint16 model, served with the upstream spelling ``--enable-return-routed-experts``."""
    return servers[1]


@pytest.fixture(autouse=True)
def fresh_prefix_cache(servers: list[RunningServer]) -> None:
    """Each test starts with empty prefix caches (dev mode's POST /reset_prefix_cache), so it
    passes in any order and alone: the corrupt-store test damages every object of server_a's
    store, and a later test's first request must not hit a prefix whose R3 it damaged."""
    for server in servers:
        deadline = time.monotonic() + 30
        while not requests.post(server.base_url + "/reset_prefix_cache", timeout=60).json()[
            "success"
        ]:  # an aborted request may still hold blocks for a moment
            assert time.monotonic() < deadline, "the prefix cache could not be reset"
            time.sleep(0.2)


def greedy_body(model: Path, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A greedy request of exactly ``max_tokens`` tokens that returns token ids."""
    return {
        "model": str(model),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }


def post(server: RunningServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = requests.post(server.base_url + path, json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def check_choice(model: Path, prompt_ids: list[int], choice: dict[str, Any]) -> np.ndarray:
    decoded = decode_r3(choice)
    experts = decoded.experts
    executed = prompt_ids + choice["token_ids"][:-1]
    assert experts.shape[0] == len(executed)
    oracle = hf_router_topk(model, executed)
    assert_routing_matches(experts, oracle)
    assert decoded.dense_layers == tuple(np.flatnonzero(~oracle.moe_layers).tolist())
    return experts


def test_completions(server_a: RunningServer, model_a: Path) -> None:
    body = greedy_body(
        model_a, 10, prompt=["The router picks two experts.", "Hello, world! How are you today?"]
    )
    result = post(server_a, "/v1/completions", body)
    assert len(result["choices"]) == 2
    for choice in result["choices"]:
        experts = check_choice(model_a, choice["prompt_token_ids"], choice)
        assert experts.dtype == np.uint8
        assert experts.shape == (len(choice["prompt_token_ids"]) + 10 - 1, 4, 2)


def test_chat_completions(server_a: RunningServer, model_a: Path) -> None:
    body = greedy_body(
        model_a, 10, messages=[{"role": "user", "content": "Which experts did you use?"}]
    )
    result = post(server_a, "/v1/chat/completions", body)
    choice = result["choices"][0]
    check_choice(model_a, result["prompt_token_ids"], choice)


def test_repeated_prompt_hits_prefix_cache(server_a: RunningServer, model_a: Path) -> None:
    prompt = " ".join(f"Token {i} goes to expert {i % 8}." for i in range(30))
    body = greedy_body(model_a, 6, prompt=prompt)
    first = post(server_a, "/v1/completions", body)
    second = post(server_a, "/v1/completions", body)
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached is not None and cached >= 32, second["usage"]
    rows = [
        check_choice(model_a, r["choices"][0]["prompt_token_ids"], r["choices"][0])
        for r in (first, second)
    ]
    np.testing.assert_array_equal(rows[0], rows[1])


def test_200_concurrent_requests_all_oracle_correct(server_a: RunningServer, model_a: Path) -> None:
    """Load: 200 requests at once, four shared prompt prefixes (prefix hits read from the
    store while other requests publish); none lost, every R3 oracle-equal."""
    prefixes = [
        " ".join(f"Family {f} line {i} routes to {i * f % 8}." for i in range(6)) for f in range(4)
    ]
    prompts = [f"{prefixes[i % 4]} Request {i} asks about item {i * 7}." for i in range(200)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=200) as pool:
        replies = list(
            pool.map(
                lambda p: post(server_a, "/v1/completions", greedy_body(model_a, 4, prompt=p)),
                prompts,
            )
        )
    assert len(replies) == 200
    cached = 0
    for reply in replies:
        (choice,) = reply["choices"]
        check_choice(model_a, choice["prompt_token_ids"], choice)
        cached += (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached > 0  # shared prefixes were served from the KV cache (their R3 from the store)


def test_old_flag_uint16_model(server_b_old_flag: RunningServer, model_b: Path) -> None:
    body = greedy_body(model_b, 8, prompt="Three hundred experts need sixteen bits.")
    choice = post(server_b_old_flag, "/v1/completions", body)["choices"][0]
    experts = check_choice(model_b, choice["prompt_token_ids"], choice)
    assert experts.dtype == np.uint16
    assert (experts[:, 1, :] == 65535).all()  # the dense layer's mark, not expert 0


def test_token_in_token_out_generate(server_a: RunningServer, model_a: Path) -> None:
    prompt_ids = [5, 17, 42, 99, 100, 101, 7, 8, 9, 250, 300, 12]
    body = {
        "model": str(model_a),
        "token_ids": prompt_ids,
        "sampling_params": {"max_tokens": 7, "temperature": 0, "ignore_eos": True},
    }
    choice = post(server_a, "/inference/v1/generate", body)["choices"][0]
    experts = check_choice(model_a, prompt_ids, choice)
    assert experts.shape == (len(prompt_ids) + 7 - 1, 4, 2)


def test_the_servers_routers_render_r3_with_the_splice(server_a: RunningServer) -> None:
    """The hook that joins the base64 into the JSON is in place in the real API server (its
    output is byte-identical to vLLM's, so the log line is what shows it)."""
    log = server_a.log_path.read_text(errors="replace")
    for router in ("completion", "chat_completion", "scale_out.token_in_token_out"):
        assert re.search(rf"vllm\.entrypoints\.(openai\.)?{router}\.api_router renders R3", log)


KEYS_XARGS = {"vllm_xargs": {"routed_experts_format": "keys"}}
READ_HANDLES = """
import json, sys
import numpy as np
from vllm_artifact.client import read_r3_keys
handles = json.load(sys.stdin)
arrays = {str(i): read_r3_keys(handle).experts for i, handle in enumerate(handles)}
np.savez(sys.argv[1], **arrays)
assert "vllm" not in sys.modules and "torch" not in sys.modules
"""


def test_keys_only_handoff_read_by_another_process(
    server_a: RunningServer, model_a: Path, tmp_path: Path
) -> None:
    """``vllm_xargs.routed_experts_format = "keys"`` on completions (a batch, one prompt
    served from the KV cache), chat and token-in/token-out: ``routed_experts`` is a JSON handle;
    a separate process (no vLLM, no torch) reads every handle from the server's store, and the
    rows equal the oracle and the array path's."""
    prompt = " ".join(f"Keys handoff sentence {i} for the trainer." for i in range(12))
    post(server_a, "/v1/completions", greedy_body(model_a, 6, prompt=prompt))  # cache it
    hit = post(server_a, "/v1/completions", greedy_body(model_a, 6, prompt=prompt, **KEYS_XARGS))
    cached = (hit["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached and cached >= 32, hit["usage"]
    batch = greedy_body(model_a, 6, prompt=["Keys, not arrays.", "A second prompt."], **KEYS_XARGS)
    completions = post(server_a, "/v1/completions", batch)
    messages = [{"role": "user", "content": "Keys please."}]
    chat = post(
        server_a, "/v1/chat/completions", greedy_body(model_a, 5, messages=messages, **KEYS_XARGS)
    )
    prompt_ids = [5, 17, 42, 99, 100, 101, 7, 8, 9, 250, 300, 12]
    tito = post(
        server_a,
        "/inference/v1/generate",
        {
            "model": str(model_a),
            "token_ids": prompt_ids,
            "sampling_params": {
                "max_tokens": 7,
                "temperature": 0,
                "ignore_eos": True,
                "extra_args": {"routed_experts_format": "keys"},
            },
        },
    )
    cases = [(c["prompt_token_ids"], c) for c in (*hit["choices"], *completions["choices"])]
    cases += [(chat["prompt_token_ids"], chat["choices"][0]), (prompt_ids, tito["choices"][0])]
    handles = [json.loads(choice["routed_experts"]) for _, choice in cases]
    assert all(h["format"] == "vllm-artifact/r3-keys/v1" for h in handles)
    out = tmp_path / "r3.npz"
    reader = subprocess.run(
        [sys.executable, "-c", READ_HANDLES, str(out)],
        input=json.dumps(handles),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reader.returncode == 0, reader.stderr
    read = np.load(out)
    for i, (prompt_ids_i, choice) in enumerate(cases):
        experts = read[str(i)]
        executed = prompt_ids_i + choice["token_ids"][:-1]
        assert experts.shape[0] == len(executed)
        assert_routing_matches(experts, hf_router_topk(model_a, executed))
    array_path = post(server_a, "/v1/completions", greedy_body(model_a, 6, prompt=prompt))
    np.testing.assert_array_equal(read["0"], decode_r3(array_path["choices"][0]).experts)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"vllm_xargs": {"routed_experts_format": "npz"}}, "must be one of 'array', 'keys'"),
        ({"vllm_xargs": {"routed_experts_format": 3}}, "must be one of 'array', 'keys'"),
        ({**KEYS_XARGS, "stream": True}, '"stream": false'),
        ({**KEYS_XARGS, "stop": ["."]}, "cannot be combined with stop strings"),
    ],
)
def test_bad_r3_request_options_are_400(
    server_a: RunningServer, model_a: Path, fields: dict[str, Any], says: str
) -> None:
    body = greedy_body(model_a, 3, prompt="Options are checked first.", **fields)
    reply = requests.post(server_a.base_url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]["message"]
    assert post(server_a, "/v1/completions", greedy_body(model_a, 2, prompt="Still up."))


@pytest.mark.parametrize("bad", ["", "v" * 4097], ids=["empty", "too-long"])
def test_a_bad_weight_version_over_http_is_400_and_the_engine_keeps_serving(
    server_a: RunningServer, model_a: Path, bad: str
) -> None:
    """POST /update_weight_version and /finish_weight_update (vLLM's RL endpoints, dev mode)
    with a version our keys cannot carry: a 400 that says what to send, the old version
    kept, the engine serving (before the check, the next step killed it)."""
    base = server_a.base_url
    for path, body in (
        ("/update_weight_version", {"new_version": bad}),
        ("/finish_weight_update", {"weight_version": bad}),
    ):
        reply = requests.post(base + path, json=body, timeout=60)
        assert reply.status_code == 400, (path, reply.status_code, reply.text)
        assert "weight version" in reply.json()["error"]["message"], reply.text
    assert requests.get(base + "/weight_info", timeout=60).json() == {"weight_version": "default"}
    body = greedy_body(model_a, 3, prompt=f"Served after a bad weight version {len(bad)}.")
    choice = post(server_a, "/v1/completions", body)["choices"][0]
    check_choice(model_a, choice["prompt_token_ids"], choice)


def test_update_weight_version_over_http_rekeys_r3(server_a: RunningServer, model_a: Path) -> None:
    """POST /update_weight_version reaches our connector: a prompt the KV cache still holds
    fails closed under the new version (its R3 was keyed under the old one) instead of
    returning the old weights' routing, and is served again under the old version."""
    base = server_a.base_url
    prompt = " ".join(f"Weight version over HTTP, sentence {i}." for i in range(30))
    body = greedy_body(model_a, 3, prompt=prompt)
    post(server_a, "/v1/completions", body)  # cached and published under "default"
    reply = requests.post(base + "/update_weight_version", json={"new_version": "v-http"})
    assert reply.status_code == 200, reply.text
    try:
        assert requests.get(base + "/weight_info", timeout=60).json()["weight_version"] == (
            "v-http"
        )
        stale = requests.post(base + "/v1/completions", json=body, timeout=300)
        assert stale.status_code == 500, stale.text
        message = stale.json()["error"]["message"]
        assert "missing" in message and "'v-http'" in message, message
    finally:
        reply = requests.post(base + "/update_weight_version", json={"new_version": "default"})
        assert reply.status_code == 200, reply.text
    choice = post(server_a, "/v1/completions", body)["choices"][0]
    check_choice(model_a, choice["prompt_token_ids"], choice)


def test_aborted_request_keeps_published_blocks(server_a: RunningServer, model_a: Path) -> None:
    """Abort mid-generation (client disconnects): vLLM stops the request (nothing runs any
    more, and it generated far fewer than its max_tokens), then the same prompt hits the
    cache and the store: the blocks published before the abort serve the new request's
    prefix (one store read per cached block, on the store's counters)."""

    def scrape() -> dict[str, float]:
        """vLLM's and our /metrics samples, summed over their labels but finished_reason."""
        text = requests.get(server_a.base_url + "/metrics", timeout=60).text
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                reason = sample.labels.get("finished_reason")
                name = sample.name if reason is None else f"{sample.name}[{reason}]"
                totals[name] = totals.get(name, 0.0) + sample.value
        return totals

    prompt = " ".join(f"Abort test sentence number {i}." for i in range(30))
    max_tokens = 400
    stream_body: dict[str, Any] = {
        "model": str(model_a),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    before = scrape()
    with requests.post(
        server_a.base_url + "/v1/completions", json=stream_body, stream=True, timeout=300
    ) as reply:
        assert reply.status_code == 200
        chunks = 0
        for line in reply.iter_lines():
            chunks += bool(line)
            if chunks >= 3:
                break  # closing the connection aborts the request in vLLM
    deadline = time.monotonic() + 120
    while (aborted := scrape())["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted["vllm:num_requests_running"] == 0, "the request kept running"
    generated = aborted["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 3 <= generated < max_tokens / 2, f"not aborted: {generated} tokens generated"
    # Nor did it finish otherwise (vLLM 0.32 counts no finish reason for a request whose
    # client went away).
    finished = {
        reason: aborted.get(f"vllm:request_success_total[{reason}]", 0.0)
        - before.get(f"vllm:request_success_total[{reason}]", 0.0)
        for reason in ("stop", "length", "error")
    }
    assert not any(finished.values()), finished

    result = post(server_a, "/v1/completions", greedy_body(model_a, 5, prompt=prompt))
    cached = (result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached is not None and cached >= 32, result["usage"]
    choice = result["choices"][0]
    check_choice(model_a, choice["prompt_token_ids"], choice)
    read = scrape()["vllm_artifact_read_objects_total"]
    read -= aborted["vllm_artifact_read_objects_total"]
    assert read == cached // 32, f"{read} objects read from the store for {cached} cached tokens"


def test_corrupt_store_fails_one_request_with_a_clear_http_error(
    server_a: RunningServer, model_a: Path, store_root: Path
) -> None:
    """Runs last in this module: it corrupts every object of server_a's store."""
    prompt = " ".join(f"Corruption test sentence {i}." for i in range(30))
    body = {"model": str(model_a), "prompt": prompt, "max_tokens": 4, "temperature": 0}
    post(server_a, "/v1/completions", body)
    flip_in_every_slot(store_root, where="payload")
    reply = requests.post(server_a.base_url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 500, reply.text
    message = reply.json()["error"]["message"]
    assert "R3 (routed experts)" in message and "corrupt" in message, message
    # Other requests are served as before: the engine is up.
    fresh = {
        **body,
        "prompt": "A new prompt that shares no cached prefix.",
        "return_token_ids": True,
    }
    choice = post(server_a, "/v1/completions", fresh)["choices"][0]
    check_choice(model_a, choice["prompt_token_ids"], choice)


def test_rl_rollout_example_against_the_server(server_a: RunningServer, model_a: Path) -> None:
    """examples/rl_rollout.py: a batch through the async openai client, R3 decoded and checked."""
    path = Path(__file__).resolve().parents[2] / "examples" / "rl_rollout.py"
    spec = importlib.util.spec_from_file_location("rl_rollout", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up
    spec.loader.exec_module(example)
    for keys in (False, True):  # the array path, then the keys path (same node)
        rollouts = asyncio.run(
            example.main_async(server_a.base_url + "/v1", str(model_a), 8, keys=keys)
        )
        assert len(rollouts) == len(example.PROMPTS)
        assert all(item.r3.experts.shape[1:] == (4, 2) for item in rollouts)


def test_prometheus_metrics_on_vllms_metrics_endpoint(
    server_a: RunningServer, model_a: Path, store_root: Path
) -> None:
    """Store gauges, counters and latency histograms, and requests failed closed, on vLLM's
    own /metrics, from requests of this test alone (any order): a prefix hit read from the
    store, and a request that fails closed on an object of its own prompt made corrupt. The
    store gauges agree with the store as a separate reader sees it."""
    from vllm_artifact_testing.store_faults import flip_objects

    from vllm_artifact.core.handoff import R3Keys
    from vllm_artifact.core.store import ShmStore

    def scrape() -> dict[tuple[str, str], float]:
        """Samples by (name, the ``reason`` or ``le`` label); one store under server_a's root."""
        text = requests.get(server_a.base_url + "/metrics", timeout=60).text
        found: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                label = sample.labels.get("reason") or sample.labels.get("how")
                key = (sample.name, label or sample.labels.get("le", ""))
                if sample.name.startswith("vllm_artifact_"):
                    assert key not in found, f"two samples for {key}"
                found[key] = sample.value
        return found

    prompt = " ".join(f"Prometheus metrics sentence {i} of this test alone." for i in range(24))
    body = greedy_body(model_a, 4, prompt=prompt)
    before = scrape()
    post(server_a, "/v1/completions", body)  # published
    hit = post(server_a, "/v1/completions", {**body, **KEYS_XARGS})  # prefix hit, keys
    cached = (hit["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached and cached >= 32, hit["usage"]
    served = scrape()

    def delta(name: str, label: str = "", start: dict[tuple[str, str], float] = before) -> float:
        return served.get((name, label), 0.0) - start.get((name, label), 0.0)

    assert delta("vllm_artifact_read_objects_total") == cached // 32
    assert delta("vllm_artifact_read_seconds_count") >= 1
    assert delta("vllm_artifact_read_seconds_bucket", "+Inf") >= 1
    assert delta("vllm_artifact_published_objects_total") > 0
    assert delta("vllm_artifact_publish_seconds_count") > 0
    assert delta("vllm_artifact_frontend_files_total", "copied") == 1  # the first: no hit

    # The same prompt asking for rows: a prefix hit's first rows arrive as their file.
    start = served
    again = post(server_a, "/v1/completions", body)
    check_choice(model_a, again["choices"][0]["prompt_token_ids"], again["choices"][0])
    served = scrape()
    assert delta("vllm_artifact_frontend_files_total", "adopted", start) == 1
    assert delta("vllm_artifact_frontend_files_total", "copied", start) == 0

    # Make this prompt's objects corrupt: its next request fails closed, counted by reason.
    keys, _, _ = R3Keys.from_json(hit["choices"][0]["routed_experts"]).object_keys()
    assert flip_objects(store_root, keys) == len(keys)
    reply = requests.post(server_a.base_url + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 500 and "corrupt" in reply.json()["error"]["message"], reply.text
    served = scrape()
    assert delta("vllm_artifact_failed_requests_total", "corrupt") == 1

    # Store gauges, against the store as a separate reader sees it once publications settle.
    (name,) = [p.name for p in store_root.iterdir() if p.name.startswith("r3-")]
    arena = store_root / name / "arena"
    deadline = time.monotonic() + 30
    while True:
        with ShmStore.open_reader(str(store_root), name) as reader:
            store = reader.stats()
        served = scrape()
        objects = served[("vllm_artifact_store_objects", "")]
        if objects == store.objects or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert objects == store.objects > 0
    assert served[("vllm_artifact_store_bytes", "")] == store.bytes_used == objects * 256
    assert served[("vllm_artifact_store_capacity_bytes", "")] == arena.stat().st_size
    # Pins follow the KV cache, which still holds this test's blocks; far from full (auto
    # capacity is twice the KV cache), so the store has evicted nothing.
    assert 0 < served[("vllm_artifact_store_pinned_objects", "")] <= objects
    assert objects < store.capacity_objects
    assert served[("vllm_artifact_store_evictions_total", "")] == 0
