"""Deploying on a Ray cluster: etcd, one worker actor per GPU, and the router, as named actors.

    prefixpool ray up --workers N --address auto|HOST:PORT|ray://HOST:10001
    prefixpool ray up --vllm N --model-path DIR      (vLLM actors: a vLLM server and its sidecar each)
    prefixpool ray up --prefill N --decode M         (prefill/decode disaggregation: worker actors
                                                      worker-prefill-i / worker-decode-i, `worker --role`)
    prefixpool ray up --vllm-prefill N --vllm-decode M --vllm-connector --model-path DIR   (the same with vLLM)
    prefixpool ray down

Each actor is a thin supervisor around the same process `prefixpool up` runs
(`prefixpool worker|router|etcd`), so Ray adds placement and restarts and
nothing else: a worker actor asks for one GPU where the cluster has GPUs,
workers go round-robin over the nodes (node affinity), the router and etcd sit on the head node.
etcd listens on the head's node address (loopback on a one-node cluster) at a
fixed port with a fixed data dir, so a restarted etcd actor is the same
endpoint with the same data; `down` removes that dir by its recorded path,
whatever state the actor is in (prefixpool.deploy.ray_etcd_data).
Actors restart on death (max_restarts); a restarted worker re-registers in
etcd under a new lease and the router learns of it through its mirror. The
child dies with its actor (PR_SET_PDEATHSIG), so a killed actor leaves no
orphan. Knows nothing of engines or routing.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from prefixpool.deploy.janitor import OwnedTempDir
from prefixpool.deploy import ray_etcd_data
from prefixpool.deploy.processes import STOP_TIMEOUT_S, Child, python_argv, spawn
from prefixpool.deploy.vllm_fleet import model_args, on_node, roles_of, sidecar_args, vllm_temp_dir
from prefixpool.deploy.vllm_server import VllmConfig, VllmServer

NAMESPACE = "prefixpool"
class ProcessActor:
    """Runs one prefixpool component as a child process for as long as the actor lives."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.log_dir = OwnedTempDir(f"prefixpool-{name}-")  # removed even if Ray SIGKILLs this actor
        self.child: Child = spawn(name, python_argv(*args), self.log_dir.path, env)

    def supervisor_pid(self) -> int:
        return os.getpid()

    def log_path(self) -> str:
        return str(self.log_dir.path)

    def url(self) -> str:
        return self.child.url

    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()

    def stop(self) -> None:
        """SIGTERM the component: it drains (finishes what it admitted) and exits, as on Kubernetes."""
        self.child.stop()
        self.log_dir.close()


class VllmActor(ProcessActor):
    """A vLLM server (its own temp dir) and its vllm-node sidecar (the child), both dying with the actor."""

    def __init__(self, name: str, config: VllmConfig, etcd_endpoints: str, env: dict[str, str],
                 connector: bool = False, role: str = "both") -> None:
        self.log_dir = OwnedTempDir(f"prefixpool-{name}-")
        config = on_node(config, name, etcd_endpoints, connector, role=role)
        self.server = VllmServer.start(config, self.log_dir.path, name, temp=vllm_temp_dir())
        argv = sidecar_args(name, self.server, etcd_endpoints, config, role=role)
        self.child = spawn(f"{name}-sidecar", python_argv(*argv), self.log_dir.path, env)

    def vllm_url(self) -> str:
        return self.server.url

    def vllm_pid(self) -> int:
        return self.server.pid

    def vllm_temp_path(self) -> str:
        assert self.server.temp is not None
        return str(self.server.temp.path)

    def stop(self) -> None:
        """The sidecar first (it revokes its lease: the blocks leave etcd now), then vLLM and its temp dir."""
        self.child.stop()
        self.server.stop()
        self.log_dir.close()


@dataclass(frozen=True)
class Deployment:
    router_url: str
    etcd_endpoints: str
    worker_names: list[str]
    worker_urls: list[str]
    vllm_names: tuple[str, ...] = ()


def _head_node_id() -> str:
    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def _worker_nodes(num_workers: int, num_gpus: float) -> list[str]:
    """One node id per worker, round-robin over the nodes that fit one (worker nodes before the head).

    Ray's SPREAD and soft node affinity are best-effort and were seen putting both
    zero-CPU workers of a 3-node cluster on one node; a hard affinity does spread them.
    The price: a worker whose node dies stays down (the router routes around it)
    until the next `ray up`; one that dies on a live node is restarted there."""
    head = _head_node_id()
    fits = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= num_gpus]
    order = sorted(fits, key=lambda n: (n["NodeID"] == head, n["NodeManagerAddress"]))
    return [order[i % len(order)]["NodeID"] for i in range(num_workers)]


def _actor(name: str, *, on_head: bool = False, num_gpus: float = 0, node_id: str | None = None,
           cls: type = ProcessActor):
    if on_head:
        strategy = NodeAffinitySchedulingStrategy(_head_node_id(), soft=False)
    else:
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=False) if node_id else "SPREAD"
    return ray.remote(cls).options(
        name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, max_task_retries=-1,
        num_cpus=0, num_gpus=num_gpus, scheduling_strategy=strategy)


