"""On the GPU machine: R3 from a running ``vllm serve --enable-routed-experts`` of the
self-test's tiny model, through the official ``openai`` client (completions batch, chat, the
keys path), every row compared with the transformers oracle. Exit 0 only if all agree.

    python3 tools/gpu/serve_check.py http://127.0.0.1:PORT MODEL_DIR
"""

from __future__ import annotations

import sys
from typing import Any

from openai import OpenAI

from vllm_artifact.client import decode_r3
from vllm_artifact.selftest.oracle import hf_router_topk, routing_agreement

PROMPTS = [
    " ".join(f"Served sentence {i} goes to expert {i % 16}." for i in range(20)),
    "A short prompt over HTTP.",
]


def check(name: str, model: str, prompt_ids: list[int], choice: Any) -> bool:
    executed = list(prompt_ids) + list(choice.token_ids)[:-1]
    found = routing_agreement(decode_r3(choice).experts, hf_router_topk(model, executed))
    status = "PASS" if found.ok else "FAIL"
    print(f"{name:<36} {found.equal:>6}/{found.rows:<6} {status}  {found.first_problem or ''}")
    return found.ok


def main(url: str, model: str) -> int:
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    greedy: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True}
    ok = []
    batch = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=8, temperature=0, extra_body=greedy
    )
    for i, choice in enumerate(batch.choices):
        ok.append(check(f"completions, prompt {i}", model, choice.prompt_token_ids, choice))
    again = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body=greedy
    )
    cached = (again.usage.prompt_tokens_details or {}) if again.usage else {}
    print(f"repeated prompt: cached tokens {getattr(cached, 'cached_tokens', cached)}")
    ok.append(
        check("completions, prefix hit", model, again.choices[0].prompt_token_ids, again.choices[0])
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "R3 over chat, please."}],
        max_tokens=6,
        temperature=0,
        extra_body=greedy,
    )
    ok.append(check("chat", model, chat.prompt_token_ids, chat.choices[0]))
    keys = client.completions.create(
        model=model,
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=0,
        extra_body={**greedy, "vllm_xargs": {"routed_experts_format": "keys"}},
    )
    ok.append(
        check("completions, keys path", model, keys.choices[0].prompt_token_ids, keys.choices[0])
    )
    print("PASS" if all(ok) else "FAIL")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
