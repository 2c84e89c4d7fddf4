"""vLLM servers as prefixpool nodes: their KV events become block keys in etcd (the sidecar)."""
