"""`ray down` removes the etcd actor's data dir whatever state the actor is in.

The data dir outlives the etcd actor on purpose (a restarted actor keeps its data), so
`down` finds it by the path `up` recorded, not through the actor: here the actor's
process is SIGKILLed right before `down` (Ray is restarting it), or the actor is
killed for good first (Ray no longer lists it). Each time nothing is left: no
data dir, no etcd process, no actor.
"""

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import ray

from prefixpool.deploy import ray_deploy, ray_etcd_data
from prefixpool.deploy.etcd_server import free_port
from tests.ray.test_ray import _alive, private_tmpdir, wait_for


@pytest.fixture(scope="module")
def ray_cluster():
    tmp, ray_dir = tempfile.mkdtemp(prefix="pp-rd-tmp-"), tempfile.mkdtemp(prefix="pp-rd-")  # short: Ray's socket paths
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    with private_tmpdir(tmp):
        ray.init(num_cpus=2, include_dashboard=False, namespace=ray_deploy.NAMESPACE, log_to_driver=False,
                 _temp_dir=ray_dir)
    try:
        yield tmp
    finally:
        ray_deploy.down()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def deploy_etcd() -> tuple[Path, int, int]:
    """`ray up` with no workers; (etcd's data dir, the etcd actor's pid, etcd's own pid)."""
    ray_deploy.up(0, router_port=0, etcd_port=free_port())
    data_dir = Path(ray_etcd_data.recorded()[0])
    assert (data_dir / "member-data").is_dir()  # etcd wrote its data there
    actor = ray_deploy.get_actor("etcd")
    supervisor, etcd = ray.get([actor.supervisor_pid.remote(), actor.pid.remote()])
    return data_dir, supervisor, etcd


def assert_nothing_left(removed: list[str], data_dir: Path, etcd: int) -> None:
    assert f"etcd data dir {data_dir}" in removed
    assert not data_dir.exists()
    assert not _alive(etcd)
    assert ray_etcd_data.recorded() is None
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ray_deploy.NAMESPACE]


def test_down_right_after_the_etcd_actor_process_is_killed(ray_cluster):
    data_dir, supervisor, etcd = deploy_etcd()
    os.kill(supervisor, signal.SIGKILL)  # Ray restarts the actor: it is dead or restarting when down runs
    removed = ray_deploy.down()
    assert {"etcd", "router"} <= set(removed)
    assert_nothing_left(removed, data_dir, etcd)


def test_down_after_the_etcd_actor_is_gone_for_good(ray_cluster):
    data_dir, supervisor, etcd = deploy_etcd()
    ray.kill(ray_deploy.get_actor("etcd"), no_restart=True)
    wait_for(lambda: not _alive(supervisor) and not _alive(etcd))
    removed = ray_deploy.down()
    assert "router" in removed
    assert_nothing_left(removed, data_dir, etcd)
