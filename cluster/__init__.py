"""Processes and deployments: engine, worker, etcd metadata, launcher and CLI.

Sits on top and may import everything; nothing imports `cluster`.
"""
