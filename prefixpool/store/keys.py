"""Block identity: 16-byte chained block keys and the namespace root they start from.

    key[-1] = xxh3_128(namespace bytes)
    key[i]  = xxh3_128(key[i-1] || tokens[i*B:(i+1)*B] as little-endian int32)

Only full blocks get keys. Keys are computed once at the edge (router, worker,
trace replayer) and passed around as opaque values; nothing downstream hashes
tokens again. Knows nothing of pools, tensors or the network.
"""

from __future__ import annotations

import json
import operator
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Iterable, NewType, Sequence

import numpy as np
import xxhash

HASH_SCHEME_VERSION = 1
KEY_BYTES = 16

_digest = xxhash.xxh3_128_digest
TOKEN_DTYPE = np.dtype("<i4")  # how the hash reads token ids
_INT32 = TOKEN_DTYPE
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# A 16-byte chained block hash. A NewType, not a subclass: wrapping each key in
# a Python-level constructor would cost more than hashing the block.
BlockKey = NewType("BlockKey", bytes)

# What the chain loop reads (C's `y*`): any object with a C-contiguous buffer. Python 3.11 has no
# collections.abc.Buffer; these are the kinds callers pass.
Buffer = bytes | bytearray | memoryview | np.ndarray


def key_from_hex(text: str) -> BlockKey:
    raw = bytes.fromhex(text)
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a BlockKey is {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(raw)


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two blocks of KV to be interchangeable."""

    model: str
    revision: str = "main"
    dtype: str = "float32"
    block_size: int = 16
    scheme_version: int = HASH_SCHEME_VERSION
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def encode(self) -> bytes:
        """Canonical bytes: sorted-key compact JSON, so every process agrees."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def root(self) -> BlockKey:
        return self._root

    @cached_property
    def _root(self) -> BlockKey:  # once per namespace: every routing decision compares against it
        return BlockKey(_digest(self.encode()))

    def with_salt(self, cache_salt: str) -> "Namespace":
        return Namespace(**{**asdict(self), "cache_salt": cache_salt})

    def for_request(self, cache_salt: str | None, lora_name: str | None) -> "Namespace":
        """The namespace vLLM's own hashing separates a request into: its tenant's salt, its LoRA adapter."""
        namespace = self.with_salt(cache_salt or "")
        if lora_name is None:
            return namespace
        return Namespace(**{**asdict(namespace), "model": f"{namespace.model}+lora:{lora_name}"})


def pack_tokens(tokens: Sequence[int] | Buffer) -> bytes:
    """All tokens as little-endian int32 in one bulk conversion (bytes-likes are taken as packed already)."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return buffer_bytes(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == _INT32:
            return tokens.tobytes()
        if tokens.size and (tokens.min() < _INT32_MIN or tokens.max() > _INT32_MAX):
            raise ValueError("token ids must fit in int32")
        return tokens.astype(_INT32).tobytes()
    try:
        return np.array(tokens, dtype=_INT32).tobytes()
    except OverflowError as err:
        raise ValueError("token ids must fit in int32") from err


def chain(tokens: Sequence[int] | Buffer, namespace: Namespace) -> list[BlockKey]:
    """Keys of every full block of `tokens`, chained from the namespace root."""
    return chain_from(namespace.root(), pack_tokens(tokens), namespace.block_size)


def buffer_bytes(data: Buffer) -> bytes:
    """The bytes of a C-contiguous buffer, as C's `y*` reads them: bytes, bytearray, memoryview, a numpy array
    (its raw bytes, whatever its dtype). TypeError for what has no buffer (str, list), as the C loop raises."""
    if isinstance(data, bytes):
        return data
    view = memoryview(data)
    if not view.c_contiguous:
        raise BufferError("the buffer is not C-contiguous")
    return view.tobytes()


def chain_from_python(parent: Buffer, packed: Buffer, block_size: int) -> list[BlockKey]:
    """The chain loop in plain Python: takes what the C loop takes, gives the same keys, raises where it raises.

    `parent` and `packed` are any C-contiguous buffers (the router passes its int32 token array itself);
    `packed` is read as raw bytes, so an int32 array and its `tobytes()` give the same keys."""
    parent, packed, block_size = buffer_bytes(parent), buffer_bytes(packed), operator.index(block_size)
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent must be {KEY_BYTES} bytes")
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    step = block_size * 4
    end = len(packed) - len(packed) % step
    keys: list[BlockKey] = []
    append, digest = keys.append, _digest
    for offset in range(0, end, step):
        parent = digest(parent + packed[offset : offset + step])
        append(parent)
    return keys


try:  # the same loop in C (setup.py builds it where libxxhash-dev is present)
    from prefixpool.store._chain import chain_from as _chain_from_c
except ImportError:  # pragma: no cover - depends on the build machine
    _chain_from_c = None

chain_from = _chain_from_c or chain_from_python
"""Continue a chain from `parent` over packed int32 tokens (full blocks only)."""


def chain_ids(ids: Iterable[int], namespace: Namespace) -> list[BlockKey]:
    """Keys for opaque integer block ids (the Mooncake traces' chained `hash_ids`).

    Each trace id already names a whole prefix, so the key is the id hashed
    under the namespace root; equal ids give equal keys, in any process.
    """
    root = namespace.root()
    return [BlockKey(_digest(root + int(i).to_bytes(8, "little", signed=True))) for i in ids]