def _head_address() -> str:
    """Where the etcd actor listens: the head's node address on a multi-node cluster, loopback on one node."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    if len(alive) == 1:
        return "127.0.0.1"
    return next(n["NodeManagerAddress"] for n in alive if n["NodeID"] == _head_node_id())


def _start_etcd(port: int, data_dir: str, env: dict[str, str]) -> str:
    """The etcd actor: a fixed address, port and data dir, so a restarted actor is the same etcd, data included."""
    data_dir = data_dir or f"{tempfile.gettempdir()}/prefixpool-ray-etcd-{port}"
    args = ["etcd", "--host", _head_address(), "--client-port", str(port), "--peer-port", str(port + 1),
            "--data-dir", data_dir]
    ray_etcd_data.record(data_dir, _head_node_id())  # before the actor: `down` finds it even if it never starts
    etcd = _actor("etcd", on_head=True).remote("etcd", args, env)
    return ray.get(etcd.url.remote())


def up(num_workers: int, *, etcd_endpoints: str = "", etcd_port: int = 2379, etcd_data_dir: str = "",
       router_port: int = 8000, router_host: str = "", worker_args: tuple[str, ...] = (),
       router_args: tuple[str, ...] = (), env: dict[str, str] | None = None, vllm: VllmConfig | None = None,
       num_vllm: int = 0, vllm_connector: bool = False, num_prefill: int = 0, num_decode: int = 0,
       num_vllm_prefill: int = 0, num_vllm_decode: int = 0) -> Deployment:
    """Deploy on the Ray cluster `ray.init` connected to; returns where it serves.

    Workers get no address flags: with etcd on the head's node address each binds and
    advertises its own node's address (prefixpool.deploy.addresses). vLLM actors (`num_vllm`,
    serving `vllm`) are placed like workers; the router then hashes with their model.
    `num_prefill`/`num_decode` more workers (and `num_vllm_prefill`/`num_vllm_decode` vLLM actors,
    their connector kv_producer/kv_consumer) take those roles: the router's conductor pairs them."""
    vllm_roles = roles_of(num_vllm, num_vllm_prefill, num_vllm_decode)
    assert vllm is not None or not vllm_roles, "vLLM actors need a VllmConfig"
    env = dict(env or {})
    if not etcd_endpoints:
        etcd_endpoints = _start_etcd(etcd_port, etcd_data_dir, env)
    roles = worker_roles(num_workers, num_prefill, num_decode)
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= len(roles) + len(vllm_roles) else 0
    names, vllm_names = list(roles), list(vllm_roles)
    nodes = _worker_nodes(len(roles) + len(vllm_roles), gpus)
    workers = [
        _actor(name, num_gpus=gpus, node_id=node_id).remote(
            name, ["worker", "--node-id", name, "--etcd-endpoints", etcd_endpoints, *role_args(roles[name]),
                   *worker_args], env)
        for name, node_id in zip(names, nodes)
    ]
    vllms = [_actor(name, num_gpus=gpus, node_id=node_id, cls=VllmActor).remote(
                name, vllm, etcd_endpoints, env, vllm_connector, vllm_roles[name])
             for name, node_id in zip(vllm_names, nodes[len(roles):])]
    urls = ray.get([w.url.remote() for w in [*workers, *vllms]])
    router = _actor("router", on_head=True).remote("router", [
        "router", "--etcd-endpoints", etcd_endpoints, *(["--host", router_host] if router_host else []),
        "--port", str(router_port), *model_args(vllm), *router_args], env)
    return Deployment(ray.get(router.url.remote()), etcd_endpoints, names, urls[:len(names)], tuple(vllm_names))


def worker_roles(num_workers: int, num_prefill: int = 0, num_decode: int = 0) -> dict[str, str]:
    """Worker actor name -> role: whole-request workers, then prefill and decode workers."""
    return {**{f"worker-{i}": "both" for i in range(num_workers)},
            **{f"worker-prefill-{i}": "prefill" for i in range(num_prefill)},
            **{f"worker-decode-{i}": "decode" for i in range(num_decode)}}


def role_args(role: str) -> list[str]:
    """`prefixpool worker` flags for a role (none for "both", the default)."""
    return [] if role == "both" else ["--role", role]


def down() -> list[str]:
    """Stop and remove every prefixpool actor, then the etcd actor's data dir; returns what was removed."""
    removed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE:
            continue
        actor = ray.get_actor(entry["name"], namespace=NAMESPACE)
        try:
            ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S + 10)  # the component drains first
        except ray.exceptions.RayError:
            pass  # already dead: killing it below is all that is left to do
        ray.kill(actor, no_restart=True)
        removed.append(entry["name"])
    if (data_dir := ray_etcd_data.remove()) is not None:
        removed.append(f"etcd data dir {data_dir}")
    return removed


def get_actor(name: str):
    return ray.get_actor(name, namespace=NAMESPACE)
