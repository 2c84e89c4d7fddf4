"""Where things live in etcd, in one place (DESIGN.md):

    /prefixpool/<ns>/nodes/<node_id>             -> msgspec JSON NodeRecord   (node lease)
    /prefixpool/<ns>/blocks/<key_hex>/<node_id>  -> tier, ascii               (node lease)
    /prefixpool/<ns>/routers/<router_id>         -> msgspec JSON RouterLoad   (router lease)

Builds keys and parses them back; a key that does not parse is foreign (None).
Knows nothing of the client library or of what the records mean.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixpool.store.keys import KEY_BYTES, BlockKey, Namespace

ROOT = "/prefixpool"


def namespace_id(namespace: Namespace) -> str:
    """The <ns> path segment for a cache namespace: its root hash, so unrelated models never mix."""
    return namespace.root().hex()


@dataclass(frozen=True)
class BlockEntry:
    key: BlockKey
    node_id: str


@dataclass(frozen=True)
class Layout:
    ns: str

    def __post_init__(self) -> None:
        if not self.ns or "/" in self.ns:
            raise ValueError(f"namespace segment must be non-empty without '/', got {self.ns!r}")

    @property
    def prefix(self) -> bytes:
        return f"{ROOT}/{self.ns}/".encode()

    @property
    def nodes_prefix(self) -> bytes:
        return self.prefix + b"nodes/"

    @property
    def blocks_prefix(self) -> bytes:
        return self.prefix + b"blocks/"

    @property
    def routers_prefix(self) -> bytes:
        return self.prefix + b"routers/"

    def router_key(self, router_id: str) -> bytes:
        return self.routers_prefix + router_id.encode()

    def parse_router(self, raw: bytes) -> str | None:
        if not raw.startswith(self.routers_prefix):
            return None
        router_id = raw[len(self.routers_prefix) :].decode("utf-8", "replace")
        return router_id if router_id and "/" not in router_id else None

    def node_key(self, node_id: str) -> bytes:
        return self.nodes_prefix + node_id.encode()

    def block_key(self, key: BlockKey, node_id: str) -> bytes:
        return self.blocks_prefix + key.hex().encode() + b"/" + node_id.encode()

    def parse_node(self, raw: bytes) -> str | None:
        if not raw.startswith(self.nodes_prefix):
            return None
        node_id = raw[len(self.nodes_prefix) :].decode("utf-8", "replace")
        return node_id if node_id and "/" not in node_id else None

    def parse_block(self, raw: bytes) -> BlockEntry | None:
        if not raw.startswith(self.blocks_prefix):
            return None
        hex_key, _, node = raw[len(self.blocks_prefix) :].partition(b"/")
        if len(hex_key) != 2 * KEY_BYTES or not node or b"/" in node:
            return None
        try:
            return BlockEntry(BlockKey(bytes.fromhex(hex_key.decode("ascii"))), node.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return None
