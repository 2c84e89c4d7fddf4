"""Block keys: golden vectors, the chain rule, and agreement across processes and chain loops (C, Python)."""

import array

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from prefixpool.store import keys
from prefixpool.store.keys import KEY_BYTES, Namespace, chain, chain_ids, key_from_hex, pack_tokens

NS = Namespace("llama-3-8b")

# Pinned bytes: changing any of these changes every key in every deployed pool.
GOLDEN_NAMESPACE = (b'{"block_size":16,"cache_salt":"","dtype":"float32","model":"llama-3-8b",'
                    b'"revision":"main","scheme_version":1}')
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
        assert keys._chain_from_c(NS.root(), packed, block_size) == keys.chain_from_python(NS.root(), packed,
                                                                                            block_size)


# -- both chain loops: the same keys from every input the C loop takes ---------------------------------------------

# Pinned once from the spec written out above (struct-packed int32, xxh3_128): (block size, tokens) -> keys.
GOLDEN_TOKENS = [7 * i * i - 500 for i in range(69)] + [2**31 - 1]  # negative ids and int32's maximum
GOLDEN_CHAINS = {
    (1, 3): ["c80493caeae85cf471c01f2d33b181fd", "12b1126cb18797aaf5b7b8a8c3affc96",
             "ada5dcb6341d8e6d8409f3011f536c16"],
    (16, 70): ["20ff6c0f527c7f03c4fac742efcec23e", "a75a4ac48c3ab99918e7dd1c8aeada40",  # 4 full blocks + 6 tokens
               "897a1b261e06fce90a3e6f1b993f98bb", "325229d28a5d6cd00dfadf6bc171ae1f"],
    (16, 15): [],  # a partial block only
    (16, 0): [],
    (32, 70): ["41b0bef09dda3cb52f53703ccfd5d099", "bc731fc1d5a1de77cbb92e985bb3e792"],
    (64, 70): ["7ea248f8a0c8d41a68c360d40287ead4"],
}
GOLDEN_ROOTS = {1: "853dd93ba899085ba7d588fbd6d9d5a9", 16: "19b98284c964e18be442a1ed6d511ba5",
                32: "6e77112bc0c7946cc1ba3ebb344e912d", 64: "750f0a1b9de2c2b3dab16ae1ef7ad6f7"}

LOOPS = [
    pytest.param(keys.chain_from_python, id="python"),
    pytest.param(keys._chain_from_c, id="c", marks=pytest.mark.skipif(keys._chain_from_c is None, reason="not built")),
]


def le32(tokens: list[int]) -> bytes:
    return np.array(tokens, "<i4").tobytes()


# What chain() takes: token sequences and arrays (packed by pack_tokens) and bytes-likes (packed already).
TOKEN_INPUTS = {
    "list": list, "tuple": tuple, "int32": lambda t: np.array(t, np.int32), "int64": lambda t: np.array(t, np.int64),
    "bytes": le32, "bytearray": lambda t: bytearray(le32(t)), "memoryview": lambda t: memoryview(le32(t)),
}
# What chain_from() takes as packed tokens: any C-contiguous buffer, read as raw bytes (the router passes int32 ids).
BUFFERS = {
    "bytes": le32, "bytearray": lambda t: bytearray(le32(t)), "memoryview": lambda t: memoryview(le32(t)),
    "int32": lambda t: np.array(t, np.int32), "int32 slice": lambda t: np.array([9, *t], np.int32)[1:],
    "2-d int32": lambda t: np.array(t, np.int32)[None, :], "array": lambda t: array.array("i", t),
    "uint8 bytes": lambda t: np.frombuffer(le32(t), np.uint8),
}
PARENTS = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview,
           "uint8": lambda b: np.frombuffer(b, np.uint8)}


def golden(block_size: int, num_tokens: int) -> tuple[Namespace, list[int], list[str]]:
    return Namespace("golden", block_size=block_size), GOLDEN_TOKENS[:num_tokens], GOLDEN_CHAINS[block_size, num_tokens]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kind", TOKEN_INPUTS)
