"""Block keys: golden vectors, the chain rule, and agreement across processes."""


import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from prefixpool.store.keys import KEY_BYTES, Namespace, chain, chain_ids, key_from_hex, pack_tokens

NS = Namespace("llama-3-8b")

# Pinned bytes: changing any of these changes every key in every deployed pool.
GOLDEN_NAMESPACE = b'{"block_size":16,"cache_salt":"","dtype":"float32","model":"llama-3-8b","revision":"main","scheme_version":1}'
GOLDEN_ROOT = "22e0ab2443dfce2b1af194c8f1ce397f"
GOLDEN_RANGE_40 = ["07481cf75322b968f0292a8e2387cddb", "09df2b7c5cdabe6465cac3cf53183a13"]
GOLDEN_SALTED = "6052ed98bb658f9d57e3fc93379f3f3a"


def test_golden_vectors():
    assert NS.encode() == GOLDEN_NAMESPACE
    assert NS.root().hex() == GOLDEN_ROOT
    assert [k.hex() for k in chain(list(range(40)), NS)] == GOLDEN_RANGE_40
    assert chain(list(range(16)), NS.with_salt("tenant-a"))[0].hex() == GOLDEN_SALTED


def test_chain_rule_matches_the_spec_written_out():
    tokens = list(range(1000, 1048))
    parent = xxhash.xxh3_128_digest(NS.encode())
    expected = []
    for i in range(3):
        block = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[i * 16 : (i + 1) * 16])
        parent = xxhash.xxh3_128_digest(parent + block)
        expected.append(parent)
    assert chain(tokens, NS) == expected


def test_only_full_blocks_get_keys():
    assert chain(list(range(15)), NS) == []
    assert len(chain(list(range(31)), NS)) == 1
    assert len(chain(np.arange(32), NS)) == 2


def test_every_namespace_field_changes_the_root():
    variants = [
        Namespace("other"), Namespace("llama-3-8b", revision="r2"), Namespace("llama-3-8b", dtype="bfloat16"),
        Namespace("llama-3-8b", block_size=32), Namespace("llama-3-8b", scheme_version=2),
        Namespace("llama-3-8b", cache_salt="t"),
    ]
    roots = {v.root() for v in variants} | {NS.root()}
    assert len(roots) == len(variants) + 1


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        Namespace("m", block_size=0)
    with pytest.raises(ValueError):
        pack_tokens([2**31])
    with pytest.raises(ValueError):
        key_from_hex("abcd")
    assert len(key_from_hex(GOLDEN_ROOT)) == KEY_BYTES


@given(st.lists(st.integers(0, 2**31 - 1), max_size=200), st.lists(st.integers(0, 2**31 - 1), max_size=100))
def test_shared_prefix_gives_shared_keys(prefix, suffix):
    a = chain(prefix, NS)
    b = chain(prefix + suffix, NS)
    assert b[: len(a)] == a
    assert len(b) == (len(prefix) + len(suffix)) // NS.block_size
    assert all(len(k) == KEY_BYTES for k in b)


@given(st.lists(st.integers(0, 1000), min_size=16, max_size=64), st.integers(0, 15))
def test_one_token_changes_its_block_and_every_later_key(tokens, where):
    changed = list(tokens)
    changed[where] += 1
    a, b = chain(tokens, NS), chain(changed, NS)
    assert all(x != y for x, y in zip(a, b))


def test_trace_ids_are_deterministic_and_distinct():
    ns = Namespace("trace", block_size=512)
    assert chain_ids([0, 1, 2], ns) == chain_ids([0, 1, 2], ns)
    assert len(set(chain_ids(range(1000), ns))) == 1000


def test_c_chain_loop_is_built_and_agrees_with_python():
    # scripts/install.sh installs libxxhash-dev, so the fast path must exist wherever the tests run.
    from prefixpool.store import keys

    assert keys._chain_from_c is not None, "store._chain was not built (needs gcc and libxxhash-dev)"
    packed = pack_tokens(np.random.default_rng(1).integers(0, 2**31 - 1, 16 * 300 + 5))
    for block_size in (1, 16, 512):
        assert keys._chain_from_c(NS.root(), packed, block_size) == keys.chain_from_python(NS.root(), packed, block_size)
