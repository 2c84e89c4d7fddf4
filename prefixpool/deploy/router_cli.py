"""`prefixpool router`: the cache-aware router process, or N of them on one port.

    etcd Mirror (snapshot + watch) ─▶ Router (policy, cost model) ─▶ HTTP (OpenAI API)
    LoadPublisher: this router's URL and in-flight load per worker ─▶ etcd, under its own lease

It binds --host and advertises --advertise-host (prefixpool.deploy.addresses: a
loopback address into a non-loopback etcd is refused before anything starts).

With `--processes N` the parent picks the port, starts N router processes that
each bind it with SO_REUSEPORT (the kernel spreads connections over them), each
with its own mirror, load entry (`<router-id>-<i>`) and metrics, aggregated by
prometheus_client's multiprocess mode; it stops them on SIGTERM.

SIGTERM / SIGINT drains: /readyz turns 503 at once, new completions get a 503
`router_draining`, in-flight requests and streams finish (up to
--drain-deadline-s, then they end with an error event), then the server, the
worker connections and the etcd watch are closed and the process exits.

The cost model's prefill speed follows what workers report in their etcd
records (the mean over workers that have measured one), so routing adapts to
the hardware it runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable

from prefixpool.deploy.addresses import AddressError, advertise_host, bind_host
from prefixpool.deploy.heap import freeze_startup_heap
from prefixpool.meta.etcd_client import EtcdClient
from prefixpool.meta.layout import Layout
from prefixpool.meta.load_publisher import LoadPublisher, LoadPublisherConfig
from prefixpool.meta.mirror import Mirror, MirrorConfig
from prefixpool.meta.sharded_mirror import ShardedMirror, index_mirror
from prefixpool.model.source import MODEL_ERRORS, cache_namespace, model_config, tokenizer_for
from prefixpool.deploy.processes import announce_ready, start_logging
from prefixpool.deploy.router_processes import run_processes
from prefixpool.deploy.router_settings import RouterSettings
from prefixpool.deploy.settings import add_flags, from_args
from prefixpool.router.cost_model import CostModel
from prefixpool.router.conductor import ConductorConfig
from prefixpool.contract.drain import Drain
from prefixpool.router.http import serve_router
from prefixpool.router.service import Router, RouterConfig
from prefixpool.router.vllm_client import VllmClient
from prefixpool.router.worker_client import WorkerClient

log = logging.getLogger(__name__)
SHUTDOWN_STEP_S = 5.0  # after the drain, the longest each teardown step may take
SNAPSHOT_WAIT_S = 10.0  # longest a starting router waits for its first etcd snapshot before it listens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RouterSettings)


def run(args: argparse.Namespace) -> int:
    start_logging()
    settings = from_args(RouterSettings, args)
    try:
        host = bind_host(settings.host, settings.etcd_endpoints)
        advertise = advertise_host(host, settings.advertise_host, settings.etcd_endpoints)
    except AddressError as err:
        print(f"prefixpool router: {err}", file=sys.stderr)
        return 2
    settings = dataclasses.replace(settings, host=host, advertise_host=advertise,
                                   router_id=settings.router_id or f"{socket.gethostname()}-{os.getpid()}")
    try:
        model_config(settings.model, settings.model_path)  # refused here, once, before any process starts
        if settings.processes > 1:
            return run_processes(settings, serve_one)
        serve_one(settings)
    except MODEL_ERRORS as err:  # a checkpoint we cannot serve: one line, not a traceback
        raise SystemExit(f"prefixpool router: {err}") from None
    return 0


def serve_one(settings: RouterSettings, on_ready=announce_ready) -> None:
    """One router process until SIGTERM or SIGINT (uvloop's event loop where installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; the plain loop still works
        asyncio.run(serve(settings, on_ready))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(settings, on_ready))


