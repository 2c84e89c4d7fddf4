"""The router's HTTP surface (aiohttp): OpenAI endpoints, /v1/route, /v1/admin/pin, health and metrics.

Handlers translate between HTTP and the Router service; every APIError (and
aiohttp's own 4xx) leaves as OpenAI-style error JSON. Draining
(prefixpool/contract/drain.py): /readyz answers 503 and a new completion a 503
`router_draining`; admitted requests finish, and a stream still running at the
drain deadline ends with an error event. Knows nothing of etcd, policies or how
workers are reached.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

import msgspec
from aiohttp import web

from prefixpool.router import openai_format as fmt
from prefixpool.router.admin_pin import decode_pin, forward_pin
from prefixpool.router.detokenizer import Detokenizer
from prefixpool.router.openai_logprobs import LogprobsShape
from prefixpool.router.errors import APIError, InternalError, InvalidRequest, RouteNotFound, ServiceUnavailable
from prefixpool.contract.drain import Drain, DrainDeadline, Draining
from prefixpool.router.openai_schema import ChatBody, CompletionBody, RouteBody, decode
from prefixpool.router.served_models import listing
from prefixpool.router.service import Prepared, Router
from prefixpool.contract.worker_api import Done, Event, Failed, Token

log = logging.getLogger(__name__)
ROUTER_KEY: web.AppKey["Router"] = web.AppKey("router", Router)
DRAIN_KEY: web.AppKey[Drain] = web.AppKey("drain", Drain)
ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_BODY_BYTES = 32 * 1024 * 1024


def json_response(payload: object, status: int = 200) -> web.Response:
    """JSON encoded by msgspec (C), not the json module."""
    return web.Response(body=msgspec.json.encode(payload), status=status, content_type="application/json")


def error_response(err: APIError) -> web.Response:
    return json_response(err.body(), status=err.status)


@web.middleware
async def count_requests(request: web.Request, handler) -> web.StreamResponse:
    response = await handler(request)
    request.app[ROUTER_KEY].metrics.requests.labels(request.path, str(response.status)).inc()
    return response


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        api = (RouteNotFound(f"{request.method} {request.path}: {err.reason}") if err.status == 404
               else InvalidRequest(err.reason))
        api.status = err.status
        return error_response(api)
    except Exception:  # a bug: still answer in the API's error shape, and log it
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(InternalError("internal error; see the router log").body(), status=500)


@web.middleware
async def drain_gate(request: web.Request, handler) -> web.StreamResponse:
    """Completions are admitted while serving; once draining they get a 503 a balancer retries elsewhere."""
    if request.path not in ADMITTED_PATHS:
        return await handler(request)
    drain = request.app[DRAIN_KEY]
    try:
        async with drain.admitted():
            response = await handler(request)
    except (Draining, DrainDeadline) as err:
        response = error_response(ServiceUnavailable(f"router shutting down: {err}", code="router_draining"))
    if not drain.serving:
        response.force_close()  # the client's next request opens a connection to a router that serves
    return response


def _router(request: web.Request) -> Router:
    router = request.app[ROUTER_KEY]
    router.check_api_key(request.headers.get("Authorization", ""))
    return router


async def completions(request: web.Request) -> web.StreamResponse:
    router = _router(request)
    prepared = router.prepare(decode(await request.read(), CompletionBody))
    return await _serve(request, router, prepared)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    router = _router(request)
    prepared = router.prepare(decode(await request.read(), ChatBody))
    return await _serve(request, router, prepared)


async def route(request: web.Request) -> web.Response:
    router = _router(request)
    prepared = router.prepare(decode(await request.read(), RouteBody))
    return json_response(router.explain(prepared))


async def pin(request: web.Request) -> web.Response:
    router = _router(request)
    return json_response(await forward_pin(router, decode_pin(await request.read()), unpin=False))


async def unpin(request: web.Request) -> web.Response:
    router = _router(request)
    return json_response(await forward_pin(router, decode_pin(await request.read()), unpin=True))


async def _serve(request: web.Request, router: Router, prepared: Prepared) -> web.StreamResponse:
    if prepared.stream:
        return await _serve_stream(request, router, prepared)
    detok = Detokenizer(router.tokenizer.decode)
    logprobs = _logprobs_shape(router, prepared)
    tokens: list[Token] = []  # kept for their logprobs
    drain = request.app[DRAIN_KEY]
    # aclosing: a client gone frees its worker slot now; past the drain deadline drain_gate answers 503
    async with contextlib.aclosing(router.generate(prepared)) as events, drain.until_deadline():
        async for event in events:
            if isinstance(event, Token):
                detok.tokens.append(event.token)
                tokens.append(event)
            elif isinstance(event, Done):
                shape = fmt.chat if prepared.chat else fmt.completion
                return json_response(shape(prepared.request_id, prepared.model, detok.text, event.finish_reason,
                                           event.usage, None if logprobs is None else logprobs.of(tokens)))
            elif isinstance(event, Failed):
                raise router.failure(event)
    raise router.failure(Failed("the worker ended the stream without finishing", 502))


class _EventStream(web.StreamResponse):
    """An SSE answer whose headers leave with its first frame, in one write (aiohttp sends a StreamResponse's
    headers at prepare() unless told otherwise: a packet, and a client wake-up, more before the first token)."""

    _send_headers_immediately = False


async def _serve_stream(request: web.Request, router: Router, prepared: Prepared) -> web.StreamResponse:
    drain = request.app[DRAIN_KEY]
    # made while the worker computes, not between its first token and the client
    response = _EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    detok = Detokenizer(router.tokenizer.decode)
    frames = fmt.StreamFrames(prepared.request_id, prepared.model, prepared.chat)
    opening = frames.first() if prepared.chat else b""  # a chat stream's role frame goes with its first token
    logprobs = _logprobs_shape(router, prepared)
    async with contextlib.aclosing(router.generate(prepared)) as events:
        async with drain.until_deadline():
            first = await anext(events)  # routing errors (and the drain deadline) still become an error response here
        await response.prepare(request)
        try:
            async with drain.until_deadline():
                end = await _relay(prepared, first, events, detok, frames, response, logprobs, opening)
        except DrainDeadline as err:
            end = frames.frame(fmt.error_chunk(f"router shutting down: {err}", 503))
        await response.write_eof(end + b"data: [DONE]\n\n")  # the last frames and the stream's end: one write
        return response


async def _relay(prepared: Prepared, event: Event, events: AsyncIterator[Event], detok: Detokenizer,
                 frames: fmt.StreamFrames, response: web.StreamResponse, logprobs: LogprobsShape | None,
                 opening: bytes) -> bytes:
    """Stream events as SSE frames from `event` on, `opening` before the first, until Done or Failed: a frame
    per token, its text empty while the detokenizer holds back part of a character (vLLM streams one per token
    too). Answers the frames that end the stream (finish and usage, or the error), for the caller to write."""
    while True:
        if isinstance(event, Token):
            # "" while it ends inside a character: still a frame, as vLLM sends (clients time the first token
            # by the first chunk; held back, a split character delayed it by a token)
            text = detok.push(event.token)
            frame = frames.token(text, logprobs.of((event,))) if logprobs is not None else frames.text(text)
            await response.write(opening + frame)
            opening = b""
        elif isinstance(event, Done):
            end = frames.last(detok.flush(), event.finish_reason)
            return opening + (end + frames.usage(event.usage) if prepared.include_usage else end)
        elif isinstance(event, Failed):
            return opening + frames.frame(fmt.error_chunk(event.message, event.status))
        event = await anext(events, Failed("the worker ended the stream without finishing", 502))


def _logprobs_shape(router: Router, prepared: Prepared) -> LogprobsShape | None:
    """The answer's logprobs shaper, or None where they were not asked."""
    if prepared.sampling.logprobs is None:
        return None
    return LogprobsShape(router.token_text, prepared.chat)


async def models(request: web.Request) -> web.Response:
    router = _router(request)
    return json_response({"object": "list", "data": listing(router.model, router.live_workers())})


async def healthz(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return json_response({"status": "ok", "workers": len(router.live_workers())})


async def readyz(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    workers = len(router.live_workers())
    if not request.app[DRAIN_KEY].serving:  # first thing a drain changes: a Service stops sending here
        return json_response({"ready": False, "draining": True, "workers": workers}, status=503)
    return json_response({"ready": workers > 0, "workers": workers}, status=200 if workers else 503)


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    router.refresh_gauges()
    return web.Response(body=router.metrics.render(), content_type="text/plain", charset="utf-8")


def build_app(router: Router, drain: Drain | None = None) -> web.Application:
    app = web.Application(middlewares=[count_requests, errors_as_json, drain_gate], client_max_size=MAX_BODY_BYTES)
    app[ROUTER_KEY] = router
    app[DRAIN_KEY] = drain or Drain()
    app.add_routes([
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/route", route),
        web.post("/v1/admin/pin", pin),
        web.delete("/v1/admin/pin", unpin),
        web.get("/v1/models", models),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
    ])
    return app
