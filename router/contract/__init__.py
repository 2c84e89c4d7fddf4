"""Contracts between the router and the workers, owned by the router (the caller):

    worker_api   the router <-> worker wire format. The router calls it (router/worker_client.py);
                 cluster/node/http_api.py implements it.
    tokenizer    text <-> token ids. Router and engine must tokenize identically, or their block
                 keys differ; both load it from here (cluster/engine/model_source.py, router/service.py).

They live in router/ because cluster/ may import router/ and not the other way round.
"""
