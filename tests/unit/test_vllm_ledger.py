"""vLLM's KV events -> prefixpool keys, without vLLM: the decoder and the ledger, step by step.

The integration tests (test_vllm.py) check the same against a real vLLM; these
pin the rules (chaining, salt, unknown parents, shared keys, clears) quickly.
"""

import msgpack
import pytest

from prefixpool.vllm_sidecar.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, decode_batch
from prefixpool.vllm_sidecar.ledger import BlockSizeMismatch, Ledger
from prefixpool.store.keys import Namespace, chain

B = 4
NS = Namespace(model="m", dtype="float32", block_size=B)
TOKENS = list(range(1, 25))  # 6 blocks


def stored(hashes, parent, tokens, extra=None):
    return BlockStored(hashes, parent, tokens, B, extra_keys=extra)


def check(ledger: Ledger) -> None:
    """Integrity: every key is held by exactly the hashes that map to it."""
    counts = {}
    for key in ledger.keys.values():
        counts[key] = counts.get(key, 0) + 1
    assert counts == ledger.holders


def test_a_chain_in_two_events_gives_the_keys_of_the_whole_prompt():
    ledger = Ledger(NS)
    first = ledger.apply(stored([10, 11], None, TOKENS[:8]))
    second = ledger.apply(stored([12, 13, 14], 11, TOKENS[8:20]))
    check(ledger)
    assert first.stored + second.stored == chain(TOKENS[:20], NS)
    assert set(ledger.all_keys()) == set(chain(TOKENS[:20], NS))


def test_the_cache_salt_vllm_hashed_enters_the_namespace():
    ledger = Ledger(NS)
    change = ledger.apply(stored([1, 2], None, TOKENS[:8], extra=[("tenant-a",), None]))
    assert change.stored == chain(TOKENS[:8], NS.with_salt("tenant-a"))
    assert change.stored != chain(TOKENS[:8], NS)


def test_blocks_below_an_unknown_parent_or_with_media_are_not_named():
    ledger = Ledger(NS)
    assert ledger.apply(stored([5, 6], 999, TOKENS[:8])).stored == []
    assert ledger.apply(stored([7], None, TOKENS[:4], extra=[(("mm-hash", 0),)])).stored == []
    assert ledger.apply(stored([8], 6, TOKENS[8:12])).stored == []  # its parent was never named either
    assert ledger.num_unnamed == 4 and ledger.all_keys() == []
    check(ledger)


def test_removal_publishes_a_key_only_when_no_hash_holds_it_any_more():
    ledger = Ledger(NS)
    keys = ledger.apply(stored([1, 2], None, TOKENS[:8])).stored
    # vLLM may hold the same tokens under a second hash (e.g. a block recomputed before the old one was freed)
    again = ledger.apply(stored([3], None, TOKENS[:4]))
    assert again.stored == []
    check(ledger)
    assert ledger.apply(BlockRemoved([1])).removed == []
    assert ledger.apply(BlockRemoved([3])).removed == [keys[0]]
    assert ledger.apply(BlockRemoved([2, 404])).removed == [keys[1]]
    assert ledger.all_keys() == [] and ledger.keys == {}
    check(ledger)


def test_a_block_reported_twice_is_stored_once():
    ledger = Ledger(NS)
    assert len(ledger.apply(stored([1], None, TOKENS[:4])).stored) == 1
    assert ledger.apply(stored([1], None, TOKENS[:4])).stored == []
    assert ledger.holders == {chain(TOKENS[:4], NS)[0]: 1}


def test_all_blocks_cleared_removes_everything():
    ledger = Ledger(NS)
    keys = ledger.apply(stored([1, 2, 3], None, TOKENS[:12])).stored
    assert sorted(ledger.apply(AllBlocksCleared()).removed) == sorted(keys)
    assert ledger.all_keys() == [] and ledger.keys == {}


def test_another_block_size_is_refused():
    with pytest.raises(BlockSizeMismatch):
        Ledger(NS).apply(BlockStored([1], None, TOKENS[:8], 8))


def test_a_batch_decodes_from_vllm_wire_format():
    # vLLM 0.32: the batch is an array, each event a map tagged by "type"; unknown fields are ignored.
    payload = msgpack.packb([1.5, [
        {"type": "BlockStored", "block_hashes": [7, b"\x01" * 32], "parent_block_hash": None,
         "token_ids": TOKENS[:8], "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None,
         "extra_keys": [None, None], "group_idx": 0, "kv_cache_spec_kind": "full", "session_id": "s"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ], 0])
    batch = decode_batch(payload)
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0].block_hashes == [7, b"\x01" * 32] and batch.events[0].token_ids == TOKENS[:8]
    with pytest.raises(EventDecodeError):
        decode_batch(msgpack.packb([1.5, [{"type": "Nope"}]]))
    with pytest.raises(EventDecodeError):
        decode_batch(b"\xc1 not msgpack")
