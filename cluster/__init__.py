"""Processes and deployments, in five wings (one concern each; tests/test_layering.py checks them):

    engine/   the reference engine: model, config, checkpoints, sequences, batches, scheduler, sampling
    meta/     the etcd control plane: client, key layout, membership (lease), publisher, mirror
    node/     one worker node: the worker service, its HTTP API, its tier chain, its transfer source
    replay/   Mooncake-format traces: simulated and live replay, reports
    deploy/   how processes start: CLI, settings, local launcher, etcd server, Ray, demo

Sits on top and may import everything; nothing imports `cluster`.
"""
