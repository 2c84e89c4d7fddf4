"""How processes start: the `prefixpool` CLI, per-process settings, the local launcher, the etcd
server, the Ray deployment, and the demo. The only wing that may import all the others.
"""
