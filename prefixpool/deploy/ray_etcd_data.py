"""The etcd actor's data dir on a Ray cluster: recorded where `ray down` finds it, removed in any actor state.

    record(path, node_id)   at `ray up`: in Ray's own key-value store (the GCS), not in the actor,
                            so a dead, restarting or never-restarted etcd actor leaves it findable
    remove()                at `ray down`, after the actors are killed: a task on that node waits
                            until no process there holds a file under the path open (etcd dies with
                            its supervisor, and Ray kills actors asynchronously), removes the dir,
                            and forgets the record; returns the path removed

The dir outlives the actor on purpose (a restarted etcd actor keeps its data),
so the actor cannot own its removal. Knows nothing of etcd's flags or the other actors.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

KV_NAMESPACE = "prefixpool"
KV_KEY = "etcd-data-dir"
RELEASE_TIMEOUT_S = 60.0  # etcd exits on its supervisor's death signal; a stuck one does not block `down` forever


def record(path: str, node_id: str) -> None:
    internal_kv._internal_kv_put(KV_KEY, json.dumps({"path": path, "node_id": node_id}), namespace=KV_NAMESPACE)


def recorded() -> tuple[str, str] | None:
    """(path, node id) of the etcd actor's data dir, if `ray up` started one."""
    raw = internal_kv._internal_kv_get(KV_KEY, namespace=KV_NAMESPACE)
    if raw is None:
        return None
    entry = json.loads(raw)
    return entry["path"], entry["node_id"]


def holders(path: str) -> list[int]:
    """Pids of this machine's processes with a file under `path` open (etcd's WAL and database)."""
    prefix, found = os.path.join(os.path.realpath(path), ""), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd).startswith(prefix) for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return found


def _remove_when_released(path: str) -> bool:
    """Wait (bounded) until nothing holds the dir open, then remove it; whether it is gone."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while holders(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def remove() -> str | None:
    """Remove the recorded data dir on its node; the path if it is gone now, None if none was recorded."""
    entry = recorded()
    if entry is None:
        return None
    path, node_id = entry
    task = ray.remote(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    if not ray.get(task(_remove_when_released).remote(path)):
        raise RuntimeError(f"etcd data dir {path} is still there on node {node_id}")
    internal_kv._internal_kv_del(KV_KEY, namespace=KV_NAMESPACE)
    return path
