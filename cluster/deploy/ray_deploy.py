"""Deploying on a Ray cluster: etcd, one worker actor per GPU, and the router, as named actors.

    prefixpool ray up --workers N --address auto|HOST:PORT|ray://HOST:10001
    prefixpool ray down

Each actor is a thin supervisor around the same process `prefixpool up` runs
(`prefixpool worker|router|etcd`), so Ray adds placement and restarts and
nothing else: a worker actor asks for one GPU where the cluster has GPUs,
workers spread across nodes, the router and etcd sit on the head node.
Actors restart on death (max_restarts); a restarted worker re-registers in
etcd under a new lease and the router learns of it through its mirror. The
child dies with its actor (PR_SET_PDEATHSIG), so a killed actor leaves no
orphan. Knows nothing of engines or routing.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.deploy.processes import STOP_TIMEOUT_S, Child, python_argv, spawn

NAMESPACE = "prefixpool"
class ProcessActor:
    """Runs one prefixpool component as a child process for as long as the actor lives."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log_dir = Path(tempfile.mkdtemp(prefix=f"prefixpool-{name}-"))
        self.child: Child = spawn(name, python_argv(*args), log_dir, env)

    def url(self) -> str:
        return self.child.url

    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()

    def stop(self) -> None:
        """SIGTERM the component: it drains (finishes what it admitted) and exits, as on Kubernetes."""
        self.child.stop()


@dataclass(frozen=True)
class Deployment:
    router_url: str
    etcd_endpoints: str
    worker_names: list[str]


def _head_node_id() -> str:
    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def _actor(name: str, *, on_head: bool = False, num_gpus: float = 0, spread: bool = False):
    strategy = NodeAffinitySchedulingStrategy(_head_node_id(), soft=False) if on_head else ("SPREAD" if spread else "DEFAULT")
    return ray.remote(ProcessActor).options(
        name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=-1, max_task_retries=-1,
        num_cpus=0, num_gpus=num_gpus, scheduling_strategy=strategy)


def up(num_workers: int, *, etcd_endpoints: str = "", router_port: int = 8000, router_host: str = "127.0.0.1",
       worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Deployment:
    """Deploy on the Ray cluster `ray.init` connected to; returns where it serves."""
    env = dict(env or {})
    if not etcd_endpoints:
        etcd = _actor("etcd", on_head=True).remote("etcd", ["etcd"], env)
        etcd_endpoints = ray.get(etcd.url.remote())
    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= num_workers else 0
    names = [f"worker-{i}" for i in range(num_workers)]
    workers = [
        _actor(name, num_gpus=gpus, spread=True).remote(
            name, ["worker", "--node-id", name, "--etcd-endpoints", etcd_endpoints, *worker_args], env)
        for name in names
    ]
    ray.get([w.url.remote() for w in workers])
    router = _actor("router", on_head=True).remote("router", [
        "router", "--etcd-endpoints", etcd_endpoints, "--host", router_host, "--port", str(router_port), *router_args], env)
    return Deployment(ray.get(router.url.remote()), etcd_endpoints, names)


def down() -> list[str]:
    """Stop and remove every prefixpool actor; returns the names removed."""
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
    return removed


def get_actor(name: str):
    return ray.get_actor(name, namespace=NAMESPACE)
