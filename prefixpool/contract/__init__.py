"""Contracts between the router and the workers:

    worker_api   the router <-> worker wire format. The router calls it (prefixpool/router/worker_client.py);
                 prefixpool/worker/http_api.py implements it.
    drain        the drain gate both keep on SIGTERM: a draining side answers new work with a 503 the
                 caller retries elsewhere and ends an admitted stream only with an error event
                 (prefixpool/worker/http_api.py and prefixpool/router/http.py).

Below the router, the worker and the engine, which all use them. Imports only store/ (keys).
"""
