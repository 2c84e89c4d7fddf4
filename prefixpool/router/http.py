"""The router's HTTP surface (prefixpool/net/http1_server.py): OpenAI endpoints, /v1/route, /v1/admin/pin,
health and metrics.

    app = RouterApp(router, drain)    the server's handler: routes by path and method, counts each answer
    Http1Server(app, MAX_BODY_BYTES, errors=app_errors, ...)  (`serve_router` below makes both)

Handlers translate between HTTP and the Router service; every APIError (and the server's own 4xx)
leaves as OpenAI-style error JSON. Draining (prefixpool/contract/drain.py): /readyz answers 503 and a
new completion a 503 `router_draining`; admitted requests finish, and a stream still running at the
drain deadline ends with an error event. Knows nothing of etcd, policies or how workers are reached.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import msgspec

from prefixpool.router import openai_format as fmt
from prefixpool.router.admin_pin import decode_pin, forward_pin
from prefixpool.router.detokenizer import Detokenizer
from prefixpool.net.http1_server import Answer, Http1Server, Request, Stream
from prefixpool.router.openai_logprobs import LogprobsShape
from prefixpool.router.errors import APIError, InternalError, InvalidRequest, RouteNotFound, ServiceUnavailable
from prefixpool.contract.drain import Drain, DrainDeadline, Draining
from prefixpool.router.openai_schema import ChatBody, CompletionBody, RouteBody, decode
from prefixpool.router.served_models import listing
from prefixpool.router.service import Prepared, Router
from prefixpool.contract.worker_api import Done, Event, Failed, Token

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 1024 * 1024
JSON = b"application/json"
EVENT_STREAM = b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"


def json_answer(payload: object, status: int = 200) -> Answer:
    """JSON encoded by msgspec (C), not the json module."""
    return Answer(status, msgspec.json.encode(payload))


def error_answer(err: APIError) -> Answer:
    return json_answer(err.body(), status=err.status)


def app_errors(status: int, message: str) -> bytes:
    """The server's own answers (a malformed request, a head or body too large: 4xx; a handler's uncaught error:
    500) in the API's error shape."""
    return msgspec.json.encode((InternalError if status >= 500 else InvalidRequest)(message).body())


Handler = Callable[["RouterApp", Request], Awaitable["Answer | Stream"]]


async def completions(app: RouterApp, request: Request) -> Answer | Stream:
    router = app.authorized(request)
    prepared = router.prepare(decode(request.body, CompletionBody))
    router.metrics.prepare_s.observe(time.perf_counter() - request.arrived)
    return await _serve(app, request, prepared)


async def chat_completions(app: RouterApp, request: Request) -> Answer | Stream:
    router = app.authorized(request)
    prepared = router.prepare(decode(request.body, ChatBody))
    router.metrics.prepare_s.observe(time.perf_counter() - request.arrived)
    return await _serve(app, request, prepared)


async def route(app: RouterApp, request: Request) -> Answer:
    router = app.authorized(request)
    return json_answer(router.explain(router.prepare(decode(request.body, RouteBody))))


async def pin(app: RouterApp, request: Request) -> Answer:
    router = app.authorized(request)
    return json_answer(await forward_pin(router, decode_pin(request.body), unpin=False))


async def unpin(app: RouterApp, request: Request) -> Answer:
    router = app.authorized(request)
    return json_answer(await forward_pin(router, decode_pin(request.body), unpin=True))


async def _serve(app: RouterApp, request: Request, prepared: Prepared) -> Answer | Stream:
    router = app.router
    if prepared.stream:
        return await _serve_stream(app, request, prepared)
    detok = Detokenizer(router.tokenizer.decode)
    logprobs = _logprobs_shape(router, prepared)
    tokens: list[Token] = []  # kept for their logprobs
    # aclosing: a client gone frees its worker slot now; past the drain deadline the app answers 503
    async with contextlib.aclosing(router.generate(prepared)) as events, app.drain.until_deadline():
        async for event in events:
            if isinstance(event, Token):
                detok.tokens.append(event.token)
                tokens.append(event)
            elif isinstance(event, Done):
                shape = fmt.chat if prepared.chat else fmt.completion
                return json_answer(shape(prepared.request_id, prepared.model, detok.text, event.finish_reason,
                                         event.usage, None if logprobs is None else logprobs.of(tokens)))
            elif isinstance(event, Failed):
                raise router.failure(event)
    raise router.failure(Failed("the worker ended the stream without finishing", 502))


