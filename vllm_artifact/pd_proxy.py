"""A minimal prefill/decode proxy for one prefill and one decode ``vllm serve`` on one node.

For trying disaggregated serving with R3 (docs/user-guide.md, "Disaggregated serving") and for
the end-to-end tests; a fleet uses its own router. Every completion or chat request goes
first to the prefill server with ``max_tokens=1`` and ``kv_transfer_params``
``{"do_remote_decode": true}`` (the prefill computes the prompt's KV, which its KV connector
saves, and its R3, which its store publishes), then unchanged to the decode server with the
``kv_transfer_params`` the prefill returned (if any). The decode server's answer, streamed or
not, is the client's: its R3 covers prompt and completion. Other paths go to the decode server.

    python -m vllm_artifact.pd_proxy --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000

Uses aiohttp, a dependency of vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["main", "make_app"]

logger = logging.getLogger("vllm_artifact.pd_proxy")

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "host"})


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill request: one token, not streamed, asking the KV connector to keep the KV."""
    prefill = {**body, "max_tokens": 1, "stream": False}
    prefill.pop("stream_options", None)
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    return prefill


def decode_body(body: dict[str, Any], prefill_reply: dict[str, Any]) -> dict[str, Any]:
    """The decode request: the client's, with the prefill's ``kv_transfer_params``."""
    decode = dict(body)
    params = prefill_reply.get("kv_transfer_params")
    if params:
        decode["kv_transfer_params"] = params
    return decode


def make_app(prefill_url: str, decode_url: str) -> web.Application:
    """The proxy as an aiohttp application."""
    app = web.Application(client_max_size=1 << 30)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(app: web.Application) -> None:
        await app[session_key].close()

    async def generate(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "the request body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the request body is not an object"}, status=400)
        session = app[session_key]
        async with session.post(prefill_url + request.path, json=prefill_body(body)) as reply:
            if reply.status != 200:  # the prefill's error is the client's answer
                return web.Response(
                    status=reply.status, body=await reply.read(), content_type="application/json"
                )
            prefilled = await reply.json()
        return await relay(request, "POST", decode_url + request.path, decode_body(body, prefilled))

    async def forward(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        return await relay(request, request.method, decode_url + request.path_qs, None, data)

    async def relay(
        request: web.Request,
        method: str,
        url: str,
        body: dict[str, Any] | None,
        data: bytes | None = None,
    ) -> web.StreamResponse:
        session = app[session_key]
        async with session.request(method, url, json=body, data=data) as reply:
            response = web.StreamResponse(
                status=reply.status,
                headers={k: v for k, v in reply.headers.items() if k.lower() not in _HOP_HEADERS},
            )
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    for path in _GENERATION_PATHS:
        app.router.add_post(path, generate)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="base URL of the prefill server")
    parser.add_argument("--decode", required=True, help="base URL of the decode server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    app = make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    web.run_app(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
