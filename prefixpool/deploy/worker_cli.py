"""`prefixpool worker`: build one worker from its settings and serve until SIGTERM.

    model + arena + node_blocks(tier sizes, pins) -> Engine
    NodeCore.open: transfer server (serves any tier) + etcd Membership (lease) + Publisher
    Worker(engine, core.exchange)           HTTP API (worker/http_api.py)
    core.join(): SSD tier dir from an earlier run scanned, node and blocks registered
    READY <http url> once all of it is up

Stopping (SIGTERM or SIGINT) drains (prefixpool/worker/drain.py): stop taking
requests, revoke the lease (the node's blocks leave every router's index at
once), let admitted streams and peers' transfer reads finish up to
--drain-deadline-s, then close the servers and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

import torch
from aiohttp import web

from prefixpool.deploy.addresses import WILDCARDS, AddressError, advertise_host, bind_host, interface_of
from prefixpool.engine.scheduler import Engine
from prefixpool.meta.load_report import Load, report_load
from prefixpool.meta.membership import NodeRecord
from prefixpool.router.conductor import ROLES
from prefixpool.model.config import arena_shape_for
from prefixpool.engine.torch_dtype import resolve_device, torch_dtype
from prefixpool.engine.checkpoint import build_model
from prefixpool.model.source import MODEL_ERRORS, cache_namespace, tokenizer_for
from prefixpool.deploy.processes import announce_ready, start_logging
from prefixpool.deploy.heap import freeze_startup_heap
from prefixpool.deploy.settings import add_flags, from_args
from prefixpool.worker.service import Worker, WorkerPeriods
from prefixpool.worker.drain import drain_worker
from prefixpool.worker.http_api import build_app
from prefixpool.deploy.worker_settings import WorkerSettings
from prefixpool.contract.drain import Drain
from prefixpool.node.blocks import TierSizes, node_blocks
from prefixpool.node.core import NodeConfig, NodeCore
from prefixpool.node.faults import Faults
from prefixpool.store.arena import KVArena
from prefixpool.store.pins import PrefixPins

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerSettings)


def run(args: argparse.Namespace) -> int:
    start_logging()
    settings = from_args(WorkerSettings, args)
    if settings.role not in ROLES:
        print(f"prefixpool worker: --role {settings.role!r} is not one of {', '.join(ROLES)}", file=sys.stderr)
        return 2
    try:
        host = bind_host(settings.host, settings.etcd_endpoints)
        advertise = advertise_host(host, settings.advertise_host, settings.etcd_endpoints)
    except AddressError as err:
        print(f"prefixpool worker: {err}", file=sys.stderr)
        return 2
    # UCX (serving, or fetching from a UCX peer) reads this once; it must name the interface peers reach.
    os.environ.setdefault("UCX_NET_DEVICES", interface_of(advertise if host in WILDCARDS else host) or "all")
    try:
        asyncio.run(serve(settings, host, advertise))
    except MODEL_ERRORS as err:  # a checkpoint we cannot serve: one line, not a traceback
        raise SystemExit(f"prefixpool worker: {err}") from None
    return 0


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.cpu_threads > 0:
        torch.set_num_threads(settings.cpu_threads)
    device = resolve_device(settings.device)
    model = build_model(settings.model, settings.model_path, settings.dtype, device, settings.seed)
    arena = KVArena(arena_shape_for(model.config, settings.num_blocks, settings.block_size),
                    torch_dtype(settings.dtype), device)
    namespace = cache_namespace(model.config, settings.dtype, settings.block_size)
    sizes = TierSizes(settings.host_tier_blocks, settings.disk_tier_blocks, settings.disk_tier_dir,
                      settings.disk_queue_blocks)
    blocks = node_blocks(arena, sizes, settings.min_residency_s,
                         PrefixPins(settings.soft_pin_blocks, settings.soft_pin_ttl_s))
    return Engine(model, blocks, arena, namespace, max_batch_size=settings.max_batch_size,
                  chunk_size=settings.chunk_size, batch_invariant=settings.batch_invariant)


def node_config(settings: WorkerSettings, host: str, advertise: str) -> NodeConfig:
    return NodeConfig(etcd_endpoints=settings.etcd_endpoints, etcd_shards=settings.shard_endpoints,
                      cluster=settings.cluster,
                      transfer_url=f"{settings.transfer}://{host}:{settings.transfer_port}", advertise_host=advertise,
                      token=settings.token, lease_ttl_s=settings.lease_ttl_s,
                      publish_run_blocks=settings.publish_run_blocks,
                      faults=Faults(corrupt_every=settings.corrupt_transfer_every, fault_file=settings.fault_file))


async def serve(settings: WorkerSettings, host: str, advertise: str) -> None:
    """Serve on `host` (bound) as `advertise` (what etcd records), both decided by prefixpool.deploy.addresses."""
    node_id = settings.node_id or f"{socket.gethostname()}-{os.getpid()}"
    engine = build_engine(settings)
    http_socket = _bind(host, settings.port)  # bound first: the record needs the real port
    http_url = f"http://{advertise}:{http_socket.getsockname()[1]}"
    record = NodeRecord(node_id, http_url, "", settings.block_size, settings.num_blocks, settings.model,
                        namespace=engine.namespace.root().hex(), role=settings.role)
    core = await NodeCore.open(engine.blocks, engine.arena, node_config(settings, host, advertise), record)
    worker = Worker(engine, core.exchange, settings.fetch_timeout_s,
                    WorkerPeriods(soft_refresh_s=settings.soft_pin_refresh_s),
                    fetch_while_queued=settings.fetch_while_queued)
    gate = Drain()
    app = build_app(worker, settings.token, tokenizer_for(settings.model_path), core.source, gate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, http_socket).start()
    await core.join()  # HTTP first: a router may call as soon as the record is in etcd
    worker.start()
    load_task = asyncio.create_task(report_load(lambda: _sample_load(worker), core.membership))
    log.info("startup heap frozen: %d objects out of the collector's full passes", freeze_startup_heap())
    announce_ready(http_url)
    log.info("worker %s serving %s (transfer %s)", node_id, http_url, core.record.transfer_url)
    await _wait_for_signal()
    load_task.cancel()
    log.info("worker %s draining (deadline %gs)", node_id, settings.drain_deadline_s)
    report = await drain_worker(gate, core, settings.drain_deadline_s)
    log.info("worker %s drained in %.2fs: %d requests in flight at SIGTERM, %d cut by the deadline",
             node_id, report.seconds, report.num_admitted, report.num_cut)
    await worker.stop()
    await runner.cleanup()
    await core.close()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def _sample_load(worker: Worker) -> Load:
    load = worker.load()
    return Load(load.num_queued, load.num_running, load.prefill_tokens_per_s)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
