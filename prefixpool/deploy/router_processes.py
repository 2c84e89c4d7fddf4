"""`prefixpool router --processes N`: N router processes on one port, started and stopped together.

    parent: bind (host, port) with SO_REUSEPORT to pick the port -> spawn N children, each
            binding the same port with SO_REUSEPORT (the kernel spreads connections) ->
            all ready: close its own socket, announce the URL -> SIGTERM/SIGINT or a child
            gone: SIGTERM every child by pid, join, SIGKILL what did not stop
    metrics: PROMETHEUS_MULTIPROC_DIR (a temp dir this parent owns, with a janitor) puts every child's
            counters in shared files; any child's /metrics answers for all of them

Knows nothing of routing: it runs `serve_one(settings, on_ready)` per child.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Callable

from prefixpool.deploy.janitor import OwnedTempDir
from prefixpool.deploy.processes import announce_ready, die_with_parent
from prefixpool.deploy.router_settings import RouterSettings

log = logging.getLogger(__name__)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0


def _child(settings: RouterSettings, ready: multiprocessing.Queue, serve_one: Callable) -> None:
    die_with_parent()  # a parent killed with SIGKILL takes its router processes along
    serve_one(settings, on_ready=ready.put)


def run_processes(settings: RouterSettings, serve_one: Callable) -> int:
    from prefixpool.deploy.router_cli import listen  # the same bind the children use

    with OwnedTempDir("prefixpool-router-metrics-") as metrics_dir:  # removed even if this parent is SIGKILLed
        os.environ[MULTIPROC_ENV] = str(metrics_dir)  # inherited by the spawned children before they import prometheus
        reserved = listen(settings.host, settings.port)
        port = reserved.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        ready = context.Queue()
        children = [context.Process(target=_child, name=f"router-{i}", args=(
            dataclasses.replace(settings, port=port, router_id=f"{settings.router_id}-{i}"), ready, serve_one))
            for i in range(settings.processes)]
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        for child in children:
            child.start()
        try:
            url = _wait_ready(children, ready, stop)
            reserved.close()
            if url is None:
                return 1
            announce_ready(url)
            log.info("%d router processes serving %s", len(children), url)
            while not stop.wait(0.5):
                if any(not child.is_alive() for child in children):
                    log.error("a router process exited; stopping the others")
                    return 1
            return 0
        finally:
            reserved.close()
            _stop(children)


def _wait_ready(children: list, ready: multiprocessing.Queue, stop: threading.Event) -> str | None:
    """The URL once every child announced it; None if one exited, time ran out or we were stopped."""
    url, waiting = None, len(children)
    deadline = time.monotonic() + START_TIMEOUT_S
    while waiting and time.monotonic() < deadline and not stop.is_set():
        try:
            url = ready.get(timeout=0.5)
            waiting -= 1
        except queue.Empty:
            if any(child.exitcode is not None for child in children):
                log.error("a router process exited while starting")
                return None
    return url if not waiting else None


def _stop(children: list) -> None:
    from prometheus_client import multiprocess

    for child in children:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGTERM)
    for child in children:
        child.join(STOP_TIMEOUT_S)
        if child.is_alive():
            log.warning("router process %d did not stop; killing it", child.pid)
            child.kill()
            child.join()
        if child.pid is not None:
            multiprocess.mark_process_dead(child.pid)