async def _serve_stream(app: RouterApp, request: Request, prepared: Prepared) -> Stream:
    router, drain = app.router, app.drain
    # made while the worker computes, not between its first token and the client; its head leaves with the
    # first frame, in one write
    response = request.stream(EVENT_STREAM)
    detok = Detokenizer(router.tokenizer.decode)
    frames = fmt.StreamFrames(prepared.request_id, prepared.model, prepared.chat)
    opening = frames.first() if prepared.chat else b""  # a chat stream's role frame goes with its first token
    logprobs = _logprobs_shape(router, prepared)
    async with contextlib.aclosing(router.generate(prepared)) as events:
        async with drain.until_deadline():
            first = await anext(events)  # routing errors (and the drain deadline) still become an error answer here
        try:
            async with drain.until_deadline():
                end = await _relay(prepared, first, events, detok, frames, response, logprobs, opening)
        except DrainDeadline as err:
            end = frames.frame(fmt.error_chunk(f"router shutting down: {err}", 503))
        await response.end(end + b"data: [DONE]\n\n")  # the last frames and the stream's end: one write
        return response


async def _relay(prepared: Prepared, event: Event, events: AsyncIterator[Event], detok: Detokenizer,
                 frames: fmt.StreamFrames, response: Stream, logprobs: LogprobsShape | None,
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


async def models(app: RouterApp, request: Request) -> Answer:
    router = app.authorized(request)
    return json_answer({"object": "list", "data": listing(router.model, router.live_workers())})


async def healthz(app: RouterApp, request: Request) -> Answer:
    return json_answer({"status": "ok", "workers": len(app.router.live_workers())})


async def readyz(app: RouterApp, request: Request) -> Answer:
    workers = len(app.router.live_workers())
    if not app.drain.serving:  # first thing a drain changes: a Service stops sending here
        return json_answer({"ready": False, "draining": True, "workers": workers}, status=503)
    return json_answer({"ready": workers > 0, "workers": workers}, status=200 if workers else 503)


async def metrics(app: RouterApp, request: Request) -> Answer:
    app.router.refresh_gauges()
    return Answer(200, app.router.metrics.render(), b"text/plain; charset=utf-8")


ROUTES: dict[str, dict[str, Handler]] = {
    "/v1/completions": {"POST": completions},
    "/v1/chat/completions": {"POST": chat_completions},
    "/v1/route": {"POST": route},
    "/v1/admin/pin": {"POST": pin, "DELETE": unpin},
    "/v1/models": {"GET": models},
    "/healthz": {"GET": healthz},
    "/readyz": {"GET": readyz},
    "/metrics": {"GET": metrics},
}
ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class RouterApp:
    """The server's handler: a request's route, its answer, errors as OpenAI JSON, the drain gate, the count."""

    def __init__(self, router: Router, drain: Drain | None = None) -> None:
        self.router = router
        self.drain = drain or Drain()

    def authorized(self, request: Request) -> Router:
        self.router.check_api_key(request.headers.get(b"authorization", b"").decode("latin-1"))
        return self.router

    async def __call__(self, request: Request) -> Answer | Stream:
        methods = ROUTES.get(request.path)
        if methods is None:
            answer: Answer | Stream = error_answer(RouteNotFound(f"{request.method} {request.path}: Not Found"))
        elif (handler := methods.get(request.method)) is None:
            err = InvalidRequest(f"{request.method} {request.path}: Method Not Allowed (allowed: "
                                 f"{', '.join(methods)})")
            err.status = 405
            answer = error_answer(err)
        elif request.path in ADMITTED_PATHS:
            answer = await self._admitted(handler, request)
        else:
            answer = await self._answer(handler, request)
        endpoint = request.path if methods is not None else "unmatched"  # no label per path a client made up
        self.router.metrics.requests.labels(endpoint, str(answer.status)).inc()
        return answer

    async def _admitted(self, handler: Handler, request: Request) -> Answer | Stream:
        """Completions are admitted while serving; once draining they get a 503 a balancer retries elsewhere."""
        try:
            async with self.drain.admitted():
                answer = await self._answer(handler, request)
        except (Draining, DrainDeadline) as err:
            answer = error_answer(ServiceUnavailable(f"router shutting down: {err}", code="router_draining"))
        if not self.drain.serving:  # the client's next request opens a connection to a router that serves
            answer.close = True
        return answer

    async def _answer(self, handler: Handler, request: Request) -> Answer | Stream:
        try:
            return await handler(self, request)
        except APIError as err:
            return error_answer(err)
        except ConnectionError:
            raise  # the client left mid-stream: the server closes the connection
        except Exception:  # a bug: still answer in the API's error shape, and log it
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_answer(InternalError("internal error; see the router log"))


def serve_router(router: Router, drain: Drain | None = None) -> Http1Server:
    """The router's HTTP server, not yet listening (`await server.start(sock)`)."""
    return Http1Server(RouterApp(router, drain), MAX_BODY_BYTES, errors=app_errors, error_type=JSON)
