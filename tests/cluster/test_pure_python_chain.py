"""A cluster on a machine without the compiled chain loop: every process hashes in pure Python.

Each process of the cluster (2 workers and a router, spawned by LocalCluster) starts with a
sitecustomize that refuses `prefixpool.store._chain` (prefixpool.testing.refuse_c_chain), as a
machine without libxxhash-dev or a compiler would. The router hashes its int32 token arrays with
the Python loop; the answers, the cache hits and the keys in etcd must be those of the C loop.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import openai
import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.model.source import cache_namespace, model_config
from prefixpool.store import keys
from prefixpool.store.keys import chain
from prefixpool.testing.refuse_c_chain import loaded_c_chain, refusing_env, refusing_pythonpath, write_refusal
from tests.cluster.test_e2e import _wait_for_workers
from tests.conftest import etcdctl

WORKER_ARGS = ("--lease-ttl-s", "3", "--num-blocks", "512", "--max-batch-size", "8")
SHARED = "You are a careful assistant. Answer in one short sentence, using plain words only. " * 2
TOKENS = [(7 * i + 3) % 250 + 1 for i in range(16 * 5 + 3)]  # 5 full blocks of ids inside the byte vocabulary
PROBE = """
import json, numpy as np
from prefixpool.store import keys
from prefixpool.store.keys import Namespace, chain, chain_from
ns = Namespace("probe")
ids = np.arange(1, 16 * 9 + 5, dtype=np.int32)
print(json.dumps({"c": keys._chain_from_c is not None, "loop": chain_from.__name__,
                  "list": [k.hex() for k in chain(ids.tolist(), ns)],
                  "int32": [k.hex() for k in chain_from(ns.root(), ids, 16)],
                  "int64": [k.hex() for k in chain(ids.astype(np.int64), ns)]}))
"""


@pytest.fixture(scope="module")
def refusal(tmp_path_factory):
    return write_refusal(tmp_path_factory.mktemp("no-c-chain"))


@pytest.fixture(scope="module")
def cluster(refusal):
    env = {"PYTHONPATH": refusing_pythonpath(refusal)}
    with LocalCluster(num_workers=2, worker_args=WORKER_ARGS, env=env) as running:
        _wait_for_workers(running.router_url, 2)
        yield running


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client, prompt, salt: str, max_tokens: int = 12):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"cache_salt": salt})


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_a_refused_process_hashes_in_python_and_gets_the_keys_of_this_one(refusal):
    probe = subprocess.run([sys.executable, "-c", PROBE], env=refusing_env(refusal), capture_output=True, text=True,
                           check=True)
    seen = json.loads(probe.stdout)
    assert seen["c"] is False and seen["loop"] == "chain_from_python"
    ids = np.arange(1, 16 * 9 + 5, dtype=np.int32)
    ns = keys.Namespace("probe")
    here = [k.hex() for k in chain(ids.tolist(), ns)]  # the C loop wherever it is built (tests/unit requires it)
    assert len(here) == 9 and seen["list"] == seen["int32"] == seen["int64"] == here


def test_no_process_of_the_cluster_loaded_the_c_loop(cluster):
    assert loaded_c_chain(os.getpid()) == (keys._chain_from_c is not None)  # the check sees it where it is
    children = [*cluster.workers.values(), *cluster.routers.values()]
    assert len(children) == 3
    assert not any(loaded_c_chain(child.pid) for child in children)


def test_shared_prefix_is_reused_and_answers_equal_cold(client):
    prompt = SHARED + "What is a prefix cache?"
    first = complete(client, prompt, salt="py")
    again = complete(client, prompt + " Explain briefly.", salt="py")
    cold = complete(client, prompt + " Explain briefly.", salt="py-cold-oracle")
    assert cached(first) == 0 and cached(cold) == 0
    assert cached(again) >= len(SHARED) // 16 * 16 - 16
    assert again.choices[0].text == cold.choices[0].text
    chat = [{"role": "user", "content": SHARED + "Say hi."}]
    answers = [client.chat.completions.create(model="tiny", messages=chat, max_tokens=6, temperature=0,
                                              extra_body={"cache_salt": "py-chat"}) for _ in range(2)]
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_keys_in_etcd_are_the_c_loops_keys(cluster, client):
    assert complete(client, TOKENS, salt="py-etcd").usage.prompt_tokens == len(TOKENS)
    namespace = cache_namespace(model_config("tiny", ""), "float32", 16).with_salt("py-etcd")
    expected = {k.hex() for k in chain(TOKENS, namespace)}  # this process: the C loop where built
    assert len(expected) == 5
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not expected <= (published := _published(cluster)):
        time.sleep(0.2)
    assert expected <= published
    assert cached(complete(client, TOKENS, salt="py-etcd")) == 5 * 16


def _published(cluster) -> set[str]:
    listing = etcdctl(cluster.etcd, "get", "--prefix", "--keys-only", "/prefixpool/default/blocks/")
    return {line.split("/")[4] for line in listing.split() if line}


def test_the_refusal_still_runs_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    env = {**os.environ, "PYTHONPATH": refusing_pythonpath(write_refusal(tmp_path / "refuse"), str(other))}
    code = "import os; from prefixpool.store import keys; print(keys._chain_from_c, os.environ.get('SHADOWED_RAN'))"
    probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.split() == ["None", "yes"]
