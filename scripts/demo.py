"""Serve the tiny MoE model with ``--enable-routed-experts`` and show one decoded R3 array."""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any

import numpy as np
import requests
from vllm_artifact_testing.server import vllm_server

from vllm_artifact.client import RoutedExperts, decode_r3
from vllm_artifact.selftest.tiny_models import ensure_tiny_model


def main() -> int:
    keep_serving = "--keep-serving" in sys.argv[1:]
    model = ensure_tiny_model("qwen3-moe-8x2")
    print(f"demo: model {model}")
    print("demo: starting `vllm serve --enable-routed-experts` on 127.0.0.1 (~30-60 s)...")
    with vllm_server(model, ["--enable-routed-experts"]) as server:
        reply = requests.post(
            server.base_url + "/v1/completions",
            json={
                "model": str(model),
                "prompt": "The router sends every token to its experts",
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=300,
        )
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        usage = reply.json()["usage"]
        decoded = decode_r3(choice)
        if keep_serving:
            show(decoded, choice, usage)
            print(
                f"demo: serving until Ctrl-C; try\n  .venv/bin/python examples/rl_rollout.py "
                f"--base-url {server.base_url}/v1 --model {model}"
            )
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
            print("demo: server stopped")
            return 0
    print("demo: server stopped")
    return show(decoded, choice, usage)


def show(decoded: RoutedExperts, choice: dict[str, Any], usage: dict[str, Any]) -> int:
    """Print the decoded array; 0 if it has one row per executed token."""
    experts = decoded.experts
    expected_rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    np.set_printoptions(linewidth=120)
    print(f"demo: completion text: {choice['text']!r}")
    print(
        f"demo: routed_experts shape={experts.shape} dtype={experts.dtype} "
        f"(tokens={expected_rows} = prompt {usage['prompt_tokens']} + generated "
        f"{usage['completion_tokens']} - 1, layers, top_k); dense layers: "
        f"{list(decoded.dense_layers) or 'none'}"
    )
    print("demo: first rows [token][layer] -> expert IDs:")
    print(experts[:4])
    return 0 if experts.shape[0] == expected_rows else 1


if __name__ == "__main__":
    sys.exit(main())
