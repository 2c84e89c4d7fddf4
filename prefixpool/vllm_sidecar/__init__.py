"""A vLLM server as a prefixpool node, run beside it in our venv: vLLM's KV events (ZMQ + msgpack)
become block keys in etcd under the node's lease, its /metrics become the node's load.

Knows meta/ and store/; nothing of the router, the engine or the connector.
"""
