"""vLLM's KV connector (`KVConnectorBase_V1`), loaded inside vLLM's process:

    --kv-transfer-config '{"kv_connector": "PrefixPoolConnector",
                           "kv_connector_module_path": "prefixpool.vllm_connector.connector", ...}'

It loads prefix blocks from the pool (the node's own tiers, then peers over transfer/) and saves new
blocks into it. Installed into vLLM's venv without our dependencies, so it imports nothing of the
router, aiohttp's server or Ray (tests/unit/test_layering.py checks the whole import closure).
"""
