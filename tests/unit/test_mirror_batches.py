"""Mirror._apply hands runs of block events to the index in one call: the same index as one event at a time."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpool.meta.etcd_client import EtcdClient, WatchBatch, WatchEvent
from prefixpool.meta.layout import Layout
from prefixpool.meta.mirror import Mirror
from prefixpool.store.keys import Namespace, chain_ids

LAYOUT = Layout("batches")
KEYS = chain_ids(range(12), Namespace("batches"))
NODES = ("n0", "n1")

event = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(NODES), st.sampled_from(KEYS),
              st.sampled_from([b"device", b"host", b"%"])),  # "%": a malformed tier
    st.tuples(st.just("delete"), st.sampled_from(NODES), st.sampled_from(KEYS), st.just(b"")),
    st.tuples(st.just("foreign"), st.just(""), st.just(b""), st.just(b"x")),
)


def watch_event(kind: str, node: str, key: bytes, value: bytes, revision: int) -> WatchEvent:
    raw = LAYOUT.prefix + b"elsewhere" if kind == "foreign" else LAYOUT.block_key(key, node)
    return WatchEvent(kind != "delete", raw, value, revision)


def held(mirror: Mirror) -> dict[tuple[bytes, str], str]:
    return {(key, node): tier for key in KEYS for node in NODES if (tier := mirror.index.tier_of(node, key))}


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(st.lists(event, max_size=12), max_size=6))
def test_batched_apply_equals_one_event_at_a_time(batches):
    batched, single = (Mirror(EtcdClient("127.0.0.1:1"), LAYOUT) for _ in range(2))
    truth: dict[tuple[bytes, str], str] = {}
    revision = 0
    for events in batches:
        made = []
        for kind, node, key, value in events:
            revision += 1
            made.append(watch_event(kind, node, key, value, revision))
            if kind == "put" and value != b"%":
                truth[(key, node)] = value.decode()
            elif kind != "foreign":
                truth.pop((key, node), None)  # a delete, or a malformed value replacing a good one
        batched._apply(WatchBatch(revision, made))
        for one in made:
            single._apply(WatchBatch(one.revision, [one]))
        assert held(batched) == held(single) == truth
        assert batched.num_skipped == single.num_skipped
