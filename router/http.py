"""The router's HTTP surface (aiohttp): OpenAI endpoints, /v1/route, /v1/admin/pin, health and metrics.

Handlers translate between HTTP and the Router service; every APIError (and
aiohttp's own 4xx) leaves as OpenAI-style error JSON. Knows nothing of etcd,
policies or how workers are reached.
"""

from __future__ import annotations

import contextlib
import logging

import msgspec
from aiohttp import web

from router import openai_format as fmt
from router.admin_pin import decode_pin, forward_pin
from router.detokenizer import Detokenizer
from router.errors import APIError, InternalError, InvalidRequest, RouteNotFound
from router.openai_schema import ChatBody, CompletionBody, RouteBody, decode
from router.service import Prepared, Router
from router.contract.worker_api import Done, Failed, Token

log = logging.getLogger(__name__)
ROUTER_KEY: web.AppKey["Router"] = web.AppKey("router", Router)
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
        api = RouteNotFound(f"{request.method} {request.path}: {err.reason}") if err.status == 404 else InvalidRequest(err.reason)
        api.status = err.status
        return error_response(api)
    except Exception:  # a bug: still answer in the API's error shape, and log it
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(InternalError("internal error; see the router log").body(), status=500)


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
    async with contextlib.aclosing(router.generate(prepared)) as events:  # a client gone frees its worker slot now
        async for event in events:
            if isinstance(event, Token):
                detok.tokens.append(event.token)
            elif isinstance(event, Done):
                shape = fmt.chat if prepared.chat else fmt.completion
                return json_response(shape(prepared.request_id, prepared.model, detok.text, event.finish_reason,
                                               event.usage))
            elif isinstance(event, Failed):
                raise router.failure(event)
    raise router.failure(Failed("the worker ended the stream without finishing", 502))


async def _serve_stream(request: web.Request, router: Router, prepared: Prepared) -> web.StreamResponse:
    async with contextlib.aclosing(router.generate(prepared)) as events:
        first = await anext(events)  # routing errors still become a normal error response here
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        detok = Detokenizer(router.tokenizer.decode)
        frames = fmt.StreamFrames(prepared.request_id, prepared.model, prepared.chat)
        if prepared.chat:
            await response.write(frames.first())
        event = first
        while True:
            if isinstance(event, Token):
                text = detok.push(event.token)
                if text:
                    await response.write(frames.text(text))
            elif isinstance(event, Done):
                await response.write(frames.last(detok.flush(), event.finish_reason))
                if prepared.include_usage:
                    await response.write(frames.usage(event.usage))
                break
            elif isinstance(event, Failed):
                await response.write(frames.frame(fmt.error_chunk(event.message, event.status)))
                break
            event = await anext(events, Failed("the worker ended the stream without finishing", 502))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def models(request: web.Request) -> web.Response:
    router = _router(request)
    return json_response({"object": "list", "data": [
        {"id": router.model, "object": "model", "created": 0, "owned_by": "prefixpool"}]})


async def healthz(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    return json_response({"status": "ok", "workers": len(router.live_workers())})


async def readyz(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    workers = len(router.live_workers())
    return json_response({"ready": workers > 0, "workers": workers}, status=200 if workers else 503)


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    router.refresh_gauges()
    return web.Response(body=router.metrics.render(), content_type="text/plain", charset="utf-8")


def build_app(router: Router) -> web.Application:
    app = web.Application(middlewares=[count_requests, errors_as_json], client_max_size=MAX_BODY_BYTES)
    app[ROUTER_KEY] = router
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
