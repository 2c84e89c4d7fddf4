"""A null worker for router benchmarks: the real worker protocol, instant replies, no model.

    python -m prefixpool.testing.null_worker [--etcd-endpoints H:P --node-id ID] [--port 0]

Serves POST /generate (router/contract/worker_api: one Token, then Done) and, for
routers that speak OpenAI to their workers (sglang-router), POST /v1/completions
plus the health and info endpoints they poll. With --etcd-endpoints it registers
under a lease like a real worker, so `prefixpool router` finds it. Prints
`READY <url>` once serving. Worker noise is out: what a client measures through a
router minus what it measures here directly is the router.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket

import msgspec
from aiohttp import web

from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.membership import Membership, NodeRecord
from prefixpool.deploy.processes import announce_ready
from prefixpool.contract.worker_api import Done, Token, Usage, decode_request, encode_event


def _usage(num_prompt: int) -> Usage:
    return Usage(prompt_tokens=num_prompt, completion_tokens=1, local_hit_tokens=num_prompt - 1, fetched_tokens=0,
                 computed_tokens=1, fetched_bytes=0, ttft_s=0.0)


async def generate(request: web.Request) -> web.Response:
    body = decode_request(await request.read(), request.content_type)
    events = encode_event(Token(65)) + encode_event(Done("length", _usage(body.num_tokens)))
    return web.Response(body=events, content_type="application/x-ndjson")


async def completions(request: web.Request) -> web.Response:
    body = msgspec.json.decode(await request.read())
    prompt = body.get("prompt", "")
    answer = {"id": "cmpl-null", "object": "text_completion", "created": 0, "model": body.get("model", "tiny"),
              "choices": [{"index": 0, "text": "A", "finish_reason": "length", "logprobs": None}],
              "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1}}
    return web.Response(body=msgspec.json.encode(answer), content_type="application/json")


async def info(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True,
                              "data": [{"id": "tiny", "object": "model"}]})


async def serve(args: argparse.Namespace) -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes([web.post("/generate", generate), web.post("/v1/completions", completions),
                    *[web.get(path, info) for path in ("/health", "/healthz", "/v1/models", "/get_model_info",
                                                        "/get_server_info", "/load")]])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    membership = None
    if args.etcd_endpoints:
        record = NodeRecord(args.node_id, url, "tcp://127.0.0.1:1", 16, 1 << 20, "tiny")
        membership = Membership(EtcdClient(args.etcd_endpoints), Layout(args.cluster), record)
        await membership.start()
    announce_ready(url)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    if membership is not None:
        await membership.stop()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--etcd-endpoints", default="")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--node-id", default="null-0")
    import uvloop

    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
