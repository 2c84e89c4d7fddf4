"""The worker's internal HTTP API, called by routers: /generate (NDJSON stream), /load, /healthz,
and /debug/pool (pool integrity and pins, for chaos tests and operators), and POST / DELETE
/admin/pin (pin a prefix by tokens or text for a TTL, or release it).

Every request is checked whole before it is admitted (prefixpool/contract/worker_api.py, against
this worker's RequestLimits): a bad one gets a 4xx error JSON (the OpenAI shape) before any stream
starts, never a 200 followed by a failure.
With a shared token configured, every request but /healthz must carry it.
Draining (prefixpool/contract/drain.py): a new /generate gets a 503 the router retries
elsewhere and /healthz answers 503; admitted streams run on, and one still running
at the drain deadline ends with a Failed event, never a truncated body.
Knows nothing of engines or etcd: it serves a Worker (whose model config it reads once, for the limits).
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
from prefixpool.contract.worker_api import (AUTH_HEADER, Failed, PinReply, PinRequest, RequestLimits, RequestRefused,
                                            check_token_ids, decode_request, encode, encode_event)
from prefixpool.node.faults import num_corrupted
from prefixpool.transfer.source import BlockSource

log = logging.getLogger(__name__)
WORKER_KEY: web.AppKey[Worker] = web.AppKey("worker", Worker)
TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)
DRAIN_KEY: web.AppKey[Drain] = web.AppKey("drain", Drain)
SOURCE_KEY: web.AppKey[BlockSource | None] = web.AppKey("source", BlockSource)
TOKENIZER_KEY: web.AppKey[Tokenizer] = web.AppKey("tokenizer", object)
LIMITS_KEY: web.AppKey[RequestLimits] = web.AppKey("limits", RequestLimits)
_pin_decoder = msgspec.json.Decoder(PinRequest)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": status}
    return web.json_response({"error": error}, status=status)


async def _read(request: web.Request) -> bytes | web.Response:
    """The body, or a 413 error JSON past client_max_size (aiohttp's own answer is plain text)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as err:
        return _error(413, f"request body too large: {err.text}")


def limits_of(worker: Worker) -> RequestLimits:
    """What this worker's model and pool can serve."""
    config = worker.engine.model.config
    return RequestLimits(vocab_size=config.vocab_size, max_model_len=config.max_position,
                         block_size=worker.namespace.block_size, num_blocks=worker.blocks.num_blocks)


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
    raw = await _read(request)
    if isinstance(raw, web.Response):
        return raw
    try:
        body = decode_request(raw, request.content_type, request.app[LIMITS_KEY])
    except msgspec.DecodeError as err:
        return _error(400, f"bad generate request: {err}")
    except RequestRefused as err:
        return _error(400, f"unservable generate request: {err}", err.param)
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
        log.exception("generate %s failed", body.request_id)  # the traceback stays in this log
        await response.write(encode_event(Failed(f"worker error: {type(err).__name__}", 500)))
    await response.write_eof()
    return response


async def _pin_request(request: web.Request) -> tuple[PinRequest, list[int]] | web.Response:
    raw = await _read(request)
    if isinstance(raw, web.Response):
        return raw
    try:
        body = _pin_decoder.decode(raw)
    except msgspec.DecodeError as err:
        return _error(400, f"bad pin request: {err}")
    tokens = body.tokens or (request.app[TOKENIZER_KEY].encode(body.text) if body.text else [])
    if not tokens and not body.name:
        return _error(400, "give the prefix as tokens or text (or, to unpin, its name)")
    limits = request.app[LIMITS_KEY]
    if len(tokens) > limits.max_model_len:
        return _error(400, f"the prefix has {len(tokens)} tokens, the model {limits.max_model_len} positions", "tokens")
    try:
        check_token_ids(tokens, limits, "tokens")
    except RequestRefused as err:
        return _error(400, str(err), err.param)
    return body, tokens


async def pin(request: web.Request) -> web.Response:
    parsed = await _pin_request(request)
    if isinstance(parsed, web.Response):
        return parsed
    body, tokens = parsed
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


def build_app(worker: Worker, token: str = "", tokenizer: Tokenizer | None = None, source: BlockSource | None = None,
              drain: Drain | None = None, limits: RequestLimits | None = None) -> web.Application:
    app = web.Application(middlewares=[require_token], client_max_size=64 * 1024 * 1024)
    app[WORKER_KEY] = worker
    app[TOKEN_KEY] = token
    app[DRAIN_KEY] = drain or Drain()
    app[SOURCE_KEY] = source
    app[TOKENIZER_KEY] = tokenizer or ByteTokenizer()
    app[LIMITS_KEY] = limits or limits_of(worker)
    app.add_routes([web.post("/generate", generate), web.get("/load", load), web.get("/healthz", healthz),
                    web.get("/debug/pool", debug_pool), web.post("/admin/pin", pin), web.delete("/admin/pin", unpin)])
    return app
