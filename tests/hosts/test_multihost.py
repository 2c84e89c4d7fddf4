"""Plain multi-host, as on real machines: etcd on host 1, the router on host 2, workers on hosts 3-5.

Every component is started with no address flag but --etcd-endpoints: each
must bind and advertise its own host's address (the one routing to etcd).
worker-3 and worker-4 serve blocks over TCP, worker-5 over UCX; fetches cross
the bridge, and every cached answer must equal the same prompt computed cold
(a fresh cache_salt).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.support.multihost import (SHARED, block_count, cached, complete, generate, node_records, router_entries,
                                     start_etcd, start_router, start_worker, wait_for_workers, wait_until)

NUM_HOSTS = 5
TRANSPORTS = {"worker-3": "tcp", "worker-4": "tcp", "worker-5": "ucx"}


@pytest.fixture(scope="module")
def plain(hosts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multihost-logs")
    etcd = start_etcd(hosts, hosts[0], logs)
    workers = {name: start_worker(hosts, hosts[i + 2], etcd, name, logs, "--transfer", transport)
               for i, (name, transport) in enumerate(TRANSPORTS.items())}
    router = start_router(hosts, hosts[1], etcd, logs)
    wait_for_workers(router.url, len(workers))
    return {"etcd": etcd, "router": router.url, "workers": {n: c.url for n, c in workers.items()}}


def test_every_component_binds_and_advertises_its_own_host(hosts, plain):
    assert plain["etcd"].startswith(hosts[0].address + ":")
    assert urlsplit(plain["router"]).hostname == hosts[1].address
    assert [entry["url"] for entry in router_entries(plain["etcd"]).values()] == [plain["router"]]
    records = node_records(plain["etcd"])
    assert sorted(records) == sorted(TRANSPORTS)
    for i, (name, transport) in enumerate(TRANSPORTS.items()):
        address = hosts[i + 2].address
        assert urlsplit(records[name]["http_url"]).hostname == address
        assert records[name]["transfer_url"].startswith(f"{transport}://{address}:")


def test_router_on_one_host_serves_workers_on_others_with_cache_hits(plain):
    prompt = SHARED + "Where do cached blocks live?"
    first = complete(plain["router"], prompt, salt="hosts")
    again = complete(plain["router"], prompt, salt="hosts")
    cold = complete(plain["router"], prompt, salt="hosts-cold")
    assert cached(first) == 0 and cached(cold) == 0
    assert cached(again) >= len(prompt) // 16 * 16 - 16
    assert again["choices"][0]["text"] == cold["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.mark.parametrize("holder, fetcher", [("worker-3", "worker-4"), ("worker-5", "worker-3")],
                         ids=["tcp", "ucx"])
def test_cross_host_fetch_gives_the_cold_answer(plain, holder, fetcher):
    prompt = SHARED * 2 + f"A question fetched from {holder}."
    salt = f"fetch-{holder}"
    workers, records = plain["workers"], node_records(plain["etcd"])
    generate(workers[holder], prompt, salt)
    num_blocks = len(prompt) // 16
    wait_until(lambda: block_count(plain["etcd"], holder) >= num_blocks, f"{holder}'s blocks in etcd")
    plan = {"peer": holder, "transfer_url": records[holder]["transfer_url"], "start": 0, "end": num_blocks}
    tokens, usage = generate(workers[fetcher], prompt, salt, fetch=plan)
    cold_tokens, cold_usage = generate(workers[fetcher], prompt, salt + "-cold")
    assert usage["fetched_tokens"] == num_blocks * 16 and usage["fetched_bytes"] > 0
    assert cold_usage["fetched_tokens"] == 0 and cold_usage["local_hit_tokens"] == 0
    assert tokens == cold_tokens
