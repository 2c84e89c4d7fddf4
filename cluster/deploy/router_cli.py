"""`prefixpool router`: the cache-aware router process.

    etcd Mirror (snapshot + watch) ─▶ Router (policy, cost model) ─▶ HTTP (OpenAI API)

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
import logging
import signal
import socket

from aiohttp import web

from cluster.meta.etcd_client import EtcdClient
from cluster.meta.layout import Layout
from cluster.meta.mirror import Mirror
from cluster.engine.model_config import torch_dtype
from cluster.engine.model_source import MODEL_ERRORS, cache_namespace, model_config, tokenizer_for
from cluster.deploy.processes import announce_ready
from cluster.deploy.router_settings import RouterSettings
from cluster.deploy.settings import add_flags, from_args
from router.cost_model import CostModel
from router.contract.drain import Drain
from router.http import build_app
from router.service import Router, RouterConfig
from router.worker_client import WorkerClient

log = logging.getLogger(__name__)
SNAPSHOT_WAIT_S = 10.0  # longest a starting router waits for its first etcd snapshot before it listens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RouterSettings)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(from_args(RouterSettings, args)))
    except MODEL_ERRORS as err:  # a checkpoint we cannot serve: one line, not a traceback
        raise SystemExit(f"prefixpool router: {err}") from None
    return 0


def build_router(settings: RouterSettings, view, client: WorkerClient) -> Router:
    config = model_config(settings.model, settings.model_path)
    per_token = config.kv_bytes_per_token(torch_dtype(settings.dtype))
    costs = CostModel(block_size=settings.block_size, block_bytes=per_token * settings.block_size,
                      prefill_tokens_per_s=settings.prefill_tokens_per_s, link_bytes_per_s=settings.link_bytes_per_s,
                      decode_step_s=settings.decode_step_s)
    router_config = RouterConfig(
        model=settings.model, namespace=cache_namespace(config, settings.dtype, settings.block_size),
        max_context=config.max_position, vocab_size=config.vocab_size, policy=settings.policy,
        api_key=settings.api_key, max_retries=settings.max_retries, default_max_tokens=settings.default_max_tokens)
    return Router(router_config, tokenizer_for(settings.model_path), view, client, costs)


async def serve(settings: RouterSettings) -> None:
    etcd = EtcdClient(settings.etcd_endpoints)
    mirror = Mirror(etcd, Layout(settings.cluster))
    client = WorkerClient(settings.worker_token, read_timeout_s=settings.request_timeout_s)
    router = build_router(settings, mirror, client)
    await mirror.start()
    try:  # listen with a synced view: a restarted router must not answer "no worker" while it has them
        await mirror.wait_revision(1, timeout_s=SNAPSHOT_WAIT_S)
    except TimeoutError:
        log.warning("no etcd snapshot yet; serving, /readyz stays 503 until workers appear")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    gate = Drain()
    runner = web.AppRunner(build_app(router, gate), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    speed_task = asyncio.create_task(_follow_prefill_speed(router, mirror))
    url = f"http://{settings.host}:{sock.getsockname()[1]}"
    announce_ready(url)
    log.info("router serving %s (policy %s)", url, settings.policy)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    gate.begin(settings.drain_deadline_s)
    log.info("router draining (deadline %gs): %d requests in flight", settings.drain_deadline_s, gate.num_admitted)
    report = await gate.wait()
    log.info("router drained in %.2fs: %d cut by the deadline", report.seconds, report.num_cut)
    speed_task.cancel()
    await runner.cleanup()
    await client.close()
    await mirror.stop()
    await etcd.close()


async def _follow_prefill_speed(router: Router, mirror: Mirror, period_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(period_s)
        speeds = [n.prefill_tokens_per_s for n in mirror.nodes.values() if n.prefill_tokens_per_s > 0]
        if speeds:
            router.costs = router.costs.with_prefill_speed(sum(speeds) / len(speeds))
