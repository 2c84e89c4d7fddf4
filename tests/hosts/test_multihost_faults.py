"""Faults across hosts: a link cut mid-fetch, a worker and a router cut off from etcd, a slow link.

    host 1: etcd          host 2: router-fast, router-slow (the same but told the link is 2 Mbit/s)
    host 3: worker-a      host 4: worker-b          (leases of 3 s; fetch deadline 8 s)

Links are cut with `ip link set ... down` (a host off the bridge) or
blackhole routes (two hosts apart, both reachable from everyone else), and
shaped with tc tbf. Every answer is compared with the same prompt computed
cold (a fresh cache_salt).
"""

from __future__ import annotations

import threading

import pytest

from tests.support.multihost import (SHARED, block_count, cached, complete, generate, get_json, node_records, post_json,
                                     start_etcd, start_router, start_worker, wait_until)

NUM_HOSTS = 4
TTL_S = 3
SLOW_MBIT = 2


@pytest.fixture(scope="module")
def faults(hosts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("faults-logs")
    etcd = start_etcd(hosts, hosts[0], logs)
    workers = {name: start_worker(hosts, hosts[i + 2], etcd, name, logs, "--lease-ttl-s", str(TTL_S),
                                  "--fetch-timeout-s", "8").url
               for i, name in enumerate(["worker-a", "worker-b"])}
    routers = {"fast": start_router(hosts, hosts[1], etcd, logs).url,
               "slow": start_router(hosts, hosts[1], etcd, logs, "--link-bytes-per-s", str(SLOW_MBIT * 1e6 / 8)).url}
    for url in routers.values():
        wait_until(lambda url=url: get_json(f"{url}/healthz")["workers"] == 2, "both workers at the router")
    return {"etcd": etcd, "workers": workers, "routers": routers}


def prime(faults, worker: str, prompt: str, salt: str) -> int:
    """Compute `prompt` on `worker`; returns its full blocks once etcd lists them all."""
    generate(faults["workers"][worker], prompt, salt)
    num_blocks = len(prompt) // 16
    wait_until(lambda: block_count(faults["etcd"], worker) >= num_blocks, f"{worker}'s blocks in etcd")
    return num_blocks


def fetch_plan(faults, holder: str, num_blocks: int) -> dict:
    record = node_records(faults["etcd"])[holder]
    return {"peer": holder, "transfer_url": record["transfer_url"], "start": 0, "end": num_blocks}


def test_link_cut_mid_fetch_keeps_the_intact_prefix_and_recomputes_the_rest(hosts, faults):
    prompt = SHARED * 3 + "Cut while fetching."
    num_blocks = prime(faults, "worker-a", prompt, "cut")
    plan = fetch_plan(faults, "worker-a", num_blocks)
    hosts.shape(hosts[2], mbit=1)  # ~0.5 MB of blocks now take seconds to cross: long enough to cut mid-way
    answer = {}
    fetching = threading.Thread(target=lambda: answer.update(
        zip(("tokens", "usage"), generate(faults["workers"]["worker-b"], prompt, "cut", fetch=plan))))
    try:
        fetching.start()
        wait_until(lambda: hosts.sent_bytes(hosts[2]) > 100_000, "a part of the prefix to cross", pause_s=0.05)
        hosts.link_down(hosts[2])
        fetching.join(120)
    finally:
        hosts.link_up(hosts[2])
        hosts.unshape(hosts[2])
    usage = answer["usage"]
    assert 0 < usage["local_hit_tokens"] < num_blocks * 16, usage  # the blocks that arrived intact were kept
    assert usage["fetched_tokens"] == 0 and usage["computed_tokens"] > 16, usage
    cold_tokens, _ = generate(faults["workers"]["worker-b"], prompt, "cut-cold")
    assert answer["tokens"] == cold_tokens


def test_worker_cut_off_from_etcd_past_its_lease_vanishes_then_republishes(hosts, faults):
    etcd = faults["etcd"]
    wait_until(lambda: "worker-a" in node_records(etcd), "worker-a registered (again)")
    num_blocks = prime(faults, "worker-a", SHARED + "Partitioned worker.", "partition")
    hosts.partition(hosts[0], hosts[2])
    try:
        wait_until(lambda: "worker-a" not in node_records(etcd) and block_count(etcd, "worker-a") == 0,
                   "worker-a's lease to expire and its blocks to vanish")
        for url in faults["routers"].values():
            wait_until(lambda url=url: get_json(f"{url}/healthz")["workers"] == 1, "the router to drop worker-a")
    finally:
        hosts.heal(hosts[0], hosts[2])
    wait_until(lambda: "worker-a" in node_records(etcd) and block_count(etcd, "worker-a") >= num_blocks,
               "worker-a to register again and re-publish its blocks")
    for url in faults["routers"].values():
        wait_until(lambda url=url: get_json(f"{url}/healthz")["workers"] == 2, "the router to see worker-a again")


def route(router: str, prompt: str, salt: str) -> dict[str, dict]:
    status, body = post_json(f"{router}/v1/route", {"model": "tiny", "prompt": prompt, "cache_salt": salt})
    assert status == 200, body
    return {c["worker"]: c for c in body["candidates"]}


def test_router_cut_off_from_etcd_serves_from_its_mirror_and_resyncs(hosts, faults):
    router = faults["routers"]["fast"]
    prompt = SHARED + "Asked before and during the partition."
    first = complete(router, prompt, salt="mirror")
    hosts.partition(hosts[0], hosts[1])
    try:
        during = complete(router, prompt, salt="mirror")
        assert cached(during) > 0 and during["choices"][0]["text"] == first["choices"][0]["text"]
        unseen = SHARED + "Computed while the router could not see etcd."
        prime(faults, "worker-b", unseen, "mirror-unseen")  # etcd has it; the partitioned router cannot know yet
    finally:
        hosts.heal(hosts[0], hosts[1])
    wait_until(lambda: route(router, unseen, "mirror-unseen")["worker-b"]["local_blocks"] >= len(unseen) // 16,
               "the router's mirror to resync with etcd")
    cold = complete(router, prompt, salt="mirror-cold")
    assert cold["choices"][0]["text"] == first["choices"][0]["text"]


def test_slow_link_makes_the_router_recompute_where_a_fast_one_fetches(hosts, faults):
    hosts.shape(hosts[2], mbit=SLOW_MBIT)
    try:
        prompt = SHARED * 2 + "Fetch or recompute?"
        num_blocks = prime(faults, "worker-a", prompt, "link")
        for url in faults["routers"].values():
            wait_until(lambda url=url: route(url, prompt, "link")["worker-a"]["local_blocks"] >= num_blocks,
                       "the router to index worker-a's blocks")
        slow = route(faults["routers"]["slow"], prompt, "link")["worker-b"]
        fast = route(faults["routers"]["fast"], prompt, "link")["worker-b"]
        assert slow["fetch_from"] is None and slow["transfer_s"] == 0.0, slow  # recompute beats a 2 Mbit/s fetch
        assert fast["fetch_from"] == "worker-a" and fast["fetch_blocks"] == num_blocks, fast
        plan = fetch_plan(faults, "worker-a", num_blocks)
        tokens, usage = generate(faults["workers"]["worker-b"], prompt, "link", fetch=plan)  # it still works, slowly
        assert usage["fetched_tokens"] == num_blocks * 16
    finally:
        hosts.unshape(hosts[2])
    cold_tokens, _ = generate(faults["workers"]["worker-b"], prompt, "link-cold")
    assert tokens == cold_tokens
