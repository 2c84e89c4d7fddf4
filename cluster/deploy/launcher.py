"""`prefixpool up`: etcd, N workers and a router on 127.0.0.1, as child processes.

    cluster = LocalCluster(num_workers=2).start()   # prints nothing; .router_url
    ...
    cluster.stop()                                  # by PID, each drains on SIGTERM; no process left

Each component is the same `prefixpool etcd|worker|router` a deployment runs;
components bind port 0 and announce their URL on a READY line. Knows nothing
of what the components do.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cluster.deploy.etcd_server import EtcdServer
from cluster.deploy.processes import Child, python_argv, spawn


@dataclass
class LocalCluster:
    num_workers: int = 2
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    etcd: EtcdServer | None = None
    workers: dict[str, Child] = field(default_factory=dict)
    routers: dict[str, Child] = field(default_factory=dict)

    def start(self) -> "LocalCluster":
        self._own_logs = self.log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="prefixpool-up-")) if self.log_dir is None else Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.etcd = EtcdServer().start()
            for i in range(self.num_workers):
                self.start_worker(f"worker-{i}")
            self.start_router("router")
        except BaseException:
            self.stop()
            raise
        return self

    def _common(self) -> list[str]:
        return ["--etcd-endpoints", self.etcd.endpoint]

    def start_worker(self, node_id: str) -> Child:
        child = spawn(node_id, python_argv("worker", "--node-id", node_id, *self._common(), *self.worker_args),
                      self.log_dir, self.env)
        self.workers[node_id] = child
        return child

    def start_router(self, name: str, port: int = 0) -> Child:
        """A router (more than one may serve the same cluster); `port` 0 picks a free one."""
        child = spawn(name, python_argv("router", "--port", str(port), *self._common(), *self.router_args),
                      self.log_dir, self.env)
        self.routers[name] = child
        return child

    @property
    def router(self) -> Child | None:
        return self.routers.get("router")

    @property
    def router_url(self) -> str:
        assert self.router is not None, "cluster not started"
        return self.router.url

    def stop(self) -> None:
        """Stop everything this cluster started, by PID, each draining on SIGTERM: the routers first
        (their streams finish while the workers still serve), then every worker at once, then etcd."""
        for child in self.routers.values():
            child.terminate()
        for child in self.routers.values():
            child.stop()
        for child in self.workers.values():
            child.terminate()
        for child in self.workers.values():
            child.stop()
        if self.etcd is not None:
            self.etcd.close()
        if getattr(self, "_own_logs", False) and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes to start")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker (repeatable)")
    parser.add_argument("--router-arg", action="append", default=[], help="extra flag for the router (repeatable)")
    parser.add_argument("--log-dir", default="", help="keep component logs here (default: a temp dir, removed at exit)")


def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args.workers, tuple(args.worker_arg), tuple(args.router_arg),
                           log_dir=Path(args.log_dir) if args.log_dir else None)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    with cluster:
        print(f"prefixpool is up: {cluster.router_url}  (OpenAI API at {cluster.router_url}/v1)", flush=True)
        print(f"etcd {cluster.etcd.endpoint}; workers: {', '.join(c.url for c in cluster.workers.values())}", flush=True)
        print("Ctrl-C drains and stops everything.", flush=True)
        try:
            stopping.wait()
        except KeyboardInterrupt:
            pass  # Ctrl-C is the way to stop; the with-block stops every child
    return 0
