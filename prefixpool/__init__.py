"""prefixpool: a distributed prefix-cache pool for LLM serving.

Wings, bottom to top along a request's path (tests/unit/test_layering.py checks the order, transitively):

    store/           block keys, one node's blocks, the KV arena and its tiers        imports nothing of ours
    transfer/        moving KV blocks between nodes: one framed protocol over TCP and UCX
    meta/            etcd: client, key layout, membership, publishers, mirror, block index
    contract/        router <-> worker wire format and the drain gate
    model/           model files: config, config.json, tokenizer, chat template
    node/            the node core our worker and the vLLM connector share
    engine/          the reference engine: a Llama-style decoder on the paged arena, its scheduler
    router/          the cache-aware OpenAI-compatible router and its policies
    worker/          one worker process: engine + node core + the internal HTTP API
    vllm_sidecar/    a vLLM server as a node: its KV events become block keys in etcd
    vllm_connector/  vLLM's KV connector: loads and saves prefix blocks inside vLLM's process
    replay/          Mooncake-format trace replay, simulated and live
    deploy/          how processes start: the `prefixpool` CLI, launcher, etcd server, Ray
    testing/         helpers for tests and benchmarks: chaos clients and faults, test hosts, tiny models

Nothing imports deploy/ or testing/ but the ones above them (testing/ may use deploy/).
"""
