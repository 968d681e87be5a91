"""An RL-style rollout client: a batch of prompts through the async ``openai`` client, with the
routed experts (R3) of every completion decoded and checked, as a trainer would receive them.

Needs only ``openai`` and ``vllm-artifact``'s client (numpy, pybase64; no vLLM, no torch).
Against README command 1's server (``scripts/demo.sh --keep-serving`` prints both values)::

    .venv/bin/python examples/rl_rollout.py --base-url http://127.0.0.1:PORT/v1 --model MODEL

Each completion asks for the token ids it executed (``return_token_ids``, a vLLM extension),
so the number of R3 rows can be checked: one per executed token, i.e. prompt + generated - 1.

``--keys`` takes the keys path instead (trainer on the server's node, same user): each response
carries a small handle, and ``decode_r3`` reads the rows from the server's ``/dev/shm`` store.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass

import numpy as np
from openai import AsyncOpenAI

from vllm_artifact.client import RoutedExperts, decode_r3

PROMPTS = [
    "Solve: 12 + 30 =",
    "Write a haiku about routers.",
    "The capital of France is",
    "def fibonacci(n):",
    "Mixture-of-experts models send each token to",
    "Reinforcement learning from rollouts needs",
    "Once upon a time, a token met an expert",
    "List three prime numbers:",
]


@dataclass
class Rollout:
    prompt: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    r3: RoutedExperts


async def rollout(
    client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, keys: bool
) -> Rollout:
    extra: dict[str, object] = {"return_token_ids": True}
    if keys:  # R3 as store keys: read from /dev/shm below instead of decoded from the response
        extra["vllm_xargs"] = {"routed_experts_format": "keys"}
    completion = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=1.0, extra_body=extra
    )
    choice = completion.choices[0]
    usage = completion.usage
    assert usage is not None
    return Rollout(
        prompt, choice.text, usage.prompt_tokens, usage.completion_tokens, decode_r3(choice)
    )


def check(rollouts: list[Rollout]) -> None:
    """What a trainer should assert before replaying routes."""
    first = rollouts[0].r3
    for item in rollouts:
        experts = item.r3.experts
        assert experts.shape[0] == item.prompt_tokens + item.completion_tokens - 1, (
            f"{item.prompt!r}: {experts.shape[0]} R3 rows for {item.prompt_tokens} prompt + "
            f"{item.completion_tokens} generated tokens"
        )
        assert experts.shape[1:] == first.experts.shape[1:] and experts.dtype == first.experts.dtype
        assert item.r3.dense_layers == first.dense_layers
        moe = experts[:, list(item.r3.moe_layers), :]
        # A token's top-k experts are distinct in every MoE layer.
        assert (np.diff(np.sort(moe, axis=-1), axis=-1) > 0).all()


async def main_async(
    base_url: str, model: str, max_tokens: int, keys: bool = False
) -> list[Rollout]:
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    try:
        rollouts = await asyncio.gather(
            *(rollout(client, model, p, max_tokens, keys) for p in PROMPTS)
        )
    finally:
        await client.close()
    check(list(rollouts))
    return list(rollouts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the served model name or path")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--keys", action="store_true", help="read R3 from the server's /dev/shm store (same node)"
    )
    args = parser.parse_args()
    rollouts = asyncio.run(main_async(args.base_url, args.model, args.max_tokens, args.keys))
    r3 = rollouts[0].r3
    print(
        f"{len(rollouts)} rollouts; R3 per token: {r3.experts.shape[1]} layers x top-"
        f"{r3.experts.shape[2]} ({r3.experts.dtype}); dense layers: {list(r3.dense_layers)}"
    )
    for item in rollouts:
        print(f"  {item.r3.experts.shape[0]:4d} rows  {item.prompt!r} -> {item.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