@pytest.mark.parametrize("case", GOLDEN_CHAINS)
def test_golden_chains_from_every_token_input(loop, kind, case):
    namespace, tokens, expected = golden(*case)
    assert namespace.root().hex() == GOLDEN_ROOTS[case[0]]
    packed = pack_tokens(TOKEN_INPUTS[kind](tokens))
    assert [k.hex() for k in loop(namespace.root(), packed, namespace.block_size)] == expected


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kind", BUFFERS)
@pytest.mark.parametrize("parent_kind", PARENTS)
@pytest.mark.parametrize("case", [(16, 70), (1, 3), (16, 0)])
def test_golden_chains_from_every_buffer(loop, kind, parent_kind, case):
    namespace, tokens, expected = golden(*case)
    parent = PARENTS[parent_kind](namespace.root())
    assert [k.hex() for k in loop(parent, BUFFERS[kind](tokens), case[0])] == expected


@pytest.mark.parametrize("loop", LOOPS)
def test_a_buffer_is_read_as_raw_bytes_whatever_its_dtype(loop):
    wide = np.arange(-8, 24, dtype=np.int64)  # 8 bytes a token: two int32 words each, as the C loop reads it
    words = np.frombuffer(wide.tobytes(), "<i4").tolist()
    assert loop(NS.root(), wide, 16) == keys.chain_from_python(NS.root(), pack_tokens(words), 16)
    assert len(loop(NS.root(), wide, 16)) == 4


def test_chain_gives_the_golden_keys_from_every_token_input():
    namespace, tokens, expected = golden(16, 70)
    for kind, make in TOKEN_INPUTS.items():
        assert [k.hex() for k in chain(make(tokens), namespace)] == expected, kind


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("parent, packed, block_size, error", [
    ("x" * 16, b"", 16, TypeError),                     # str has no buffer
    (bytes(16), "abcd" * 16, 16, TypeError),
    (bytes(16), list(range(16)), 16, TypeError),        # a list must go through pack_tokens
    (b"", bytes(64), 16, ValueError),                   # the parent is a 16-byte key
    (bytes(15), bytes(64), 16, ValueError),
    (bytes(17), bytes(64), 16, ValueError),
    (bytes(16), bytes(64), 0, ValueError),
    (bytes(16), bytes(64), -1, ValueError),
    (bytes(16), bytes(64), 2.0, TypeError),
])
def test_both_loops_refuse_the_same_inputs(loop, parent, packed, block_size, error):
    with pytest.raises(error):
        loop(parent, packed, block_size)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("packed", [np.arange(64, dtype=np.int32)[::2], np.arange(64, dtype=np.int32).reshape(8, 8).T,
                                    memoryview(bytes(128))[::2]], ids=["strided", "fortran", "strided memoryview"])
def test_both_loops_refuse_a_buffer_that_is_not_contiguous(loop, packed):
    with pytest.raises((ValueError, BufferError)):  # numpy says ValueError, memoryview BufferError, Python BufferError
        loop(NS.root(), packed, 4)


MAKERS = {**BUFFERS, "int64 raw": lambda t: np.array(t, np.int64), "float32 raw": lambda t: np.array(t, np.float32)}


@pytest.mark.skipif(keys._chain_from_c is None, reason="store._chain not built")
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=160), st.integers(1, 40),
       st.sampled_from(sorted(MAKERS)), st.sampled_from(sorted(PARENTS)), st.binary(min_size=16, max_size=16))
def test_c_and_python_loops_agree_on_random_inputs_of_every_kind(tokens, block_size, kind, parent_kind, parent):
    packed, head = MAKERS[kind](tokens), PARENTS[parent_kind](parent)
    expected = keys._chain_from_c(head, packed, block_size)
    assert keys.chain_from_python(head, packed, block_size) == expected
    assert len(expected) == len(memoryview(packed).tobytes()) // (4 * block_size)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=100), st.sampled_from(sorted(TOKEN_INPUTS)))
def test_pack_tokens_gives_the_same_bytes_for_every_token_input(tokens, kind):
    assert pack_tokens(TOKEN_INPUTS[kind](tokens)) == b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)


@given(st.lists(st.integers(0, 2**31 - 1), max_size=100))
def test_unsigned_arrays_pack_as_their_int32_spelling(tokens):
    assert pack_tokens(np.array(tokens, np.uint32)) == pack_tokens(np.array(tokens, np.uint64)) == pack_tokens(tokens)
