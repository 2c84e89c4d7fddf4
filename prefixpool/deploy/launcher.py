"""`prefixpool up`: etcd, N workers and a router on 127.0.0.1, as child processes.

    cluster = LocalCluster(num_workers=2).start()   # prints nothing; .router_url
    LocalCluster(num_index_shards=2)                # block keys over 2 etcd servers (meta/shards.py)
    LocalCluster(num_workers=0, num_prefill=1, num_decode=1)   # prefill-0 hands prompts to decode-0
    ...
    cluster.stop()                                  # by PID, each drains on SIGTERM; no process left

    prefixpool up --vllm 2 --model-path DIR         # vLLM servers (+ their vllm-node sidecars)
                                                    # instead of our workers, the same router
    prefixpool up --vllm 2 --vllm-connector ...     # and they share KV through PrefixPoolConnector
    prefixpool up --vllm-prefill 1 --vllm-decode 1 --vllm-connector ...   # prefill/decode disaggregated vLLM
    prefixpool up --vllm 2 --lora-modules A=DIR --lora-nodes 1 ...   # LoRA adapter A on vllm-0 only
    prefixpool up --publish-run-blocks 32 ...       # every worker, sidecar, connector and router alike

Each component is the same `prefixpool etcd|worker|router` a deployment runs;
components bind port 0 and announce their URL on a READY line. Knows nothing
of what the components do.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from prefixpool.deploy.etcd_server import EtcdServer
from prefixpool.deploy.janitor import OwnedTempDir
from prefixpool.deploy.processes import Child, python_argv, spawn
from prefixpool.deploy.settings import env_name
from prefixpool.deploy.vllm_fleet import (add_vllm_arguments, model_args, num_vllm_servers, on_node, roles_of,
                                          sidecar_args, vllm_config, vllm_temp_dir)
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer
from prefixpool.meta.runs import check_run_blocks


@dataclass
class LocalCluster:
    num_workers: int = 2
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    etcd: EtcdServer | None = None
    num_index_shards: int = 1  # etcd servers the block keys spread over; self.etcd is shard 0
    publish_run_blocks: int = 1  # every node publishes, every router and connector matches, per run (meta/runs.py)
    shard_etcds: list[EtcdServer] = field(default_factory=list)  # shards 1.. (none with one shard)
    num_prefill: int = 0  # our workers with --role prefill (prefill-i) and --role decode (decode-i), beside num_workers
    num_decode: int = 0
    workers: dict[str, Child] = field(default_factory=dict)
    routers: dict[str, Child] = field(default_factory=dict)
    vllm: VllmConfig | None = None  # with num_vllm > 0: vLLM servers and their sidecars
    num_vllm: int = 0
    num_vllm_prefill: int = 0  # vLLM prefill servers (kv_producer) and decode servers (kv_consumer), beside num_vllm
    num_vllm_decode: int = 0
    vllm_connector: bool = False  # each vLLM server loads and saves KV through PrefixPoolConnector
    connector_settings: dict = field(default_factory=dict)  # more of its kv_connector_extra_config
    sidecar_args: tuple[str, ...] = ()
    lora_nodes: int | None = None  # only vllm-0 .. vllm-<lora_nodes - 1> load vllm.lora_modules; None: all
    vllm_servers: dict[str, VllmServer] = field(default_factory=dict)
    sidecars: dict[str, Child] = field(default_factory=dict)

    def start(self) -> "LocalCluster":
        self._temp_logs = OwnedTempDir("prefixpool-up-") if self.log_dir is None else None
        self.log_dir = self._temp_logs.path if self._temp_logs else Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.etcd = EtcdServer().start()
            self.shard_etcds = [EtcdServer().start() for _ in range(self.num_index_shards - 1)]
            for i in range(self.num_workers):
                self.start_worker(f"worker-{i}")
            for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
                for i in range(count):
                    self.start_worker(f"{role}-{i}", role)
            self.start_vllm(list(self.vllm_roles))
            self.start_router("router")
        except BaseException:
            self.stop()
            raise
        return self

    def _common(self) -> list[str]:
        shards = ["--etcd-shards", ";".join(s.endpoint for s in self.etcd_shards)] if self.shard_etcds else []
        runs = ["--publish-run-blocks", str(self.publish_run_blocks)] if self.publish_run_blocks > 1 else []
        return ["--etcd-endpoints", self.etcd.endpoint, *shards, *runs]

    @property
    def etcd_shards(self) -> list[EtcdServer]:
        """Every index shard's etcd server, shard 0 (self.etcd) first."""
        return [self.etcd, *self.shard_etcds] if self.etcd is not None else []

    def _model(self) -> list[str]:
        return model_args(self.vllm)

    def start_vllm(self, node_ids: list[str]) -> None:
        """vLLM servers (started side by side), then a sidecar each (READY once registered in etcd)."""
        if not node_ids:
            return
        assert self.vllm is not None and self.log_dir is not None
        for node_id in node_ids:
            self.vllm_servers[node_id] = VllmServer.launch(self.vllm_config_for(node_id), self.log_dir, node_id,
                                                           vllm_temp_dir())
        for node_id in node_ids:
            self.vllm_servers[node_id].wait_healthy(600.0)
            self.start_sidecar(node_id)

    def vllm_config_for(self, node_id: str) -> VllmConfig:
        assert self.vllm is not None and self.etcd is not None
        config = self.vllm
        if self.lora_nodes is not None and node_id not in {f"vllm-{i}" for i in range(self.lora_nodes)}:
            config = dataclasses.replace(config, lora_modules=())
        settings = {**self._shards_setting(), **self._runs_setting(), **self.connector_settings}
        return on_node(config, node_id, self.etcd.endpoint, self.vllm_connector, settings, self.vllm_roles[node_id])

    def _shards_setting(self) -> dict[str, str]:
        """The connector's etcd_shards with index shards (nothing without)."""
        return {"etcd_shards": ";".join(s.endpoint for s in self.etcd_shards)} if self.shard_etcds else {}

    def _runs_setting(self) -> dict[str, int]:
        """The connector's publish_run_blocks, as every other process gets it (nothing at 1, per block)."""
        return {"publish_run_blocks": self.publish_run_blocks} if self.publish_run_blocks > 1 else {}

    @property
    def vllm_roles(self) -> dict[str, str]:
        """vLLM node id -> its role (both, prefill, decode)."""
        return roles_of(self.num_vllm, self.num_vllm_prefill, self.num_vllm_decode)

    def start_sidecar(self, node_id: str) -> Child:
        server = self.vllm_servers[node_id]
        assert self.vllm is not None and self.etcd is not None
        extra = (*self._common()[2:], *self.sidecar_args)  # --etcd-shards, --publish-run-blocks when set
        argv = sidecar_args(node_id, server, self.etcd.endpoint, self.vllm, extra, self.vllm_roles[node_id])
        child = spawn(f"{node_id}-sidecar", python_argv(*argv), self.log_dir, self.env)
        self.sidecars[node_id] = child
        return child

    def start_worker(self, node_id: str, role: str = "both", extra_args: tuple[str, ...] = ()) -> Child:
        """Our worker `node_id`; `role` prefill or decode for a disaggregated fleet (both: whole requests)."""
        child = spawn(node_id, python_argv("worker", "--node-id", node_id, *self._common(), *self.worker_args,
                                           "--role", role, *extra_args), self.log_dir, self.env)
        self.workers[node_id] = child
        return child

    def start_router(self, name: str, port: int = 0) -> Child:
        """A router (more than one may serve the same cluster); `port` 0 picks a free one."""
        child = spawn(name, python_argv("router", "--port", str(port), *self._common(), *self._model(),
                                        *self.router_args), self.log_dir, self.env)
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
        (their streams finish while the nodes still serve), then every worker and sidecar at once, then
        the vLLM servers, then etcd."""
        for child in self.routers.values():
            child.terminate()
        for child in self.routers.values():
            child.stop()
        nodes = [*self.workers.values(), *self.sidecars.values()]
        for child in nodes:
            child.terminate()
        for child in nodes:
            child.stop()
        for server in self.vllm_servers.values():
            server.stop()
        for server in self.etcd_shards:
            server.close()
        if getattr(self, "_temp_logs", None) is not None:
            self._temp_logs.close()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes to start (default 2; 0 with --vllm)")
    parser.add_argument("--prefill", type=int, default=0,
                        help="our workers with --role prefill: they compute prompts for the decode nodes")
    parser.add_argument("--decode", type=int, default=0,
                        help="our workers with --role decode: they stream answers, receiving prompts' KV from "
                             "the prefill nodes (docs/disaggregation.md)")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker (repeatable)")
    parser.add_argument("--router-arg", action="append", default=[], help="extra flag for the router (repeatable)")
    parser.add_argument("--log-dir", default="", help="keep component logs here (default: a temp dir, removed at exit)")
    parser.add_argument("--index-shards", type=int, default=1,
                        help="etcd servers the block index spreads over by key hash (default 1; docs/how-it-works.md)")
    parser.add_argument("--publish-run-blocks", type=int, default=None,
                        help="publish and match one etcd key per run of about N blocks, on every worker, vLLM "
                             f"sidecar and connector and the router (default: env {env_name('publish_run_blocks')}, "
                             "else 1; docs/capacity.md)")
    parser.add_argument("--lora-nodes", type=int, default=None,
                        help="--lora-modules: load them on the first N vLLM servers only (default: all)")
    add_vllm_arguments(parser)


def run(args: argparse.Namespace) -> int:
    split = args.prefill + args.decode  # a disaggregated fleet of our workers: no role-both worker unless asked
    workers = args.workers if args.workers is not None else (0 if num_vllm_servers(args) or split else 2)
    cluster = LocalCluster(workers, tuple(args.worker_arg), tuple(args.router_arg),
                           log_dir=Path(args.log_dir) if args.log_dir else None,
                           vllm=vllm_config(args), num_vllm=args.vllm, vllm_connector=args.vllm_connector,
                           num_vllm_prefill=args.vllm_prefill, num_vllm_decode=args.vllm_decode,
                           lora_nodes=args.lora_nodes, num_prefill=args.prefill, num_decode=args.decode,
                           num_index_shards=args.index_shards, publish_run_blocks=run_blocks_of(args))
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    with cluster:
        print(f"prefixpool is up: {cluster.router_url}  (OpenAI API at {cluster.router_url}/v1)", flush=True)
        nodes = [c.url for c in [*cluster.workers.values(), *cluster.sidecars.values()]]
        etcd = ";".join(server.endpoint for server in cluster.etcd_shards)
        print(f"etcd {etcd}; workers: {', '.join(nodes)}", flush=True)
        print("Ctrl-C drains and stops everything.", flush=True)
        try:
            stopping.wait()
        except KeyboardInterrupt:
            pass  # Ctrl-C is the way to stop; the with-block stops every child
    return 0


def run_blocks_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> int:
    """`up`'s --publish-run-blocks, else the environment's, else 1 (SystemExit if not a power of two up to 256)."""
    given = args.publish_run_blocks
    try:
        return check_run_blocks(given if given is not None else int(environ.get(env_name("publish_run_blocks"), "1")))
    except ValueError as err:
        raise SystemExit(f"--publish-run-blocks: {err}") from None
