"""The names of the tiers a block can sit in: published to etcd beside each block key, priced
by the router's cost model, modelled by the replay simulator. One spelling, defined here.

    DEVICE  the KV arena the engine computes on (GPU memory where there is one)
    HOST    pinned host memory below it
    DISK    the node's local SSD below that
"""

DEVICE = "device"
HOST = "host"
DISK = "disk"
TIERS = (DEVICE, HOST, DISK)  # fastest first
