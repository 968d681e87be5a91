"""Prefill/decode disaggregation over HTTP: two ``vllm serve`` processes on one node (shared-
storage ``ExampleConnector`` as producer and consumer, one store root) behind the minimal
proxy ``python -m vllm_artifact.pd_proxy``; the decode server's R3 equals the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from vllm_artifact_testing.engine_probe import read_handle_elsewhere
from vllm_artifact_testing.server import RunningServer, free_port, vllm_servers

from vllm_artifact.client import decode_r3
from vllm_artifact.selftest.oracle import assert_routing_matches, hf_router_topk

pytestmark = pytest.mark.engine


def kv_flag(role: str, storage: Path) -> list[str]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def pd_servers(
    model_a: Path, store_root: Path, tmp_path_factory: Any
) -> Iterator[list[RunningServer]]:
    storage = tmp_path_factory.mktemp("pd-serve-kv")
    common = ["--enable-routed-experts", "--artifact-root", str(store_root / "pd-serve")]
    common += ["--enable-prompt-tokens-details"]
    specs = [
        (model_a, [*common, *kv_flag("kv_producer", storage)]),
        (model_a, [*common, *kv_flag("kv_consumer", storage)]),
    ]
    with vllm_servers(specs) as started:
        yield started


@pytest.fixture(scope="module")
def proxy(pd_servers: list[RunningServer], tmp_path_factory: Any) -> Iterator[str]:
    """``python -m vllm_artifact.pd_proxy`` in front of the pair; yields its base URL."""
    prefill, decode = pd_servers
    port = free_port()
    log = tmp_path_factory.mktemp("pd-proxy") / "proxy.log"
    command = [sys.executable, "-m", "vllm_artifact.pd_proxy", "--port", str(port)]
    command += ["--prefill", prefill.base_url, "--decode", decode.base_url]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(base + "/health", timeout=5)
                break
            except requests.ConnectionError:
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)


def completion(base: str, model: Path, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    reply = requests.post(base + "/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def assert_oracle(model: Path, choice: dict[str, Any], experts: np.ndarray) -> None:
    executed = choice["prompt_token_ids"] + choice["token_ids"][:-1]
    assert experts.shape[0] == len(executed)
    assert_routing_matches(experts, hf_router_topk(model, executed))


PROMPT = " ".join(f"Served disaggregated line {i} prefers expert {i * 3 % 8}." for i in range(14))


def test_decode_server_answers_complete_r3_through_the_proxy(proxy: str, model_a: Path) -> None:
    result = completion(proxy, model_a, PROMPT)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "length", choice
    # The decode server's prompt came from the KV connector: its R3 from the prefill's store.
    cached = (result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached is not None and cached >= 32, result["usage"]
    assert_oracle(model_a, choice, decode_r3(choice).experts)


def test_keys_path_through_the_proxy_read_by_another_process(proxy: str, model_a: Path) -> None:
    prompt = PROMPT.replace("line", "keys line")
    arrays = completion(proxy, model_a, prompt)["choices"][0]
    keys = completion(proxy, model_a, prompt, vllm_xargs={"routed_experts_format": "keys"})
    handle = keys["choices"][0]["routed_experts"]
    read = read_handle_elsewhere(handle if isinstance(handle, str) else json.dumps(handle))
    np.testing.assert_array_equal(read, decode_r3(arrays).experts)
    assert_oracle(model_a, arrays, read)


def test_chat_through_the_proxy(proxy: str, model_a: Path) -> None:
    body = {
        "model": str(model_a),
        "messages": [{"role": "user", "content": PROMPT.replace("line", "chat line")}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = requests.post(proxy + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    choice = result["choices"][0]
    cached = (result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert cached is not None and cached >= 32, result["usage"]
    assert_oracle(
        model_a,
        {**choice, "prompt_token_ids": result["prompt_token_ids"]},
        decode_r3(choice).experts,
    )


def test_a_bad_request_through_the_proxy_is_the_servers_4xx(proxy: str, model_a: Path) -> None:
    reply = requests.post(
        proxy + "/v1/completions",
        json={"model": str(model_a), "prompt": "x", "vllm_xargs": {"routed_experts_format": 3}},
        timeout=60,
    )
    assert reply.status_code == 400 and "must be one of 'array', 'keys'" in reply.text
