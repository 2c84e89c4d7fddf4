"""One vLLM server's cached blocks, named both ways: vLLM's block hash -> prefixpool's chained key.

    BlockStored(parent=None, tokens)   key[0..n) = chain from the namespace root (salted as vLLM salted it)
    BlockStored(parent=h, tokens)      key[0..n) = chain continued from the key of h
    BlockRemoved(hashes)               the keys of those hashes
    AllBlocksCleared                   every key

A named BlockStored also says which chain it grew: the key it continues (`parent`, the namespace
root for a request's first block) and its last key (`last`), for the sidecar's pending tails.

A stored block whose parent we never learned (an event lost for good, a
subscriber that joined late) cannot be named by tokens: it is not advertised,
nor anything chained below it. Under-advertising costs a missed hit; naming a
block wrongly would cost nothing either (vLLM checks its own cache), but the
ledger never does. Returns what changed; the caller publishes it. Knows
nothing of sockets or etcd.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prefixpool.vllm_sidecar.events import (AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event,
                                            cache_salt_of, has_media)
from prefixpool.store.keys import BlockKey, Namespace, chain_from, pack_tokens

log = logging.getLogger(__name__)


class BlockSizeMismatch(ValueError):
    """vLLM stores blocks of another size than the node was told: its keys would never match."""


@dataclass(slots=True)
class Change:
    stored: list[BlockKey] = field(default_factory=list)
    removed: list[BlockKey] = field(default_factory=list)
    parent: BlockKey | None = None  # a named BlockStored's: the key its chain continues
    last: BlockKey | None = None  # ... and its chain's last key (stored now or held already)


class Ledger:
    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.keys: dict[BlockHash, BlockKey] = {}
        self.holders: dict[BlockKey, int] = {}  # vLLM hashes per key (two hashes may name one block)
        self.num_unnamed = 0  # stored blocks we could not name (unknown parent, media, other group)

    def apply(self, event: Event) -> Change:
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return Change(removed=[k for k in map(self._drop, event.block_hashes) if k is not None])
        assert isinstance(event, AllBlocksCleared)
        return self.clear()

    def clear(self) -> Change:
        removed = list(self.holders)
        self.keys.clear()
        self.holders.clear()
        return Change(removed=removed)

    def all_keys(self) -> list[BlockKey]:
        return list(self.holders)

    def _stored(self, event: BlockStored) -> Change:
        if event.block_size != self.namespace.block_size:
            raise BlockSizeMismatch(f"vLLM stores blocks of {event.block_size} tokens; this node was started "
                                    f"with block size {self.namespace.block_size}")
        parent = self._parent_key(event)
        if parent is None or has_media(event) or event.group_idx not in (None, 0):
            self.num_unnamed += len(event.block_hashes)
            return Change()
        keys = chain_from(parent, pack_tokens(event.token_ids), event.block_size)
        if len(keys) != len(event.block_hashes):
            log.warning("BlockStored with %d hashes but %d full blocks of tokens; skipped",
                        len(event.block_hashes), len(keys))
            self.num_unnamed += len(event.block_hashes)
            return Change()
        stored = []
        for block_hash, key in zip(event.block_hashes, keys):
            if block_hash in self.keys:
                continue  # already held: the same block reported again
            self.keys[block_hash] = key
            held = self.holders.get(key, 0)
            self.holders[key] = held + 1
            if not held:
                stored.append(key)
        return Change(stored=stored, parent=parent, last=keys[-1] if keys else None)

    def _parent_key(self, event: BlockStored) -> bytes | None:
        if event.parent_block_hash is not None:
            return self.keys.get(event.parent_block_hash)
        return self.namespace.for_request(cache_salt_of(event), event.lora_name).root()

    def _drop(self, block_hash: BlockHash) -> BlockKey | None:
        key = self.keys.pop(block_hash, None)
        if key is None:
            return None
        left = self.holders[key] - 1
        if left:
            self.holders[key] = left
            return None
        del self.holders[key]
        return key
