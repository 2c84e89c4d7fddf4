"""Contracts between the router and the workers, owned by the router (the caller):

    worker_api   the router <-> worker wire format. The router calls it (router/worker_client.py);
                 cluster/node/http_api.py implements it.
    tokenizer    text <-> token ids. Router and engine must tokenize identically, or their block
                 keys differ; both load it from here (cluster/engine/model_source.py, router/service.py).
    drain        the drain gate both keep on SIGTERM: a draining side answers new work with a 503 the
                 caller retries elsewhere and ends an admitted stream only with an error event
                 (cluster/node/http_api.py and router/http.py).

They live in router/ because cluster/ may import router/ and not the other way round.
"""