def build_router(settings: RouterSettings, view, client: WorkerClient) -> Router:
    config = model_config(settings.model, settings.model_path)
    per_token = config.kv_bytes_per_token(settings.dtype)
    costs = CostModel(block_size=settings.block_size, block_bytes=per_token * settings.block_size,
                      prefill_tokens_per_s=settings.prefill_tokens_per_s, link_bytes_per_s=settings.link_bytes_per_s,
                      decode_step_s=settings.decode_step_s, lost_reuse_weight=settings.lost_reuse_weight)
    router_config = RouterConfig(
        model=settings.model, namespace=cache_namespace(config, settings.dtype, settings.block_size),
        max_context=config.max_position, vocab_size=config.vocab_size, policy=settings.policy,
        router_id=settings.router_id, api_key=settings.api_key, max_retries=settings.max_retries,
        default_max_tokens=settings.default_max_tokens, handoff_wait_s=settings.pd_handoff_wait_s,
        conductor=ConductorConfig(settings.pd_interference_weight, settings.pd_handoff_setup_s))
    tokenizer = tokenizer_for(settings.model_path)
    if (refused := getattr(tokenizer, "chunk_refusal", None)) is not None:
        log.info("tokenizer encodes each prompt whole (%s)", refused)
    return Router(router_config, tokenizer, view, client, costs)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT, so sibling router processes can bind the same port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def serve(settings: RouterSettings, on_ready=announce_ready) -> None:
    clients = [EtcdClient(endpoints) for endpoints in settings.shard_endpoints]
    etcd = clients[0]  # the home shard: node records and router loads
    layout = Layout(settings.cluster)
    mirror = index_mirror(clients, layout, MirrorConfig(run_blocks=settings.publish_run_blocks))
    client = WorkerClient(settings.worker_token, read_timeout_s=settings.request_timeout_s)
    router = build_router(settings, mirror, client)
    vllm = router.kind_clients["vllm"] = VllmClient(settings.model, read_timeout_s=settings.request_timeout_s)
    sock = listen(settings.host, settings.port)  # bound first: the load entry names the real port
    url = f"http://{settings.advertise_host}:{sock.getsockname()[1]}"
    config = LoadPublisherConfig(ttl_s=settings.lease_ttl_s, period_s=settings.load_publish_s,
                                 alone_period_s=settings.load_publish_alone_s)
    publisher = LoadPublisher(etcd, layout, settings.router_id, router.inflight, config, url,
                              peers=lambda: mirror.fleet.active(settings.router_id, 2 * config.alone_period_s))
    router.inflight.on_change = publisher.changed
    await mirror.start()
    await publisher.start()
    try:  # listen with a synced view: a restarted router must not answer "no worker" while it has them
        await mirror.wait_revision(1, timeout_s=SNAPSHOT_WAIT_S)
    except TimeoutError:
        log.warning("no etcd snapshot yet; serving, /readyz stays 503 until workers appear")
    gate = Drain()
    server = serve_router(router, gate)
    await server.start(sock)
    tasks = [asyncio.create_task(_follow_prefill_speed(router, mirror))]
    if settings.processes > 1:  # a scrape reaches one process: every process keeps its gauges current
        tasks.append(asyncio.create_task(_refresh_gauges(router)))
    log.info("startup heap frozen: %d objects out of the collector's full passes", freeze_startup_heap())
    on_ready(url)
    log.info("router %s serving %s (policy %s)", settings.router_id, url, settings.policy)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    gate.begin(settings.drain_deadline_s)
    log.info("router draining (deadline %gs): %d requests in flight", settings.drain_deadline_s, gate.num_admitted)
    report = await gate.wait()
    log.info("router drained in %.2fs: %d cut by the deadline", report.seconds, report.num_cut)
    for task in tasks:
        task.cancel()
    # Nothing is in flight now: each step of the teardown is bounded, so a stuck one (a connection, etcd) is
    # named in the log and the process still exits (CI once saw a drained router not exit in 30 s).
    steps = [("HTTP server", server.close(SHUTDOWN_STEP_S / 2)), ("worker client", client.close()),
             ("publisher", publisher.stop()), ("vLLM client", vllm.close()), ("mirror", mirror.stop())]
    steps += [(f"etcd client {i}", etcd.close()) for i, etcd in enumerate(clients)]
    for name, step in steps:
        await _bounded(name, step)


async def _bounded(name: str, step: Awaitable[None], timeout_s: float = SHUTDOWN_STEP_S) -> None:
    try:
        await asyncio.wait_for(step, timeout_s)
    except asyncio.TimeoutError:
        log.warning("router shutdown: %s did not stop within %gs; going on", name, timeout_s)


async def _follow_prefill_speed(router: Router, mirror: Mirror | ShardedMirror, period_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(period_s)
        speeds = [n.prefill_tokens_per_s for n in mirror.nodes.values() if n.prefill_tokens_per_s > 0]
        if speeds:
            router.costs = router.costs.with_prefill_speed(sum(speeds) / len(speeds))


async def _refresh_gauges(router: Router, period_s: float = 1.0) -> None:
    while True:
        router.refresh_gauges()
        await asyncio.sleep(period_s)
