"""The worker's internal HTTP API, called by routers: /generate (NDJSON stream), /load, /healthz,
and /debug/pool (pool integrity and pins, for chaos tests and operators), and POST / DELETE
/admin/pin (pin a prefix by tokens or text for a TTL, or release it).

With a shared token configured, every request but /healthz must carry it.
Draining (prefixpool/contract/drain.py): a new /generate gets a 503 the router retries
elsewhere and /healthz answers 503; admitted streams run on, and one still running
at the drain deadline ends with a Failed event, never a truncated body.
Knows nothing of engines or etcd: it serves a Worker.
"""

from __future__ import annotations

import contextlib
import hmac
import logging

import msgspec
from aiohttp import web

from prefixpool.worker.service import PinRefused, Worker
from prefixpool.contract.drain import Drain, DrainDeadline, Draining
from prefixpool.model.tokenizer import ByteTokenizer, Tokenizer
from prefixpool.contract.worker_api import AUTH_HEADER, Failed, PinReply, PinRequest, decode_request, encode, encode_event
from prefixpool.transfer.faults import num_corrupted
from prefixpool.transfer.source import BlockSource

log = logging.getLogger(__name__)
WORKER_KEY: web.AppKey[Worker] = web.AppKey("worker", Worker)
TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)
DRAIN_KEY: web.AppKey[Drain] = web.AppKey("drain", Drain)
SOURCE_KEY: web.AppKey[BlockSource | None] = web.AppKey("source", BlockSource)
TOKENIZER_KEY: web.AppKey[Tokenizer] = web.AppKey("tokenizer", object)
_pin_decoder = msgspec.json.Decoder(PinRequest)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status)


@web.middleware
async def require_token(request: web.Request, handler) -> web.StreamResponse:
    token = request.app[TOKEN_KEY]
    if token and request.path != "/healthz" and not hmac.compare_digest(request.headers.get(AUTH_HEADER, ""), token):
        return _error(401, "missing or wrong worker token")
    return await handler(request)


async def generate(request: web.Request) -> web.StreamResponse:
    drain = request.app[DRAIN_KEY]
    try:
        async with drain.admitted():
            return await _generate(request, drain)
    except Draining as err:
        response = _error(503, f"worker is shutting down: {err}")
        response.force_close()  # the router drops this connection instead of reusing it
        return response


async def _generate(request: web.Request, drain: Drain) -> web.StreamResponse:
    try:
        body = decode_request(await request.read(), request.content_type)
    except msgspec.DecodeError as err:
        return _error(400, f"bad generate request: {err}")
    if not body.tokens:
        return _error(400, "tokens must be non-empty")
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        # aclosing: a router that goes away releases the request's blocks now, not at garbage collection
        async with drain.until_deadline(), contextlib.aclosing(request.app[WORKER_KEY].generate(body)) as events:
            async for event in events:
                await response.write(encode_event(event))
    except (ConnectionResetError, ConnectionError):
        log.info("router went away from %s", body.request_id)
        raise
    except DrainDeadline as err:  # the request's blocks are released; the router sees a clean error
        log.warning("generate %s cut by the drain: %s", body.request_id, err)
        await response.write(encode_event(Failed(f"worker shutting down: {err}", 503)))
    except Exception as err:  # the stream has started: end it with an error event, not a broken socket
        log.exception("generate %s failed", body.request_id)
        await response.write(encode_event(Failed(f"worker error: {err}", 500)))
    await response.write_eof()
    return response


async def _pin_request(request: web.Request) -> tuple[PinRequest, list[int]] | web.Response:
    try:
        body = _pin_decoder.decode(await request.read())
    except msgspec.DecodeError as err:
        return _error(400, f"bad pin request: {err}")
    tokens = body.tokens or (request.app[TOKENIZER_KEY].encode(body.text) if body.text else [])
    if not tokens and not body.name:
        return _error(400, "give the prefix as tokens or text (or, to unpin, its name)")
    return body, tokens


async def pin(request: web.Request) -> web.Response:
    parsed = await _pin_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    body, tokens = parsed
    if body.ttl_s <= 0:
        return _error(400, "ttl_s must be positive")
    try:
        reply = request.app[WORKER_KEY].pin(tokens, body.cache_salt, body.ttl_s, body.name)
    except PinRefused as err:
        return _error(400, str(err))
    return web.Response(body=encode(PinReply(**reply)), content_type="application/json")


async def unpin(request: web.Request) -> web.Response:
    parsed = await _pin_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    body, tokens = parsed
    name = request.app[WORKER_KEY].unpin(body.name, tokens, body.cache_salt)
    reply = PinReply(name=name or body.name, num_blocks=0, num_held=0, unpinned=bool(name))
    return web.Response(body=encode(reply), content_type="application/json")


async def load(request: web.Request) -> web.Response:
    return web.Response(body=encode(request.app[WORKER_KEY].load()), content_type="application/json")


async def debug_pool(request: web.Request) -> web.Response:
    report = request.app[WORKER_KEY].pool_report()
    report["corrupted_blocks_sent"] = num_corrupted(request.app[SOURCE_KEY])
    return web.json_response(report)


async def healthz(request: web.Request) -> web.Response:
    serving = request.app[DRAIN_KEY].serving
    return web.json_response({"status": "ok" if serving else "stopping"}, status=200 if serving else 503)


def build_app(worker: Worker, token: str = "", tokenizer: Tokenizer | None = None,
              source: BlockSource | None = None, drain: Drain | None = None) -> web.Application:
    app = web.Application(middlewares=[require_token], client_max_size=64 * 1024 * 1024)
    app[WORKER_KEY] = worker
    app[TOKEN_KEY] = token
    app[DRAIN_KEY] = drain or Drain()
    app[SOURCE_KEY] = source
    app[TOKENIZER_KEY] = tokenizer or ByteTokenizer()
    app.add_routes([web.post("/generate", generate), web.get("/load", load), web.get("/healthz", healthz),
                    web.get("/debug/pool", debug_pool), web.post("/admin/pin", pin), web.delete("/admin/pin", unpin)])
    return app
